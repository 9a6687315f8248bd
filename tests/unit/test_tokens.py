"""Token quotas on fake time: tokens_per_minute reserved and reconciled through Admission
(cost_tokens, permit.release(actual_tokens)); the persistent daily budget per UTC day."""

from __future__ import annotations

import pytest

from qosgate.auth import Tenant
from qosgate.config import LimitsConfig
from qosgate.clock import utc_day
from qosgate.quota import Admission, Admitted, InMemoryQuotaStore, Refused
from qosgate.quota.tokens import (
    BudgetReservation,
    DailyTokenBudget,
    estimate_prompt_tokens,
    seconds_to_next_utc_day,
)
from tests.fakes import FakeClock, FakeWall

NOON = 1_767_225_600.0 + 12 * 3600  # 2026-01-01 12:00 UTC


def tenant(name: str = "acme", **limits: int) -> Tenant:
    return Tenant(
        name=name, weight=1.0, default_class="standard", max_class="standard",
        models=("*",), admin=False, limits=LimitsConfig(**limits),
    )


class FakeTotals:
    """The usage meter's per-day totals as a dict."""

    def __init__(self) -> None:
        self.used: dict[tuple[str, str], int] = {}

    async def tokens_used(self, tenant: str, day: str) -> int:
        return self.used.get((tenant, day), 0)

    def add(self, tenant: str, day: str, tokens: int) -> None:
        self.used[(tenant, day)] = self.used.get((tenant, day), 0) + tokens



@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def admission(clock: FakeClock) -> Admission:
    return Admission(InMemoryQuotaStore(), clock)


# tokens_per_minute: reservation at admission, reconciliation at release


async def test_reservation_takes_the_estimate_and_refuses_with_exact_retry(admission: Admission) -> None:
    t = tenant(tokens_per_minute=600)  # refills 10 tokens/s
    assert isinstance(await admission.admit(t, cost_tokens=500), Admitted)
    refusal = await admission.admit(t, cost_tokens=200)
    assert isinstance(refusal, Refused)
    assert refusal.retry_after_s == pytest.approx(10.0)  # 100 left, 100 missing at 10/s
    assert "tokens_per_minute" in refusal.violations[0].description


async def test_retry_after_is_honest(admission: Admission, clock: FakeClock) -> None:
    t = tenant(tokens_per_minute=600)
    await admission.admit(t, cost_tokens=600)
    refusal = await admission.admit(t, cost_tokens=150)
    assert isinstance(refusal, Refused)
    clock.advance(refusal.retry_after_s)
    assert isinstance(await admission.admit(t, cost_tokens=150), Admitted)


async def test_an_early_stop_costs_only_what_it_used(admission: Admission) -> None:
    t = tenant(tokens_per_minute=600)
    early_stop = await admission.admit(t, cost_tokens=600)  # prompt estimate + max_tokens
    assert isinstance(early_stop, Admitted)
    assert isinstance(await admission.admit(t, cost_tokens=100), Refused)
    await early_stop.permit.release(actual_tokens=150)  # 450 come back at once
    assert isinstance(await admission.admit(t, cost_tokens=450), Admitted)
    assert isinstance(await admission.admit(t, cost_tokens=1), Refused)


async def test_an_underestimate_is_charged_as_debt(admission: Admission) -> None:
    t = tenant(tokens_per_minute=600)
    verdict = await admission.admit(t, cost_tokens=100)
    assert isinstance(verdict, Admitted)
    await verdict.permit.release(actual_tokens=700)  # 600 beyond the reservation: level -100
    refusal = await admission.admit(t, cost_tokens=60)
    assert isinstance(refusal, Refused)
    assert refusal.retry_after_s == pytest.approx(16.0)  # from -100 up to 60 at 10/s


async def test_release_is_idempotent_and_bounded_by_capacity(admission: Admission) -> None:
    t = tenant(tokens_per_minute=600)
    verdict = await admission.admit(t, cost_tokens=100)
    assert isinstance(verdict, Admitted)
    await verdict.permit.release(actual_tokens=0)
    await verdict.permit.release(actual_tokens=0)
    assert isinstance(await admission.admit(t, cost_tokens=600), Admitted)
    assert isinstance(await admission.admit(t, cost_tokens=1), Refused)


async def test_a_refusal_takes_nothing(admission: Admission) -> None:
    t = tenant(tokens_per_minute=600)
    await admission.admit(t, cost_tokens=550)
    for _ in range(5):
        assert isinstance(await admission.admit(t, cost_tokens=100), Refused)
    assert isinstance(await admission.admit(t, cost_tokens=50), Admitted)


# daily_token_budget: ledger totals + in-flight reservations, per UTC day


async def test_no_budget_always_reserves() -> None:
    budget = DailyTokenBudget(wall_time=FakeWall(NOON), totals=FakeTotals())
    assert isinstance(await budget.reserve(tenant(), 10**9), BudgetReservation)


async def test_daily_budget_counts_ledger_and_in_flight() -> None:
    totals = FakeTotals()
    budget = DailyTokenBudget(wall_time=FakeWall(NOON), totals=totals)
    t = tenant(daily_token_budget=1000)
    day = utc_day(NOON)
    totals.add("acme", day, 700)
    first = await budget.reserve(t, 200)
    assert isinstance(first, BudgetReservation)
    refusal = await budget.reserve(t, 200)  # 700 used + 200 in flight + 200 > 1000
    assert isinstance(refusal, Refused)
    assert refusal.violations[0].subject == "tenant:acme"
    assert "100 tokens left" in refusal.violations[0].description
    assert refusal.retry_after_s == pytest.approx(12 * 3600)  # until 00:00 UTC
    totals.add("acme", day, 50)  # the first request finished: recorded, then settled
    budget.settle(first)
    assert isinstance(await budget.reserve(t, 200), BudgetReservation)


async def test_daily_budget_resets_on_the_next_utc_day() -> None:
    totals, wall = FakeTotals(), FakeWall(NOON)
    budget = DailyTokenBudget(wall_time=wall, totals=totals)
    t = tenant(daily_token_budget=100)
    totals.add("acme", utc_day(NOON), 100)
    refusal = await budget.reserve(t, 1)
    assert isinstance(refusal, Refused)
    wall.now += refusal.retry_after_s
    assert isinstance(await budget.reserve(t, 100), BudgetReservation)


async def test_settling_a_reservation_of_yesterday_leaves_today_alone() -> None:
    wall = FakeWall(NOON + 12 * 3600 - 1)
    budget = DailyTokenBudget(wall_time=wall, totals=FakeTotals())
    t = tenant(daily_token_budget=100)
    yesterday = await budget.reserve(t, 60)
    assert isinstance(yesterday, BudgetReservation)
    wall.now += 2
    today = await budget.reserve(t, 100)
    assert isinstance(today, BudgetReservation)
    budget.settle(yesterday)
    assert isinstance(await budget.reserve(t, 1), Refused)  # today's 100 still in flight


async def test_tenants_have_separate_budgets() -> None:
    budget = DailyTokenBudget(wall_time=FakeWall(NOON), totals=FakeTotals())
    assert isinstance(await budget.reserve(tenant(daily_token_budget=10), 10), BudgetReservation)
    assert isinstance(await budget.reserve(tenant("globex", daily_token_budget=10), 10), BudgetReservation)


def test_estimate_leans_high_and_utc_helpers() -> None:
    assert estimate_prompt_tokens("") == 1
    assert estimate_prompt_tokens("What is the capital of France?") >= 7  # 7 real SmolLM2 tokens
    assert utc_day(NOON) == "2026-01-01"
    assert seconds_to_next_utc_day(NOON) == pytest.approx(12 * 3600)
