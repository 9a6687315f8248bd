"""Who is calling and what they may do: API key → Tenant, class and admin checks.

Keys are only ever held as SHA-256 digests: the config may carry a digest or a demo key in
plain text, and an incoming key is hashed before lookup. No function here logs a key.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from qosgate.config import GatewayConfig, LimitsConfig, TenantConfig
from qosgate.errors import InvalidArgument, PermissionDenied, Unauthenticated

_BEARER = "bearer "


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

    def __post_init__(self) -> None:
        alternation = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.models) or "(?!)"
        object.__setattr__(self, "_models_re", re.compile(alternation))

    def allows_model(self, name: str) -> bool:
        return self._models_re.match(name) is not None


class TenantDirectory:
    """The tenants of the current config, looked up by the key a request carries."""

    def __init__(self, config: GatewayConfig) -> None:
        self._classes = tuple(config.classes)
        self._levels = {klass: i for i, klass in enumerate(config.classes)}
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
        self._tenants, self._by_digest = tenants, by_digest
        self._by_name = {tenant.name: tenant for tenant in tenants}

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

    def identify(self, metadata: Mapping[str, str]) -> Tenant:
        """The tenant whose key is in `authorization: Bearer KEY` or `x-api-key: KEY`.

        Metadata keys are expected lower-case (as gRPC delivers them).
        """
        key = _presented_key(metadata)
        if not key:
            raise Unauthenticated(
                "missing API key: send 'authorization: Bearer <key>' or 'x-api-key'"
            )
        digest = hashlib.sha256(key.encode()).digest()
        # Keys are compared as SHA-256 digests: the lookup's timing can only reveal how a
        # guess's digest relates to stored digests, which says nothing usable about any key,
        # so a hash lookup is as safe as a constant-time scan and O(1).
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant

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
        if not tenant.allows_model(model):
            raise PermissionDenied(f"tenant {tenant.name!r} may not use model {model!r}")


def _presented_key(metadata: Mapping[str, str]) -> str:
    authorization = metadata.get("authorization")
    if authorization is not None:
        if authorization[: len(_BEARER)].lower() == _BEARER:
            return authorization[len(_BEARER) :].strip()
        return ""
    return metadata.get("x-api-key", "").strip()
