"""TLS at the gRPC edges: the listener's credentials, the upstream channels' credentials,
and the caller's verified client certificate taken from a call's auth context.

The config has already checked that every file exists and parses (config.py); here the
files are read when a listener or channel is made. Key bytes go only to grpc, never to a
log or an error message.
"""

from __future__ import annotations

import functools
import hashlib
import ssl

import grpc

from qosgate.auth import ClientCertificate
from qosgate.config import ListenerTlsConfig, UpstreamTlsConfig

# Properties grpc's TLS transport puts in a call's auth context (grpc_security_constants.h).
_PEM_CERT = "x509_pem_cert"
_SANS = "x509_subject_alternative_name"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(config: ListenerTlsConfig) -> grpc.ServerCredentials:
    """The listener's TLS: its certificate and key; with `client_ca`, client certificates
    are required and verified against it (grpc's Python API cannot ask for an optional one)."""
    client_ca = _read(config.client_ca) if config.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(_read(config.key), _read(config.cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(config: UpstreamTlsConfig) -> grpc.ChannelCredentials:
    """TLS to a Triton: verify it against `ca` (or the system roots); present `cert` when set."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.ca) if config.ca is not None else None,
        private_key=_read(config.key) if config.key is not None else None,
        certificate_chain=_read(config.cert) if config.cert is not None else None,
    )


def client_certificate(context: grpc.aio.ServicerContext) -> ClientCertificate | None:
    """The certificate the caller presented in the TLS handshake (grpc has verified it
    against `tls.client_ca` before any call arrives), or None on a plaintext or
    server-only TLS connection."""
    properties = context.auth_context()
    pem = next(iter(properties.get(_PEM_CERT, ())), None)
    if pem is None:
        return None
    return _certificate(pem, tuple(properties.get(_SANS, ())))


@functools.lru_cache(maxsize=256)
def _certificate(pem: bytes, sans: tuple[bytes, ...]) -> ClientCertificate:
    # Every call on a connection carries the same certificate: decode and hash it once.
    der = ssl.PEM_cert_to_DER_cert(pem.decode("ascii"))
    return ClientCertificate(
        sha256=hashlib.sha256(der).hexdigest(),
        sans=tuple(san.decode("utf-8", errors="replace") for san in sans),
    )
