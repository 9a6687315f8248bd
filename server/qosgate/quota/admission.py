"""Admission: a tenant's request against its quotas, decided as a value."""

from __future__ import annotations

from qosgate.auth import Tenant
from qosgate.clock import Clock
from qosgate.quota.store import QuotaStore
from qosgate.quota.verdict import Admitted, Permit, Verdict


class Admission:
    """Checks and charges a tenant's limits in one step; see `QuotaStore.acquire`."""

    def __init__(self, store: QuotaStore, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    def admit(self, tenant: Tenant, *, cost_tokens: int = 0) -> Verdict:
        """Admitted(permit) or Refused(retry_after_s, violations); a refusal charges nothing.

        `cost_tokens` is the request's estimated LLM tokens (prompt + max new tokens); the
        permit's release(actual_tokens) settles the difference.
        """
        limits = tenant.limits
        refused = self._store.acquire(tenant.name, limits, self._clock.now(), cost_tokens)
        if refused is not None:
            return refused
        store, clock, name = self._store, self._clock, tenant.name

        def release(reserved_tokens: int, actual_tokens: int | None) -> None:
            store.release(name, limits, clock.now(), reserved_tokens, actual_tokens)

        return Admitted(Permit(reserved_tokens=cost_tokens, _release=release))
