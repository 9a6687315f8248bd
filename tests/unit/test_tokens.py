"""Token quotas: reservation at admission and reconciliation at completion, on a fake clock."""

from __future__ import annotations

import pytest

from qosgate.auth import Tenant
from qosgate.config import LimitsConfig
from qosgate.quota.tokens import (
    TokenQuota,
    TokenRefusal,
    TokenReservation,
    estimate_prompt_tokens,
    seconds_to_next_utc_day,
    utc_day,
)
from tests.fakes import FakeClock

NOON = 1_767_225_600.0 + 12 * 3600  # 2026-01-01 12:00 UTC


class FakeTotals:
    """The ledger's per-day totals as a dict."""

    def __init__(self) -> None:
        self.used: dict[tuple[str, str], int] = {}

    def tokens_used(self, tenant: str, day: str) -> int:
        return self.used.get((tenant, day), 0)

    def add(self, tenant: str, day: str, tokens: int) -> None:
        self.used[(tenant, day)] = self.tokens_used(tenant, day) + tokens


class Wall:
    def __init__(self, clock: FakeClock) -> None:
        self._clock, self._offset = clock, NOON - clock.now()

    def __call__(self) -> float:
        return self._clock.now() + self._offset


def tenant(**limits: int) -> Tenant:
    return Tenant(
        name="acme", weight=1.0, default_class="standard", max_class="standard",
        models=("*",), admin=False, limits=LimitsConfig(**limits),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def totals() -> FakeTotals:
    return FakeTotals()


@pytest.fixture
def quota(clock: FakeClock, totals: FakeTotals) -> TokenQuota:
    return TokenQuota(clock=clock, wall_time=Wall(clock), totals=totals)


def test_no_limits_always_reserves(quota: TokenQuota) -> None:
    assert isinstance(quota.reserve(tenant(), 10**9), TokenReservation)


def test_reservation_takes_the_estimate_and_refuses_with_exact_retry(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=600)  # refills 10 tokens/s
    assert isinstance(quota.reserve(t, 500), TokenReservation)
    refusal = quota.reserve(t, 200)
    assert isinstance(refusal, TokenRefusal)
    assert refusal.retry_after_s == pytest.approx(10.0)  # 100 left, 100 missing at 10/s
    assert refusal.violations[0].subject == "tenant:acme/tokens_per_minute"
    assert "600" in refusal.violations[0].description


def test_retry_after_is_honest(quota: TokenQuota, clock: FakeClock) -> None:
    t = tenant(tokens_per_minute=600)
    quota.reserve(t, 600)
    refusal = quota.reserve(t, 150)
    assert isinstance(refusal, TokenRefusal)
    clock.advance(refusal.retry_after_s)
    assert isinstance(quota.reserve(t, 150), TokenReservation)


def test_reconcile_returns_unused_tokens(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=600)
    early_stop = quota.reserve(t, 600)  # prompt estimate + max_tokens
    assert isinstance(early_stop, TokenReservation)
    assert isinstance(quota.reserve(t, 100), TokenRefusal)
    quota.reconcile(early_stop, used=150)  # stopped early: 450 come back at once
    assert isinstance(quota.reserve(t, 450), TokenReservation)
    assert isinstance(quota.reserve(t, 1), TokenRefusal)


def test_reconcile_charges_an_underestimate_as_debt(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=600)
    r = quota.reserve(t, 100)
    quota.reconcile(r, used=700)  # 600 beyond the reservation: the level is now -100
    refusal = quota.reserve(t, 60)
    assert isinstance(refusal, TokenRefusal)
    assert refusal.retry_after_s == pytest.approx(16.0)  # from -100 up to 60 at 10/s


def test_reconcile_is_bounded_by_capacity(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=600)
    r = quota.reserve(t, 100)
    quota.reconcile(r, used=0)
    assert isinstance(quota.reserve(t, 600), TokenReservation)
    assert isinstance(quota.reserve(t, 1), TokenRefusal)


def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=60)
    assert isinstance(quota.reserve(t, 100), TokenReservation)
    refusal = quota.reserve(t, 100)
    assert isinstance(refusal, TokenRefusal)
    assert refusal.retry_after_s == pytest.approx(100.0)  # from -40 to the full 60 at 1/s


def test_daily_budget_counts_ledger_and_in_flight(quota: TokenQuota, totals: FakeTotals) -> None:
    t = tenant(daily_token_budget=1000)
    day = utc_day(NOON)
    totals.add("acme", day, 700)
    first = quota.reserve(t, 200)
    assert isinstance(first, TokenReservation)
    refusal = quota.reserve(t, 200)  # 700 used + 200 in flight + 200 > 1000
    assert isinstance(refusal, TokenRefusal)
    assert refusal.violations[0].subject == "tenant:acme/daily_token_budget"
    assert "100 tokens left" in refusal.violations[0].description
    assert refusal.retry_after_s == pytest.approx(12 * 3600)  # until 00:00 UTC
    totals.add("acme", day, 50)  # the first request finished: recorded, then reconciled
    quota.reconcile(first, used=50)
    assert isinstance(quota.reserve(t, 200), TokenReservation)


def test_daily_budget_resets_on_the_next_utc_day(quota: TokenQuota, clock: FakeClock, totals: FakeTotals) -> None:
    t = tenant(daily_token_budget=100)
    totals.add("acme", utc_day(NOON), 100)
    refusal = quota.reserve(t, 1)
    assert isinstance(refusal, TokenRefusal)
    clock.advance(refusal.retry_after_s)
    assert isinstance(quota.reserve(t, 100), TokenReservation)


def test_both_limits_report_both_violations_and_the_longer_wait(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=60, daily_token_budget=100)
    assert isinstance(quota.reserve(t, 60), TokenReservation)
    quota_refusal = quota.reserve(t, 50)
    assert isinstance(quota_refusal, TokenRefusal)
    assert {v.subject for v in quota_refusal.violations} == {
        "tenant:acme/daily_token_budget",
        "tenant:acme/tokens_per_minute",
    }
    assert quota_refusal.retry_after_s == pytest.approx(12 * 3600)


def test_a_refusal_takes_nothing(quota: TokenQuota) -> None:
    t = tenant(tokens_per_minute=600)
    quota.reserve(t, 550)
    for _ in range(5):
        assert isinstance(quota.reserve(t, 100), TokenRefusal)
    assert isinstance(quota.reserve(t, 50), TokenReservation)


def test_tenants_are_independent(quota: TokenQuota) -> None:
    quota.reserve(tenant(tokens_per_minute=60), 60)
    other = Tenant(
        name="globex", weight=1.0, default_class="standard", max_class="standard",
        models=("*",), admin=False, limits=LimitsConfig(tokens_per_minute=60),
    )
    assert isinstance(quota.reserve(other, 60), TokenReservation)


def test_estimate_leans_high_and_utc_helpers() -> None:
    assert estimate_prompt_tokens("") == 1
    assert estimate_prompt_tokens("What is the capital of France?") >= 7  # 7 real SmolLM2 tokens
    assert utc_day(NOON) == "2026-01-01"
    assert seconds_to_next_utc_day(NOON) == pytest.approx(12 * 3600)
