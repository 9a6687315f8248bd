"""Domain errors as the grpcio server's statuses (the admin and batch services): the
error table's gRPC form (`transport.status`) as grpcio takes it."""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from qosgate.transport.status import status_of


def to_status(error: BaseException) -> grpc.Status:
    """A grpc.Status (code, details text, trailing metadata with the rich status)."""
    return rpc_status.to_status(status_pb2.Status.FromString(status_of(error)[2]))


async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with `error`'s status; never returns (raises grpc's abort exception)."""
    status = to_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
