"""TLS at the gateway's edges: the listeners' contexts (the relay terminates TLS for gRPC,
aiohttp for the OpenAI API, with the same certificate and client CA), the upstreams' (the
HTTP/2 connections every call to Triton takes), and the caller's verified client
certificate.

The config has already checked that every file exists and parses (config.py); here the
files are read when a listener or connection is made. Key bytes go only to the TLS
library, never to a log or an error message.

The relay owns the listener and hands the calls it does not relay itself to the
in-process grpcio server over a private unix socket. That server never sees the TLS
handshake, so the relay passes the verified certificate on in two headers it sets after
removing any a caller sent (`certificate_headers`); the grpcio server's handlers read
them back (`certificate_from_metadata`). Only the relay can reach that socket.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Iterable, Sequence


from qosgate.auth import ClientCertificate
from qosgate.config import ListenerTlsConfig, UpstreamTlsConfig

# The headers the relay sets for the grpcio server; a caller's own are dropped first.
PEER_HEADER_PREFIX = b"qosgate-peer-"
_CERT_SHA256 = PEER_HEADER_PREFIX + b"cert-sha256"
_CERT_SAN = PEER_HEADER_PREFIX + b"cert-san"
# grpcio hands metadata keys over as text.
_CERT_SHA256_KEY, _CERT_SAN_KEY = _CERT_SHA256.decode(), _CERT_SAN.decode()
_ALPN = ["h2"]
# The OpenAI API's listener speaks HTTP/1.1 (aiohttp).
HTTP1_ALPN = ("http/1.1",)


def server_context(config: ListenerTlsConfig, alpn: Sequence[str] = _ALPN) -> ssl.SSLContext:
    """A listener's TLS (HTTP/2 by ALPN unless `alpn` says): its certificate and key; with
    `client_ca`, client certificates are required and verified against it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.cert, config.key)
    context.set_alpn_protocols(list(alpn))
    if config.client_ca is not None:
        context.load_verify_locations(cafile=config.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(config: UpstreamTlsConfig) -> ssl.SSLContext:
    """TLS to a Triton for the relay's connections: verify it against `ca` (or the system
    roots); present `cert` when set."""
    context = ssl.create_default_context(cafile=config.ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    if config.cert is not None:
        context.load_cert_chain(config.cert, config.key)
    return context


def peer_certificate(ssl_object: ssl.SSLObject | None) -> ClientCertificate | None:
    """The certificate the caller presented in the handshake (verified against
    `tls.client_ca` before the connection was accepted), or None without one."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    # subjectAltName entries are (kind, value) pairs: ("URI", "spiffe://..."), ("DNS", ...).
    entries = (ssl_object.getpeercert() or {}).get("subjectAltName", ())
    sans = tuple(str(entry[1]) for entry in entries)
    return ClientCertificate(sha256=hashlib.sha256(der).hexdigest(), sans=sans)


def certificate_headers(certificate: ClientCertificate) -> list[tuple[bytes, bytes]]:
    """`certificate` as the headers the grpcio server's handlers read back."""
    return [
        (_CERT_SHA256, certificate.sha256.encode()),
        *((_CERT_SAN, san.encode("utf-8", "replace")) for san in certificate.sans),
    ]


def certificate_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> ClientCertificate | None:
    """The certificate the relay passed on in a call's metadata, or None."""
    sha256 = None
    sans: list[str] = []
    for key, value in metadata:
        if key == _CERT_SHA256_KEY:
            sha256 = value if isinstance(value, str) else value.decode()
        elif key == _CERT_SAN_KEY:
            sans.append(value if isinstance(value, str) else value.decode())
    return None if sha256 is None else ClientCertificate(sha256=sha256, sans=tuple(sans))
