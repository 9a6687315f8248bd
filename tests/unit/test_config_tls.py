"""TLS config: real certificate files load; each kind of unusable file or inconsistent key
is refused with the key path and file name, and never with a key's content."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from certificates import CertificateAuthority, Issued
from cryptography.hazmat.primitives import serialization
from qosgate.config import ConfigError, parse_config


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority(tmp_path_factory.mktemp("certs"), "config")


@pytest.fixture(scope="module")
def server(ca: CertificateAuthority) -> Issued:
    return ca.server()


def listener(server: Issued, ca: CertificateAuthority | None = None, **overrides: str) -> dict[str, str]:
    tls = {"cert": str(server.cert), "key": str(server.key)}
    if ca is not None:
        tls["client_ca"] = str(ca.cert)
    return {**tls, **overrides}


def problem(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="t.yaml")
    return str(caught.value)


def test_listener_and_upstream_tls_load(ca: CertificateAuthority, server: Issued) -> None:
    client = ca.client("gateway")
    config = parse_config(
        {
            "tls": listener(server, ca),
            "upstreams": [
                {"name": "plain", "url": "127.0.0.1:8001"},
                {
                    "name": "secure",
                    "url": "triton.example:8001",
                    "tls": {"ca": str(ca.cert), "cert": str(client.cert), "key": str(client.key)},
                },
                {"name": "system-roots", "url": "triton.example:443", "tls": {}},
            ],
            "tenants": [
                {"name": "acme", "client_certs": [{"san": "spiffe://qosgate.test/acme"}]},
                {"name": "globex", "client_certs": [{"sha256": client.fingerprint}]},
            ],
        }
    )
    assert config.tls is not None and config.tls.client_ca == str(ca.cert)
    assert [u.tls is not None for u in config.upstreams] == [False, True, True]
    assert config.tenants[1].client_certs[0].identity() == ("sha256", client.fingerprint)


def test_missing_and_unparsable_files(ca: CertificateAuthority, server: Issued, tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "missing.pem"
    assert problem({"tls": listener(server, cert=str(missing))}) == (
        f"t.yaml: tls.cert: cannot read {missing}: No such file or directory"
    )
    assert problem({"tls": listener(server, key=str(missing))}) == (
        f"t.yaml: tls.key: cannot read {missing}: No such file or directory"
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    assert problem({"tls": listener(server, ca, client_ca=str(garbage))}) == (
        f"t.yaml: tls.client_ca: {garbage} is not a CA certificate file (PEM)"
    )
    # A private key where a certificate belongs: the message names the file, not its bytes.
    assert problem({"upstreams": [{"name": "u", "url": "h:1", "tls": {"ca": str(server.key)}}]}) == (
        f"t.yaml: upstreams[0].tls.ca: {server.key} is not a CA certificate file (PEM)"
    )


def test_a_key_that_does_not_fit_is_refused_without_echoing_it(
    ca: CertificateAuthority, server: Issued, tmp_path: pathlib.Path
) -> None:
    other = ca.client("other")
    message = problem({"tls": listener(server, key=str(other.key))})
    assert message == (
        f"t.yaml: tls.key: {other.key} is not an unencrypted PEM private key for the certificate {server.cert}"
    )
    key_body = other.key.read_text().splitlines()[1]
    assert key_body not in message
    # Encrypted keys are refused (grpc and Triton read keys without a passphrase).
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(server.key.read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    assert problem({"tls": listener(server, key=str(encrypted))}).startswith(
        f"t.yaml: tls.key: {encrypted} is not an unencrypted PEM private key"
    )


def test_upstream_client_certificate_needs_its_key(ca: CertificateAuthority) -> None:
    client = ca.client("half")
    assert problem({"upstreams": [{"name": "u", "url": "h:1", "tls": {"cert": str(client.cert)}}]}) == (
        "t.yaml: upstreams[0].tls: set both cert and key, or neither"
    )


def test_tenant_client_certificates(ca: CertificateAuthority, server: Issued) -> None:
    san = {"san": "spiffe://qosgate.test/acme"}
    assert problem({"tls": listener(server), "tenants": [{"name": "acme", "client_certs": [san]}]}) == (
        "t.yaml: tenants[0].client_certs[0]: client certificates need tls.client_ca (mutual TLS)"
    )
    assert problem({"tenants": [{"name": "acme", "client_certs": [{"sha256": "ab" * 31}]}]}) == (
        "t.yaml: tenants[0].client_certs[0].sha256: must be 64 hex digits (colons allowed)"
    )
    assert problem({"tenants": [{"name": "acme", "client_certs": [{**san, "sha256": "ab" * 32}]}]}) == (
        "t.yaml: tenants[0].client_certs[0]: set exactly one of sha256, san"
    )
    assert problem(
        {
            "tls": listener(server, ca),
            "tenants": [
                {"name": "acme", "client_certs": [{"sha256": "AB" * 32}]},
                {"name": "globex", "client_certs": [san, {"sha256": ":".join(["ab"] * 32)}]},
            ],
        }
    ) == "t.yaml: tenants[1].client_certs[1]: duplicate client certificate sha256 (also used by tenant 'acme')"
