"""The verified client certificate as the relay passes it to the gateway's grpcio server."""

from __future__ import annotations

from qosgate.auth import ClientCertificate
from qosgate.tls import PEER_HEADER_PREFIX, certificate_from_metadata, certificate_headers


def test_a_certificate_survives_the_trip_through_headers() -> None:
    certificate = ClientCertificate(sha256="ab" * 32, sans=("spiffe://example.com/acme", "acme.example.com"))
    headers = certificate_headers(certificate)
    assert all(name.startswith(PEER_HEADER_PREFIX) for name, _ in headers)
    # grpcio hands metadata over as text, other headers around them.
    metadata = [("authorization", "Bearer k"), *((name.decode(), value.decode()) for name, value in headers)]
    assert certificate_from_metadata(metadata) == certificate


def test_no_headers_no_certificate() -> None:
    assert certificate_from_metadata([("authorization", "Bearer k")]) is None
    no_sans = ClientCertificate(sha256="cd" * 32, sans=())
    assert certificate_from_metadata([(n.decode(), v) for n, v in certificate_headers(no_sans)]) == no_sans
