"""Who is calling and what they may do: API key or client certificate → Tenant, class and
admin checks.

Keys are only ever held as SHA-256 digests: the config may carry a digest or a demo key in
plain text, and an incoming key is hashed before lookup. No function here logs a key.

A client certificate reaches this module as a ClientCertificate value that the front end
took from the TLS handshake (already verified against `tls.client_ca`): identification
stays free of any transport.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from qosgate.config import GatewayConfig, LimitsConfig, TenantConfig
from qosgate.errors import InvalidArgument, PermissionDenied, Unauthenticated

# C0 controls and DEL: no model name holds one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

_BEARER = "bearer"
# The headers a call may present its API key in.
AUTHORIZATION, API_KEY = "authorization", "x-api-key"
# Credentials one connection remembers (ConnectionCredentials): a caller uses one key or two.
_REMEMBERED_PER_CONNECTION = 8


@dataclass(frozen=True, slots=True)
class ClientCertificate:
    """The verified certificate a caller presented in the mutual TLS handshake."""

    sha256: str
    """Fingerprint of the certificate's DER bytes, lower-case hex."""
    sans: tuple[str, ...]
    """Its subjectAltName entries (DNS names, URIs, e-mail addresses, IP addresses)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A caller of the gateway as the domain sees it (built from its TenantConfig)."""

    name: str
    weight: float
    default_class: str
    max_class: str
    models: tuple[str, ...]
    admin: bool
    limits: LimitsConfig
    # One compiled alternation of all patterns: one regex match per request, not one per pattern.
    _models_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _any_model: bool = field(init=False, repr=False, compare=False)  # "*" (the default): no match to run

    def __post_init__(self) -> None:
        alternation = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.models) or "(?!)"
        object.__setattr__(self, "_models_re", re.compile(alternation))
        object.__setattr__(self, "_any_model", "*" in self.models)

    def allows_model(self, name: str) -> bool:
        return self._any_model or self._models_re.match(name) is not None


class ConnectionCredentials:
    """One caller connection as identification sees it: the certificate of its TLS
    handshake, and the tenants its credential headers identified (`identify_on`).

    A caller's calls on one HTTP/2 connection carry the same key, so the calls after the
    first are identified by a dict lookup on the header bytes instead of parsing and
    hashing the key again. The bytes kept are those HPACK's table holds for the connection
    anyway, and they go with it. Only identifications that succeeded are kept, a few per
    connection, and a reload of the tenants forgets them.
    """

    __slots__ = ("certificate", "generation", "tenants")

    def __init__(self, certificate: ClientCertificate | None = None) -> None:
        self.certificate = certificate
        self.generation = -1  # the directory's generation the entries below belong to
        self.tenants: dict[tuple[tuple[bytes, bytes], ...], Tenant] = {}


class TenantDirectory:
    """The tenants of the current config, looked up by the key a request carries."""

    def __init__(self, config: GatewayConfig) -> None:
        self._classes = tuple(config.classes)
        self._levels = {klass: i for i, klass in enumerate(config.classes)}
        self._generation = 0  # counts replacements: what connections remember is of one
        self.replace(config)

    def replace(self, config: GatewayConfig) -> None:
        """Take `config`'s tenants (a reload; its classes must be the ones already in use).

        Requests already admitted keep the Tenant they were identified as; the next lookup
        sees the new keys, weights, classes, models and limits.
        """
        tenants = tuple(self._tenant(config, t) for t in config.tenants)
        by_digest = {
            key.digest(): tenant
            for tenant_config, tenant in zip(config.tenants, tenants, strict=True)
            for key in tenant_config.api_keys
        }
        by_cert = {
            cert.identity(): tenant
            for tenant_config, tenant in zip(config.tenants, tenants, strict=True)
            for cert in tenant_config.client_certs
        }
        self._tenants, self._by_digest, self._by_cert = tenants, by_digest, by_cert
        self._by_name = {tenant.name: tenant for tenant in tenants}
        self._generation += 1

    @staticmethod
    def _tenant(config: GatewayConfig, t: TenantConfig) -> Tenant:
        default = t.default_class or config.gateway_default_class()
        return Tenant(
            name=t.name,
            weight=t.weight,
            default_class=default,
            max_class=t.max_class or default,
            models=tuple(t.models),
            admin=t.admin,
            limits=t.limits,
        )

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._tenants

    def named(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def identify(
        self, metadata: Iterable[tuple[str, str | bytes]], certificate: ClientCertificate | None = None
    ) -> Tenant:
        """The tenant whose key is in `authorization: Bearer KEY` or `x-api-key: KEY`, or
        whose `client_certs` match `certificate` (the caller's verified TLS certificate).

        `metadata` is the call's metadata as sent, repeated keys included (lower-case, as
        gRPC delivers them). Either credential alone identifies; both must name the same
        tenant. An ambiguous caller is never guessed at: the same key header twice, both
        key headers naming different keys (which one a proxy passes on first is not ours
        to guess), a key that names no tenant beside a certificate that does, and a
        certificate that matches entries of two tenants are all refused. A certificate
        that matches no tenant leaves identification to the key.
        """
        by_cert = self._certificate_tenant(certificate) if certificate is not None else None
        key = _presented_key(metadata)
        if not key:
            if by_cert is not None:
                return by_cert
            raise Unauthenticated(
                "missing API key: send 'authorization: Bearer <key>' or 'x-api-key'"
                + ("; the client certificate identifies no tenant" if certificate is not None else "")
            )
        digest = hashlib.sha256(key.encode(errors="surrogatepass")).digest()
        # Keys are compared as SHA-256 digests: the lookup's timing can only reveal how a
        # guess's digest relates to stored digests, which says nothing usable about any key,
        # so a hash lookup is as safe as a constant-time scan and O(1).
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise Unauthenticated("invalid API key")
        if by_cert is not None and by_cert is not tenant:
            raise Unauthenticated("the API key and the client certificate identify different tenants")
        return tenant

    def identify_on(self, connection: ConnectionCredentials, credentials: tuple[tuple[bytes, bytes], ...]) -> Tenant:
        """`identify` for a call on `connection` whose `authorization` and `x-api-key`
        headers are `credentials` (raw, in the order sent): what an earlier call on the
        connection with the same headers was identified as, if the tenants have not been
        reloaded since."""
        if connection.generation != self._generation:
            connection.tenants.clear()
            connection.generation = self._generation
        tenant = connection.tenants.get(credentials)
        if tenant is None:
            metadata = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in credentials]
            tenant = self.identify(metadata, connection.certificate)
            if len(connection.tenants) < _REMEMBERED_PER_CONNECTION:
                connection.tenants[credentials] = tenant
        return tenant

    def _certificate_tenant(self, certificate: ClientCertificate) -> Tenant | None:
        """The one tenant `certificate` maps to (fingerprint or any SAN), if any."""
        identities = [("sha256", certificate.sha256), *(("san", san) for san in certificate.sans)]
        found = [tenant for i in identities if (tenant := self._by_cert.get(i)) is not None]
        if any(tenant is not found[0] for tenant in found):
            raise Unauthenticated("the client certificate matches more than one tenant")
        return found[0] if found else None

    def resolve_class(self, tenant: Tenant, requested: str | None) -> str:
        """The class a request runs in: the requested one (`x-priority`) or the tenant's default."""
        if not requested:
            return tenant.default_class
        level = self._levels.get(requested)
        if level is None:
            raise InvalidArgument(
                f"unknown priority class {requested!r}; classes: {', '.join(self._classes)}"
            )
        if level < self._levels[tenant.max_class]:
            raise PermissionDenied(
                f"tenant {tenant.name!r} may not use class {requested!r} (max {tenant.max_class!r})"
            )
        return requested

    def require_admin(self, tenant: Tenant, what: str) -> None:
        if not tenant.admin:
            raise PermissionDenied(f"{what} requires an admin tenant")

    def require_model(self, tenant: Tenant, model: str) -> None:
        if _CONTROL.search(model):
            # Triton ends a name at its first NUL: `minilm\0-public` would pass the pattern
            # `*-public` and run minilm, under a model of its own in metrics and queues.
            raise InvalidArgument(f"model name {model!r} holds a control character")
        if not tenant.allows_model(model):
            raise PermissionDenied(f"tenant {tenant.name!r} may not use model {model!r}")


def _presented_key(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The one API key the call presents ("" when none, or only empty ones); Unauthenticated
    when it presents several or a malformed one. Values are read trimmed, as gRPC servers
    read them. No message names a key."""
    presented = [(name, value) for name, value in metadata if name in (AUTHORIZATION, API_KEY)]
    if len({name for name, _ in presented}) < len(presented):
        raise Unauthenticated("more than one credential header: send one API key, once")
    keys = set()
    for name, value in presented:
        # Only `-bin` keys carry bytes; these two never do.
        text = value.strip() if isinstance(value, str) else ""
        if name == AUTHORIZATION and text:
            scheme, *rest = text.split(None, 1)
            text = rest[0] if rest else ""
            if scheme.lower() != _BEARER:
                raise Unauthenticated("the authorization header must be 'Bearer <key>'")
        keys.add(text.strip())
    if len(keys) > 1:
        raise Unauthenticated("authorization and x-api-key name different keys: send one")
    return keys.pop() if keys else ""
