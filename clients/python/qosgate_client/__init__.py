"""Python client for the qosgate.v1 gRPC API: a small library and the `qosgate-client` CLI."""

from qosgate_client.client import Client, ClientError, TlsOptions

__all__ = ["Client", "ClientError", "TlsOptions"]
