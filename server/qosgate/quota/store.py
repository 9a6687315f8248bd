"""Where request-rate, concurrency and token-rate state lives: behind a role Protocol so a
shared (Redis) store can replace the in-process one without touching admission.

`daily_token_budget` is not here: it is counted per UTC day against the persistent usage
ledger by `qosgate.quota.tokens.DailyTokenBudget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from qosgate.config import LimitsConfig
from qosgate.errors import QuotaViolation
from qosgate.quota.bucket import TokenBucket
from qosgate.quota.verdict import Refused

# When a concurrency slot frees is unknowable here; a short hint keeps polite clients close.
CONCURRENCY_RETRY_AFTER_S = 0.1


class QuotaStore(Protocol):
    """Per-tenant quota state with atomic check-and-charge.

    Async because a shared store (Redis) answers over the network; `now` is the caller's
    clock, which a shared store may replace with its own (see `RedisQuotaStore`).
    `in_process` is True for a store whose coroutines never suspend: a caller may run
    them outside a task (eager.run_eagerly), which a network client's timeouts forbid.
    """

    in_process: bool

    async def acquire(
        self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int
    ) -> Refused | None:
        """Charge one request (and `cost_tokens`) against every limit, or nothing at all.

        Returns None when admitted, else a Refused naming every exceeded limit, with the
        wait after which all of them would admit the request.
        """
        ...

    async def release(
        self,
        tenant: str,
        limits: LimitsConfig,
        now: float,
        reserved_tokens: int,
        actual_tokens: int | None,
    ) -> None:
        """End an admitted request: free its concurrency slot; when `actual_tokens` is
        given, return unused reserved tokens (or take the excess, as debt)."""
        ...


@dataclass(slots=True)
class _TenantState:
    limits: LimitsConfig
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


class InMemoryQuotaStore:
    """Quota state in this process; correct for one gateway process, on one event loop.

    Its coroutines never suspend, so a check-and-charge is atomic on the event loop.
    """

    in_process = True

    def __init__(self) -> None:
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: str, limits: LimitsConfig, now: float) -> _TenantState:
        state = self._states.get(tenant)
        # Identity first: the same config object every call, until a reload.
        if state is None or (state.limits is not limits and state.limits != limits):
            # New tenant or new limits after a reload: fresh buckets, but in-flight requests
            # still count against concurrency.
            state = _TenantState(
                limits=limits,
                requests=_rate_bucket(limits, now),
                tokens=_token_bucket(limits, now),
                in_flight=state.in_flight if state is not None else 0,
            )
            self._states[tenant] = state
        return state

    async def acquire(
        self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int
    ) -> Refused | None:
        return self.acquire_now(tenant, limits, now, cost_tokens)

    async def release(
        self, tenant: str, limits: LimitsConfig, now: float, reserved_tokens: int, actual_tokens: int | None
    ) -> None:
        self.release_now(tenant, limits, now, reserved_tokens, actual_tokens)

    # `acquire` and `release` without a coroutine, for a caller that knows it has this store.

    def acquire_now(self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int) -> Refused | None:
        state = self._state(tenant, limits, now)
        requests, tokens = state.requests, state.tokens
        rate_wait = requests.wait_s(now, 1) if requests is not None else 0.0
        token_wait = tokens.wait_s(now, cost_tokens) if tokens is not None and cost_tokens else 0.0
        at_concurrency = (
            limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent
        )
        if rate_wait or token_wait or at_concurrency:
            return refusal(tenant, limits, rate_wait, token_wait, at_concurrency)
        if requests is not None:
            requests.take(now, 1)
        if tokens is not None and cost_tokens:
            tokens.take(now, cost_tokens)
        state.in_flight += 1
        return None

    def release_now(
        self, tenant: str, limits: LimitsConfig, now: float, reserved_tokens: int, actual_tokens: int | None
    ) -> None:
        state = self._states.get(tenant)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        # After a reload replaced the bucket, the reservation was made in the old one.
        if actual_tokens is None or state.tokens is None or (state.limits is not limits and state.limits != limits):
            return
        extra = actual_tokens - reserved_tokens
        if extra > 0:
            state.tokens.take(now, extra)
        elif extra < 0:
            state.tokens.give_back(now, -extra)

    def in_flight(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return state.in_flight if state is not None else 0


# A refusal's violations by tenant and which limits refused (rate, concurrency, tokens),
# with the limits they were described from: a tenant retrying in a loop is refused the same
# way thousands of times a second, and is described once per limits object (a reload's new
# one is described again). At most eight entries per tenant of the config.
_described: dict[tuple[str, bool, bool, bool], tuple[LimitsConfig, tuple[QuotaViolation, ...]]] = {}


def refusal(
    tenant: str, limits: LimitsConfig, rate_wait: float, token_wait: float, at_concurrency: bool
) -> Refused:
    """The Refused for these waits (seconds; 0.0 = that limit admits) and a full house."""
    key = (tenant, bool(rate_wait), at_concurrency, bool(token_wait))
    known = _described.get(key)
    if known is None or known[0] is not limits:
        known = _described[key] = (limits, _violations(tenant, limits, *key[1:]))
    concurrency_wait = CONCURRENCY_RETRY_AFTER_S if at_concurrency else 0.0
    return Refused(max(rate_wait, token_wait, concurrency_wait), known[1])


def _violations(
    tenant: str, limits: LimitsConfig, rate: bool, at_concurrency: bool, tokens: bool
) -> tuple[QuotaViolation, ...]:
    # Descriptions are formatted only on refusal: admission itself stays free of strings.
    subject = f"tenant:{tenant}"
    violations = []
    if rate:
        violations.append(
            QuotaViolation(
                subject,
                f"requests_per_second limit {limits.requests_per_second:g} "
                f"(burst {limits.effective_burst()}) exceeded",
            )
        )
    if at_concurrency:
        violations.append(
            QuotaViolation(subject, f"max_concurrent limit {limits.max_concurrent} reached")
        )
    if tokens:
        violations.append(
            QuotaViolation(subject, f"tokens_per_minute limit {limits.tokens_per_minute} exceeded")
        )
    return tuple(violations)


def _rate_bucket(limits: LimitsConfig, now: float) -> TokenBucket | None:
    burst = limits.effective_burst()
    if limits.requests_per_second is None or burst is None:
        return None
    return TokenBucket.full(limits.requests_per_second, burst, now)


def _token_bucket(limits: LimitsConfig, now: float) -> TokenBucket | None:
    if limits.tokens_per_minute is None:
        return None
    return TokenBucket.full(limits.tokens_per_minute / 60.0, limits.tokens_per_minute, now)
