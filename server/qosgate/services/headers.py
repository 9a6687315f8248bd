"""The request metadata the gateway reads (API key, class, Triton's error header)."""

from __future__ import annotations

import grpc


def text_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata by key (lower-case, as gRPC delivers it); binary (`-bin`)
    entries are left out: none of the headers the gateway reads is binary."""
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
