"""Admission: a tenant's request against its quotas, decided as a value."""

from __future__ import annotations

from functools import partial

from qosgate.auth import Tenant
from qosgate.clock import Clock
from qosgate.config import LimitsConfig
from qosgate.quota.store import InMemoryQuotaStore, QuotaStore
from qosgate.quota.verdict import Admitted, Permit, Verdict


class Admission:
    """Checks and charges a tenant's request rate, concurrency and token rate in one step
    (see `QuotaStore.acquire`)."""

    def __init__(self, store: QuotaStore, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        # Quota state in this process is charged and freed without a coroutine (`admit_now`).
        self._local = store if isinstance(store, InMemoryQuotaStore) else None

    def in_process(self, limits: LimitsConfig) -> bool:
        """Admitting and releasing a request of a tenant with `limits` never wait: the
        quota state is in this process (see QuotaStore.in_process), or it counts nothing."""
        return self._store.in_process or not limits.counted()

    async def admit(self, tenant: Tenant, *, cost_tokens: int = 0) -> Verdict:
        """Admitted(permit) or Refused(retry_after_s, violations); a refusal charges nothing.

        `cost_tokens` is an LLM request's estimated tokens (prompt + max new tokens), taken
        from its tokens_per_minute bucket; `permit.release(actual_tokens)` settles it.
        """
        decided = self.admit_now(tenant, cost_tokens=cost_tokens)
        if decided is not None:
            return decided
        limits = tenant.limits
        refused = await self._store.acquire(tenant.name, limits, self._clock.now(), cost_tokens)
        if refused is not None:
            return refused
        return Admitted(Permit(cost_tokens, partial(self._release, tenant.name, limits, cost_tokens)))

    def admit_now(self, tenant: Tenant, *, cost_tokens: int = 0) -> Verdict | None:
        """`admit` decided at once where the quota state is in this process, or where the
        tenant has no limit to count (its permit releases at once too); None where it
        is not: await `admit`."""
        local, limits = self._local, tenant.limits
        if local is None:
            # A shared store has nothing to count for a tenant without limits: no round trip.
            return None if limits.counted() else Admitted(Permit(cost_tokens, None))
        refused = local.acquire_now(tenant.name, limits, self._clock.now(), cost_tokens)
        if refused is not None:
            return refused
        return Admitted(Permit(cost_tokens, partial(self._release_now, local, tenant.name, limits, cost_tokens)))

    async def _release(
        self, tenant: str, limits: LimitsConfig, reserved_tokens: int, actual_tokens: int | None
    ) -> None:
        await self._store.release(tenant, limits, self._clock.now(), reserved_tokens, actual_tokens)

    def _release_now(
        self, local: InMemoryQuotaStore, tenant: str, limits: LimitsConfig, reserved_tokens: int,
        actual_tokens: int | None,
    ) -> None:
        local.release_now(tenant, limits, self._clock.now(), reserved_tokens, actual_tokens)
