"""LLM token quotas: estimate at admission, settle with the engine's counts at completion.

- `tokens_per_minute` lives with the other rate limits in `Admission`: the request is
  admitted with `cost_tokens` = `estimate_prompt_tokens(prompt) + max_tokens`, and
  `permit.release(actual_tokens)` gives back what the request did not use.
- `daily_token_budget` is counted here, per UTC day, against the usage meter (the
  persistent ledger, so it survives restarts and kill -9; or the day totals all gateways
  share in Redis) plus this gateway's reservations of requests in flight (so its
  concurrent requests cannot overshoot it together).

Pure arithmetic on injected wall time; the meter is reached through `DailyTotals`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from qosgate.auth import Tenant
from qosgate.clock import DAY_S, utc_day
from qosgate.errors import QuotaViolation
from qosgate.quota.verdict import Refused

# A deliberately high estimate of tokens per UTF-8 byte of prompt: BPE vocabularies average
# 3.5-4.5 bytes per token on English text and code, fewer on other scripts. Over-reserving
# only delays a request at the limit; reconciliation returns the difference.
_BYTES_PER_TOKEN = 3


def estimate_prompt_tokens(prompt: str) -> int:
    """An upper-leaning estimate of the tokens `prompt` will be (used only to reserve)."""
    return math.ceil(len(prompt.encode("utf-8")) / _BYTES_PER_TOKEN) + 1


def seconds_to_next_utc_day(wall_time: float) -> float:
    return DAY_S - (wall_time % DAY_S)


class DailyTotals(Protocol):
    """Where completed requests' tokens are counted per tenant and UTC day (the usage meter)."""

    async def tokens_used(self, tenant: str, day: str) -> int: ...


@dataclass(frozen=True, slots=True)
class BudgetReservation:
    """Tokens set aside in one tenant's daily budget until `DailyTokenBudget.settle`."""

    tenant: str
    tokens: int
    day: str


class DailyTokenBudget:
    """`daily_token_budget` of every tenant, per UTC day."""

    def __init__(self, *, wall_time: Callable[[], float], totals: DailyTotals) -> None:
        """`wall_time` gives Unix seconds (it names the day); `totals` is the ledger."""
        self._wall_time = wall_time
        self._totals = totals
        # (tenant, day) → tokens reserved by requests admitted that day and not settled.
        self._in_flight: dict[tuple[str, str], int] = {}

    async def reserve(self, tenant: Tenant, tokens: int) -> BudgetReservation | Refused:
        """Set `tokens` aside for a request of `tenant`, or refuse until the next UTC day."""
        wall = self._wall_time()
        day = utc_day(wall)
        key = (tenant.name, day)
        budget = tenant.limits.daily_token_budget
        if budget is not None:
            used = await self._totals.tokens_used(tenant.name, day)
            # In-flight reservations are read after the await: check and reserve below run
            # without a suspension in between, so concurrent requests cannot both fit.
            committed = used + self._in_flight.get(key, 0)
            if committed + tokens > budget:
                left = max(0, budget - committed)
                violation = QuotaViolation(
                    subject=f"tenant:{tenant.name}",
                    description=(
                        f"daily_token_budget {budget} has {left} tokens left today (UTC); "
                        f"this request reserves {tokens}"
                    ),
                )
                return Refused(seconds_to_next_utc_day(wall), (violation,))
        self._in_flight[key] = self._in_flight.get(key, 0) + tokens
        return BudgetReservation(tenant.name, tokens, day)

    def settle(self, reservation: BudgetReservation) -> None:
        """Drop a reservation once the request is over; settle each reservation once.

        Call after its usage was recorded in the ledger, so the day's count never misses
        the request in between.
        """
        key = (reservation.tenant, reservation.day)
        left = self._in_flight.get(key, 0) - reservation.tokens
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)
