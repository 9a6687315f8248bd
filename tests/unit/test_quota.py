"""Token-bucket refill math and admission verdicts, on a fake clock."""

from __future__ import annotations

import pytest
from qosgate.auth import Tenant
from qosgate.errors import QuotaExceeded
from qosgate.quota import Admission, Admitted, InMemoryQuotaStore, Refused, StreamLimiter, TokenBucket

from tests.fakes import FakeClock, make_tenant


def tenant(**limits: float) -> Tenant:
    return make_tenant("acme", limits=limits)


def test_bucket_starts_full_and_allows_exactly_burst() -> None:
    bucket = TokenBucket.full(rate=2.0, capacity=5, now=0.0)
    for _ in range(5):
        assert bucket.wait_s(0.0, 1) == 0.0
        bucket.take(0.0, 1)
    assert bucket.wait_s(0.0, 1) == pytest.approx(0.5)


def test_bucket_refills_at_rate_and_caps_at_capacity() -> None:
    bucket = TokenBucket.full(rate=4.0, capacity=10, now=0.0)
    bucket.take(0.0, 10)
    bucket.wait_s(1.0, 1)
    assert bucket.level == pytest.approx(4.0)
    bucket.wait_s(100.0, 1)
    assert bucket.level == 10


@pytest.mark.parametrize("rate", [0.3, 3.0, 7.0, 50.0, 1000.0])
def test_retry_after_is_exact(rate: float) -> None:
    bucket = TokenBucket.full(rate=rate, capacity=3, now=10.0)
    bucket.take(10.0, 3)
    wait = bucket.wait_s(10.0, 1)
    assert wait == pytest.approx(1 / rate)
    # Just before the advertised moment it is still refused, at the moment it is granted.
    assert bucket.wait_s(10.0 + wait * 0.999, 1) > 0
    assert bucket.wait_s(10.0 + wait, 1) == 0.0


def test_bucket_ignores_a_stale_now() -> None:
    bucket = TokenBucket.full(rate=1.0, capacity=2, now=5.0)
    bucket.take(5.0, 2)
    assert bucket.wait_s(4.0, 1) == pytest.approx(1.0)
    assert bucket.updated == 5.0


def test_cost_above_capacity_is_admitted_when_full_and_paid_for_later() -> None:
    bucket = TokenBucket.full(rate=10.0, capacity=100, now=0.0)
    assert bucket.wait_s(0.0, 250) == 0.0
    bucket.take(0.0, 250)
    assert bucket.level == -150
    assert bucket.wait_s(0.0, 1) == pytest.approx(15.1)


async def test_admission_rate_limit_refuses_with_exact_retry_after() -> None:
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    acme = tenant(requests_per_second=5, burst=2)
    for _ in range(2):
        verdict = await admission.admit(acme)
        assert isinstance(verdict, Admitted)
        await verdict.permit.release()
    refused = await admission.admit(acme)
    assert isinstance(refused, Refused)
    assert refused.retry_after_s == pytest.approx(0.2)
    assert [v.subject for v in refused.violations] == ["tenant:acme"]
    assert "requests_per_second limit 5 (burst 2)" in refused.violations[0].description
    clock.advance(refused.retry_after_s)
    assert isinstance(await admission.admit(acme), Admitted)


async def test_default_burst_is_the_rate_rounded_up() -> None:
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    acme = tenant(requests_per_second=2.5)
    assert [isinstance(await admission.admit(acme), Admitted) for _ in range(4)] == [True] * 3 + [False]


async def test_concurrency_is_freed_by_release_exactly_once() -> None:
    clock = FakeClock()
    store = InMemoryQuotaStore()
    admission = Admission(store, clock)
    acme = tenant(max_concurrent=2)
    first, second = await admission.admit(acme), await admission.admit(acme)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    third = await admission.admit(acme)
    assert isinstance(third, Refused)
    assert "max_concurrent limit 2 reached" in third.violations[0].description
    await first.permit.release()
    await first.permit.release()  # idempotent: must not free the second request's slot too
    assert store.in_flight("acme") == 1
    assert isinstance(await admission.admit(acme), Admitted)
    assert isinstance(await admission.admit(acme), Refused)


async def test_a_refusal_charges_nothing_and_names_every_violation() -> None:
    clock = FakeClock()
    store = InMemoryQuotaStore()
    admission = Admission(store, clock)
    acme = tenant(requests_per_second=1, burst=1, max_concurrent=1)
    held = await admission.admit(acme)
    assert isinstance(held, Admitted)
    refused = await admission.admit(acme)
    assert isinstance(refused, Refused)
    assert len(refused.violations) == 2
    assert refused.retry_after_s == pytest.approx(1.0)  # the longest of the waits
    assert store.in_flight("acme") == 1


async def test_refusals_describe_the_limits_of_the_moment() -> None:
    """A refusal's violations are described once per limits: a reload's new limits for the
    same tenant are described anew, not served from the last refusal."""
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    for rate in (1, 3, 1):
        acme = tenant(requests_per_second=rate, burst=1)
        assert isinstance(await admission.admit(acme), Admitted)
        for _ in range(2):  # the second is described from the first
            refused = await admission.admit(acme)
            assert isinstance(refused, Refused)
            assert [v.description for v in refused.violations] == [
                f"requests_per_second limit {rate} (burst 1) exceeded"
            ]
            assert refused.retry_after_s == pytest.approx(1 / rate)


async def test_tokens_per_minute_reserve_and_reconcile() -> None:
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    acme = tenant(tokens_per_minute=600)  # 10 tokens/s
    big = await admission.admit(acme, cost_tokens=500)
    assert isinstance(big, Admitted)
    # Only 100 left: a request estimating 200 waits 10 s for the missing 100.
    refused = await admission.admit(acme, cost_tokens=200)
    assert isinstance(refused, Refused)
    assert refused.retry_after_s == pytest.approx(10.0)
    # The big one used only 100: 400 come back and the same request now fits.
    await big.permit.release(actual_tokens=100)
    second = await admission.admit(acme, cost_tokens=200)
    assert isinstance(second, Admitted)
    # An underestimate is taken as debt: 300 left, 500 more used -> 200 below zero.
    await second.permit.release(actual_tokens=700)
    refused = await admission.admit(acme, cost_tokens=1)
    assert isinstance(refused, Refused)
    assert refused.retry_after_s == pytest.approx(20.1)
    assert "tokens_per_minute limit 600 exceeded" in refused.violations[0].description


async def test_release_without_actual_tokens_keeps_the_estimate() -> None:
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    acme = tenant(tokens_per_minute=600)
    first = await admission.admit(acme, cost_tokens=600)
    assert isinstance(first, Admitted)
    await first.permit.release()
    refused = await admission.admit(acme, cost_tokens=60)
    assert isinstance(refused, Refused) and refused.retry_after_s == pytest.approx(6.0)


async def test_refused_becomes_quota_exceeded() -> None:
    clock = FakeClock()
    admission = Admission(InMemoryQuotaStore(), clock)
    acme = tenant(requests_per_second=1, burst=1)
    await admission.admit(acme)
    refused = await admission.admit(acme)
    assert isinstance(refused, Refused)
    error = refused.error()
    assert isinstance(error, QuotaExceeded)
    assert error.retry_after_s == refused.retry_after_s
    assert error.violations == refused.violations
    assert error.message.startswith("quota exceeded: requests_per_second limit 1")


async def test_unlimited_tenant_is_always_admitted() -> None:
    admission = Admission(InMemoryQuotaStore(), FakeClock())
    acme = tenant()
    for _ in range(1000):
        assert isinstance(await admission.admit(acme, cost_tokens=10**9), Admitted)


async def test_streams_per_tenant_refused_as_a_value_and_freed_on_close() -> None:
    limiter = StreamLimiter(default_max_streams=2)
    acme, globex = tenant(), make_tenant("globex", limits={"max_streams": 1})
    first, second = limiter.open(acme), limiter.open(acme)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    refused = limiter.open(acme)
    assert isinstance(refused, Refused)
    assert refused.retry_after_s > 0
    assert [v.description for v in refused.violations] == ["max_streams limit 2 reached"]
    # Each tenant counts its own streams, against its own override when it has one.
    assert isinstance(limiter.open(globex), Admitted)
    assert isinstance(limiter.open(globex), Refused)
    await first.permit.release()
    await first.permit.release()  # idempotent: frees one stream only
    assert limiter.open_streams("acme") == 1
    assert isinstance(limiter.open(acme), Admitted)
    assert isinstance(limiter.open(acme), Refused)
