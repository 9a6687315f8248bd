"""Where quota state lives: behind a role Protocol so a shared (Redis) store can replace the
in-process one without touching admission."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from qosgate.config import LimitsConfig
from qosgate.errors import QuotaViolation
from qosgate.quota.bucket import TokenBucket, WindowBudget
from qosgate.quota.verdict import Refused

DAY_S = 86_400.0
# When a concurrency slot frees is unknowable here; a short hint keeps polite clients close.
CONCURRENCY_RETRY_AFTER_S = 0.1


class QuotaStore(Protocol):
    """Per-tenant quota state with atomic check-and-charge."""

    def acquire(
        self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int
    ) -> Refused | None:
        """Charge one request (and `cost_tokens`) against every limit, or nothing at all.

        Returns None when admitted, else a Refused naming every exceeded limit, with the
        wait after which all of them would admit the request.
        """
        ...

    def release(
        self,
        tenant: str,
        limits: LimitsConfig,
        now: float,
        reserved_tokens: int,
        actual_tokens: int | None,
    ) -> None:
        """End an admitted request: free its concurrency slot, settle its token estimate."""
        ...


@dataclass(slots=True)
class _TenantState:
    limits: LimitsConfig
    requests: TokenBucket | None
    tokens: TokenBucket | None
    budget: WindowBudget | None
    in_flight: int = 0


class InMemoryQuotaStore:
    """Quota state in this process; correct for one gateway process, on one event loop."""

    def __init__(self) -> None:
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: str, limits: LimitsConfig, now: float) -> _TenantState:
        state = self._states.get(tenant)
        if state is None or state.limits != limits:
            # New tenant or new limits after a reload: fresh buckets, but in-flight requests
            # still count against concurrency.
            in_flight = state.in_flight if state is not None else 0
            state = _TenantState(
                limits=limits,
                requests=_rate_bucket(limits, now),
                tokens=_token_bucket(limits, now),
                budget=_daily_budget(limits, now),
                in_flight=in_flight,
            )
            self._states[tenant] = state
        return state

    def acquire(
        self, tenant: str, limits: LimitsConfig, now: float, cost_tokens: int
    ) -> Refused | None:
        state = self._state(tenant, limits, now)
        charged_tokens = cost_tokens > 0
        over_concurrency = limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent
        waits = (
            state.requests.wait_s(now, 1) if state.requests is not None else 0.0,
            CONCURRENCY_RETRY_AFTER_S if over_concurrency else 0.0,
            state.tokens.wait_s(now, cost_tokens) if state.tokens and charged_tokens else 0.0,
            state.budget.wait_s(now, cost_tokens) if state.budget and charged_tokens else 0.0,
        )
        if any(waits):
            return _refusal(tenant, limits, waits)
        if state.requests is not None:
            state.requests.take(now, 1)
        if state.tokens is not None and cost_tokens > 0:
            state.tokens.take(now, cost_tokens)
        if state.budget is not None and cost_tokens > 0:
            state.budget.charge(now, cost_tokens)
        state.in_flight += 1
        return None

    def release(
        self,
        tenant: str,
        limits: LimitsConfig,
        now: float,
        reserved_tokens: int,
        actual_tokens: int | None,
    ) -> None:
        state = self._states.get(tenant)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if actual_tokens is None or state.limits != limits:
            return
        extra = actual_tokens - reserved_tokens
        if state.tokens is not None:
            if extra > 0:
                state.tokens.take(now, extra)
            elif extra < 0:
                state.tokens.give_back(now, -extra)
        if state.budget is not None:
            state.budget.charge(now, extra)

    def in_flight(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return state.in_flight if state is not None else 0


# One description per entry of the `waits` tuple in `acquire`, formatted only on refusal so
# admission stays free of string formatting.
_DESCRIPTIONS: tuple[Callable[[LimitsConfig], str], ...] = (
    lambda limits: (
        f"requests_per_second limit {limits.requests_per_second:g} "
        f"(burst {limits.effective_burst()}) exceeded"
    ),
    lambda limits: f"max_concurrent limit {limits.max_concurrent} reached",
    lambda limits: f"tokens_per_minute limit {limits.tokens_per_minute} exceeded",
    lambda limits: f"daily_token_budget {limits.daily_token_budget} exhausted",
)


def _refusal(tenant: str, limits: LimitsConfig, waits: tuple[float, ...]) -> Refused:
    subject = f"tenant:{tenant}"
    return Refused(
        retry_after_s=max(waits),
        violations=tuple(
            QuotaViolation(subject, describe(limits))
            for wait, describe in zip(waits, _DESCRIPTIONS, strict=True)
            if wait > 0
        ),
    )


def _rate_bucket(limits: LimitsConfig, now: float) -> TokenBucket | None:
    burst = limits.effective_burst()
    if limits.requests_per_second is None or burst is None:
        return None
    return TokenBucket.full(limits.requests_per_second, burst, now)


def _token_bucket(limits: LimitsConfig, now: float) -> TokenBucket | None:
    if limits.tokens_per_minute is None:
        return None
    return TokenBucket.full(limits.tokens_per_minute / 60.0, limits.tokens_per_minute, now)


def _daily_budget(limits: LimitsConfig, now: float) -> WindowBudget | None:
    if limits.daily_token_budget is None:
        return None
    return WindowBudget(limit=limits.daily_token_budget, window_s=DAY_S, start=now)
