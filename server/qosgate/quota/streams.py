"""Streams per tenant: how many long-lived streaming calls a tenant holds open at once.

Counted in this process whatever the quota store: an open stream costs this gateway
memory and an upstream stream, so the bound is per gateway, not shared across replicas.
"""

from __future__ import annotations

from functools import partial

from qosgate.auth import Tenant
from qosgate.errors import QuotaViolation
from qosgate.quota.verdict import Admitted, Permit, Refused, Verdict

# When a stream closes is unknowable (streams live for minutes): a hint of the order of
# a stream's life keeps a polite client from spinning.
STREAM_RETRY_AFTER_S = 1.0


class StreamLimiter:
    """Open streams per tenant against `max_streams` (its own, or the gateway default)."""

    def __init__(self, default_max_streams: int) -> None:
        self._default = default_max_streams
        self._open: dict[str, int] = {}

    def max_streams(self, tenant: Tenant) -> int:
        own = tenant.limits.max_streams
        return self._default if own is None else own

    def open(self, tenant: Tenant) -> Verdict:
        """Admitted (release the permit when the stream ends) or Refused, as a value."""
        limit = self.max_streams(tenant)
        held = self._open.get(tenant.name, 0)
        if held >= limit:
            violation = QuotaViolation(f"tenant:{tenant.name}", f"max_streams limit {limit} reached")
            return Refused(STREAM_RETRY_AFTER_S, (violation,))
        self._open[tenant.name] = held + 1
        return Admitted(Permit(0, partial(self._close, tenant.name)))

    def open_streams(self, tenant: str) -> int:
        return self._open.get(tenant, 0)

    def _close(self, tenant: str, _actual_tokens: int | None) -> None:
        left = self._open.get(tenant, 0) - 1
        if left > 0:
            self._open[tenant] = left
        else:
            self._open.pop(tenant, None)
