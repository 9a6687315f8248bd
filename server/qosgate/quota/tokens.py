"""Token quotas of LLM requests: reserve an estimate at admission, reconcile at completion.

Two limits, both per tenant and both optional:
- `tokens_per_minute`: a TokenBucket of that capacity refilling at tokens_per_minute/60
  per second. Admission takes the estimate (prompt tokens + max_tokens); completion gives
  back what was not used (or takes the excess when the prompt estimate was low).
- `daily_token_budget`: tokens per UTC day. Completed requests count from the persistent
  usage ledger (so the count survives restarts); requests in flight count with their
  reservation, so concurrent requests cannot overshoot the budget together.

Pure arithmetic on injected time; the ledger is reached through `DailyTotals`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from qosgate.auth import Tenant
from qosgate.clock import Clock
from qosgate.errors import QuotaViolation
from qosgate.quota.bucket import TokenBucket

# A deliberately high estimate of tokens per UTF-8 byte of prompt: BPE vocabularies average
# 3.5-4.5 bytes per token on English text and code, fewer on other scripts. Over-reserving
# only delays a request at the limit; reconciliation returns the difference.
_BYTES_PER_TOKEN = 3


def estimate_prompt_tokens(prompt: str) -> int:
    """An upper-leaning estimate of the tokens `prompt` will be (used only to reserve)."""
    return math.ceil(len(prompt.encode("utf-8")) / _BYTES_PER_TOKEN) + 1


def utc_day(wall_time: float) -> str:
    """The UTC day of a Unix time as YYYY-MM-DD: the unit of the daily budget."""
    return dt.datetime.fromtimestamp(wall_time, dt.UTC).strftime("%Y-%m-%d")


def seconds_to_next_utc_day(wall_time: float) -> float:
    return 86400.0 - (wall_time % 86400.0)


class DailyTotals(Protocol):
    """Where completed requests' tokens are counted per tenant and UTC day (the ledger)."""

    def tokens_used(self, tenant: str, day: str) -> int: ...


@dataclass(frozen=True, slots=True)
class TokenReservation:
    """Tokens set aside for one admitted request until `TokenQuota.reconcile`."""

    tenant: str
    tokens: int
    day: str


@dataclass(frozen=True, slots=True)
class TokenRefusal:
    """Not admitted: retrying after `retry_after_s` may succeed."""

    retry_after_s: float
    violations: tuple[QuotaViolation, ...]


@dataclass(slots=True)
class _TenantTokens:
    bucket: TokenBucket | None
    # Reserved by requests still in flight, per UTC day of their admission.
    in_flight: dict[str, int] = field(default_factory=dict)


class TokenQuota:
    """tokens_per_minute and daily_token_budget for all tenants of one gateway."""

    def __init__(
        self,
        *,
        clock: Clock,
        wall_time: Callable[[], float],
        totals: DailyTotals,
    ) -> None:
        """`clock` drives the per-minute buckets; `wall_time` (Unix seconds) names the day."""
        self._clock = clock
        self._wall_time = wall_time
        self._totals = totals
        self._tenants: dict[str, _TenantTokens] = {}

    def _state(self, tenant: Tenant) -> _TenantTokens:
        state = self._tenants.get(tenant.name)
        per_minute = tenant.limits.tokens_per_minute
        if state is None:
            bucket = None
            if per_minute is not None:
                bucket = TokenBucket.full(per_minute / 60.0, float(per_minute), self._clock.now())
            state = self._tenants[tenant.name] = _TenantTokens(bucket)
        elif per_minute is not None and (state.bucket is None or state.bucket.capacity != per_minute):
            # A config reload changed the limit: keep what was spent, apply the new shape.
            state.bucket = TokenBucket.full(per_minute / 60.0, float(per_minute), self._clock.now())
        elif per_minute is None:
            state.bucket = None
        return state

    def reserve(self, tenant: Tenant, tokens: int) -> TokenReservation | TokenRefusal:
        """Set `tokens` aside for a request of `tenant`, or say why not and for how long."""
        state = self._state(tenant)
        wall = self._wall_time()
        day = utc_day(wall)
        violations: list[QuotaViolation] = []
        retry_after = 0.0
        budget = tenant.limits.daily_token_budget
        if budget is not None:
            committed = self._totals.tokens_used(tenant.name, day) + state.in_flight.get(day, 0)
            if committed + tokens > budget:
                left = max(0, budget - committed)
                violations.append(
                    QuotaViolation(
                        subject=f"tenant:{tenant.name}/daily_token_budget",
                        description=(
                            f"daily token budget of {budget} has {left} tokens left today "
                            f"(UTC); this request reserves {tokens}"
                        ),
                    )
                )
                retry_after = max(retry_after, seconds_to_next_utc_day(wall))
        bucket = state.bucket
        now = self._clock.now()
        if bucket is not None:
            wait = bucket.wait_s(now, tokens)
            if wait > 0:
                violations.append(
                    QuotaViolation(
                        subject=f"tenant:{tenant.name}/tokens_per_minute",
                        description=(
                            f"tokens_per_minute limit of {int(bucket.capacity)} reached; "
                            f"this request reserves {tokens} tokens"
                        ),
                    )
                )
                retry_after = max(retry_after, wait)
        if violations:
            return TokenRefusal(retry_after, tuple(violations))
        if bucket is not None:
            bucket.take(now, tokens)
        state.in_flight[day] = state.in_flight.get(day, 0) + tokens
        return TokenReservation(tenant.name, tokens, day)

    def reconcile(self, reservation: TokenReservation, used: int) -> None:
        """Settle a reservation once the request is over, with the tokens it really used.

        Call after the usage was recorded in the ledger, so that the daily count never
        drops the request in between. Unused tokens return to the bucket; tokens beyond
        the reservation are taken from it (the bucket may go below zero, delaying the
        tenant's next requests by exactly that debt).
        """
        state = self._tenants.get(reservation.tenant)
        if state is None:
            return
        left = state.in_flight.get(reservation.day, 0) - reservation.tokens
        if left > 0:
            state.in_flight[reservation.day] = left
        else:
            state.in_flight.pop(reservation.day, None)
        if state.bucket is not None:
            now = self._clock.now()
            if used < reservation.tokens:
                state.bucket.give_back(now, reservation.tokens - used)
            elif used > reservation.tokens:
                state.bucket.take(now, used - reservation.tokens)
