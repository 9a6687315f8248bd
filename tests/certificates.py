"""Real X.509 certificates made at test time (the `cryptography` package): a CA, a server
certificate for 127.0.0.1/localhost, client certificates with a SAN of our choosing.

Files are written as PEM (keys unencrypted, as grpc and Triton need them); `fingerprint`
is the SHA-256 of the certificate's DER bytes, the form tenants' `client_certs` use.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its key on disk."""

    cert: pathlib.Path
    key: pathlib.Path
    fingerprint: str


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into `directory`."""

    def __init__(self, directory: pathlib.Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
        self._cert = (
            self._builder(self._subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, name: str, *, sans: list[x509.GeneralName], server: bool) -> Issued:
        """A leaf certificate named `name` (its CN) with `sans`, for a server or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        cert_path = self.directory / f"{name}.pem"
        key_path = self.directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert_path, key_path, cert.fingerprint(hashes.SHA256()).hex())

    def server(self, name: str = "server") -> Issued:
        """A server certificate valid for 127.0.0.1 and localhost."""
        sans: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        return self.issue(name, sans=sans, server=True)

    def client(self, name: str, uri: str | None = None) -> Issued:
        """A client certificate whose SAN is `uri` (default spiffe://qosgate.test/NAME)."""
        sans: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(uri or f"spiffe://qosgate.test/{name}")
        ]
        return self.issue(name, sans=sans, server=False)
