"""Identity from a client certificate (mutual TLS) beside or instead of an API key: which
credential wins, and every ambiguity refused."""

from __future__ import annotations

import pathlib

import pytest
from certificates import CertificateAuthority
from qosgate.auth import ClientCertificate, ConnectionCredentials, TenantDirectory
from qosgate.config import parse_config
from qosgate.errors import Unauthenticated

ACME_FINGERPRINT = "ab" * 32
ACME_SAN = "spiffe://qosgate.test/acme"
GLOBEX_SAN = "spiffe://qosgate.test/globex"


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> TenantDirectory:
    ca = CertificateAuthority(tmp_path_factory.mktemp("certs"), "unit")
    server = ca.server()
    tls = {"cert": str(server.cert), "key": str(server.key), "client_ca": str(ca.cert)}
    return TenantDirectory(
        parse_config(
            {
                "tls": tls,
                "tenants": [
                    {
                        "name": "acme",
                        "api_keys": [{"key": "acme-1"}],
                        # Colons and upper case as `openssl x509 -fingerprint` prints them.
                        "client_certs": [
                            {"sha256": ":".join(["AB"] * 32)},
                            {"san": ACME_SAN},
                        ],
                    },
                    {"name": "globex", "api_keys": [{"key": "globex-1"}], "client_certs": [{"san": GLOBEX_SAN}]},
                    {"name": "keyonly", "api_keys": [{"key": "keyonly-1"}]},
                ],
            }
        )
    )


def cert(sha256: str = "cd" * 32, *sans: str) -> ClientCertificate:
    return ClientCertificate(sha256=sha256, sans=sans)


@pytest.mark.parametrize(
    ("metadata", "certificate", "tenant"),
    [
        ([], cert(ACME_FINGERPRINT), "acme"),
        ([], cert("cd" * 32, "DNS-like.example", ACME_SAN), "acme"),
        ([], cert(ACME_FINGERPRINT, ACME_SAN), "acme"),  # two entries, one tenant
        ([], cert("cd" * 32, GLOBEX_SAN), "globex"),
        # Both credentials naming the same tenant.
        ([("authorization", "Bearer globex-1")], cert("cd" * 32, GLOBEX_SAN), "globex"),
        # A certificate mapped to no tenant (mTLS for transport only): the key decides.
        ([("authorization", "Bearer keyonly-1")], cert("ef" * 32, "spiffe://qosgate.test/other"), "keyonly"),
        ([("x-api-key", "acme-1")], cert(), "acme"),
    ],
)
def test_identify_by_certificate(
    directory: TenantDirectory, metadata: list[tuple[str, str]], certificate: ClientCertificate, tenant: str
) -> None:
    assert directory.identify(metadata, certificate).name == tenant
    # The relay's way: the connection's certificate and the call's raw key headers, twice.
    connection = ConnectionCredentials(certificate)
    raw = tuple((name.encode(), value.encode()) for name, value in metadata)
    assert [directory.identify_on(connection, raw).name for _ in range(2)] == [tenant] * 2


@pytest.mark.parametrize(
    ("metadata", "certificate", "message"),
    [
        ([("authorization", "Bearer globex-1")], cert(ACME_FINGERPRINT), "identify different tenants"),
        ([("x-api-key", "keyonly-1")], cert("cd" * 32, ACME_SAN), "identify different tenants"),
        ([], cert(ACME_FINGERPRINT, GLOBEX_SAN), "matches more than one tenant"),
        ([], cert("cd" * 32, ACME_SAN, GLOBEX_SAN), "matches more than one tenant"),
        # A wrong key is never rescued by a good certificate.
        ([("authorization", "Bearer nope")], cert(ACME_FINGERPRINT), "invalid API key"),
        ([], cert(), "missing API key: .*; the client certificate identifies no tenant"),
    ],
)
def test_identify_refuses_ambiguous_or_unknown(
    directory: TenantDirectory, metadata: list[tuple[str, str]], certificate: ClientCertificate, message: str
) -> None:
    with pytest.raises(Unauthenticated, match=message):
        directory.identify(metadata, certificate)
    connection = ConnectionCredentials(certificate)
    raw = tuple((name.encode(), value.encode()) for name, value in metadata)
    with pytest.raises(Unauthenticated, match=message):
        directory.identify_on(connection, raw)


def test_reload_replaces_the_certificate_map(tmp_path: pathlib.Path) -> None:
    ca = CertificateAuthority(tmp_path, "reload")
    server = ca.server()
    tls = {"cert": str(server.cert), "key": str(server.key), "client_ca": str(ca.cert)}
    moved = TenantDirectory(
        parse_config({"tls": tls, "tenants": [{"name": "acme", "client_certs": [{"san": ACME_SAN}]}]})
    )
    assert moved.identify([], cert("cd" * 32, ACME_SAN)).name == "acme"
    moved.replace(parse_config({"tls": tls, "tenants": [{"name": "globex", "client_certs": [{"san": ACME_SAN}]}]}))
    assert moved.identify([], cert("cd" * 32, ACME_SAN)).name == "globex"
