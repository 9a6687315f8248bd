"""The self-sizing dispatch window (`dispatch_window: auto`), on a fake clock."""

from __future__ import annotations

import asyncio

from qosgate.config import parse_config
from qosgate.scheduler import EngineLoad, Scheduler, WindowController
from qosgate.scheduler.window import INTERVAL_S

from tests.fakes import FakeClock, make_tenant

IDLE = EngineLoad(waiting=0, kv_cache_usage=0.2)
CRITICAL, BATCH = 0, 3


def controller(window: int = 8, minimum: int = 2, maximum: int = 64) -> WindowController:
    return WindowController(minimum, maximum, window)


def step(c: WindowController, now: float, *, latency: dict[int, float] | None = None,
         limited: bool = True, load: EngineLoad | None = IDLE, queued: frozenset[int] = frozenset({BATCH})) -> int:
    """One interval: the given classes each report a few dispatches, then the decision."""
    if load is not None:
        c.engine_load(load, now)
    for level, seconds in (latency or {BATCH: 0.1}).items():
        for _ in range(3):
            c.latency(level, seconds, now)
    c.decide(now + INTERVAL_S, limited=limited, queued_levels=queued)
    return c.window


def test_slow_start_doubles_until_the_first_shrink_then_grows_by_an_eighth() -> None:
    c = controller(window=4)
    assert [step(c, i) for i in range(5)] == [8, 16, 32, 64, 64]  # capped at window_max
    assert step(c, 5, load=EngineLoad(waiting=20, kv_cache_usage=0.95)) == 51
    assert [step(c, 6 + i) for i in range(3)] == [57, 64, 64]


def test_holds_while_the_window_is_not_what_limits() -> None:
    c = controller()
    assert [step(c, i, limited=False) for i in range(5)] == [8] * 5


def test_decides_at_most_once_per_interval() -> None:
    c = controller()
    c.decide(0.0, limited=True)
    assert c.window == 16
    for i in range(1, 10):
        assert c.decide(INTERVAL_S * i / 10, limited=True) is None


def test_shrinks_when_requests_keep_waiting_inside_the_engine() -> None:
    c = controller(window=40)
    c.slow_start = False
    queue = EngineLoad(waiting=12, kv_cache_usage=0.5)
    # A burst of arrivals waits for one engine step: no saturation yet...
    assert step(c, 0, load=queue) == 45
    # ...but a queue still there a second later is.
    assert step(c, 1, load=queue) == 36
    # A request or two between arrival and the engine's next step never is.
    c2 = controller(window=40)
    c2.slow_start = False
    assert [step(c2, i, load=EngineLoad(waiting=1, kv_cache_usage=0.5)) for i in range(3)] == [45, 50, 56]


def test_shrinks_when_the_kv_cache_is_nearly_full() -> None:
    c = controller(window=40)
    assert step(c, 0, load=EngineLoad(waiting=0, kv_cache_usage=0.95)) == 32


def test_a_stale_engine_reading_is_ignored() -> None:
    c = controller()
    c.engine_load(EngineLoad(waiting=50, kv_cache_usage=1.0), 0.0)
    assert step(c, 60, load=None) == 16


def test_without_engine_signals_latency_bounds_even_one_class() -> None:
    c = controller(window=8)
    step(c, 0, latency={BATCH: 0.05}, limited=False, load=None)
    assert step(c, 1, latency={BATCH: 0.06}, load=None) == 16  # within tolerance: grows
    # A batcher past its capacity: latency grows with the window, which shrinks back,
    # so requests keep queueing in the gateway, where fair share applies.
    assert step(c, 2, latency={BATCH: 0.2}, load=None) == 8


def test_one_class_alone_sizes_for_throughput_however_slow_it_gets() -> None:
    c = controller(window=8)
    step(c, 0, latency={BATCH: 0.05}, limited=False)
    assert [step(c, 1 + i, latency={BATCH: 0.05 * (i + 2)}) for i in range(3)] == [16, 32, 64]


def test_latency_of_the_highest_class_bounds_the_window_while_lower_classes_flood() -> None:
    c = controller(window=64)
    step(c, 0, latency={CRITICAL: 0.05}, limited=False)  # critical alone: its baseline
    # The flood: critical's first responses at 4x the baseline; shrink by the gradient,
    # at most by half per interval.
    assert step(c, 1, latency={CRITICAL: 0.2, BATCH: 0.3}) == 32
    assert step(c, 2, latency={CRITICAL: 0.1, BATCH: 0.2}) == 24  # 2x: by 1.5/2
    # Within the tolerance it may grow again (by an eighth: slow start is over).
    assert step(c, 3, latency={CRITICAL: 0.06, BATCH: 0.2}) == 27
    # An interval without a critical sample is no evidence either way: hold.
    assert step(c, 4, latency={BATCH: 0.2}) == 27
    assert step(c, 5, latency={CRITICAL: 0.5, BATCH: 0.2}) == 13
    # Bounded below.
    assert [step(c, 6 + i, latency={CRITICAL: 0.5, BATCH: 0.2}) for i in range(4)][-1] == 2
    # Critical itself queued in the gateway: its share is too small, the window grows.
    assert step(c, 10, latency={CRITICAL: 0.5, BATCH: 0.2}, queued=frozenset({CRITICAL, BATCH})) == 3


def test_first_responses_slower_than_an_interval_still_shrink_the_window() -> None:
    c = controller(window=64)
    step(c, 0, latency={CRITICAL: 0.05}, limited=False)  # baseline 0.05 s: 0.075 s allowed
    # Under the flood critical requests get no first response within the interval: their
    # age is what they have waited at least, and past the allowed latency it counts.
    c.dispatched(CRITICAL, "c1", 1.0)
    c.dispatched(CRITICAL, "c2", 1.0)
    assert step(c, 1, latency={BATCH: 0.3}) == 32  # aged 0.5 s: shrink by half
    # Still waiting an interval on, as long as the first responses do not come.
    assert step(c, 2, latency={BATCH: 0.3}) == 16
    # One of them answers (its sample says the latency itself), the other ends without a
    # first response (cancelled): neither counts as waiting any more.
    c.latency(CRITICAL, 1.1, 2.1, key="c1")
    c.ended(CRITICAL, "c2")
    assert step(c, 3, latency={BATCH: 0.3}) == 8  # from the sample alone
    assert step(c, 4, latency={BATCH: 0.3}) == 8  # no sample, nothing waiting: hold


def test_a_dispatch_younger_than_the_allowed_latency_is_no_evidence() -> None:
    c = controller(window=64)
    step(c, 0, latency={CRITICAL: 0.4}, limited=False)  # baseline 0.4 s: 0.6 s allowed
    c.dispatched(CRITICAL, "c1", 1.3)  # 0.2 s old when the interval closes
    assert step(c, 1, latency={BATCH: 0.3}) == 64
    # Nor does a young one lower the baseline: a quick answer later is judged by 0.4 s.
    assert step(c, 2, latency={CRITICAL: 0.55, BATCH: 0.3}, limited=False) == 64
    assert step(c, 3, latency={CRITICAL: 1.2, BATCH: 0.3}) == 32


def test_a_class_still_streaming_is_protected_long_after_its_first_response() -> None:
    c = controller(window=16)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, limited=False)
    c.dispatched(CRITICAL, "c1", 1.0)
    c.latency(CRITICAL, 0.05, 1.05, key="c1")
    assert step(c, 2, latency={BATCH: 0.3}) == 18  # its first response was quick: grow
    # Its tokens stream for a long while: no new sample, but the flood must not take
    # the engine back meanwhile.
    for i in range(3, 20):
        assert step(c, i, latency={BATCH: 0.3}) == 18
    # Once it ends (and its last report ages out), batch alone sizes for throughput.
    c.ended(CRITICAL, "c1")
    assert step(c, 20, latency={BATCH: 0.3}) == 20


def test_latency_keeps_room_for_the_protected_class_own_requests() -> None:
    # A quarter of the window held back from batch (rounded its way): two critical
    # requests need a window of 5, where batch may hold only 3.
    c = WindowController(2, 64, 64, reserved=lambda level, window: window - int(window * 0.75))
    step(c, 0, latency={CRITICAL: 0.05}, limited=False)
    c.dispatched(CRITICAL, "c1", 1.0)
    c.dispatched(CRITICAL, "c2", 1.0)
    assert [step(c, i, latency={CRITICAL: 0.5, BATCH: 0.3}) for i in range(1, 7)] == [32, 16, 8, 5, 5, 5]
    # With one of them left, the window may go on down to where one fits.
    c.ended(CRITICAL, "c2")
    assert step(c, 7, latency={CRITICAL: 0.5, BATCH: 0.3}) == 5  # c2 counts in this interval's peak
    assert step(c, 8, latency={CRITICAL: 0.5, BATCH: 0.3}) == 2


def test_engine_saturation_shrinks_even_while_latency_is_fine() -> None:
    c = controller(window=40)
    step(c, 0, latency={CRITICAL: 0.05}, limited=False)
    assert step(c, 1, latency={CRITICAL: 0.05, BATCH: 0.1}, load=EngineLoad(waiting=30, kv_cache_usage=0.97)) == 32


async def test_the_scheduler_moves_an_auto_window_as_requests_finish() -> None:
    clock = FakeClock()
    config = parse_config({"models": {"m": {"window_min": 1, "window_max": 4}},
                           "scheduler": {"window_reserve": 0}})
    scheduler = Scheduler(config, clock)
    tenant = make_tenant("t")
    assert scheduler.snapshot().window == {}
    entered: list[int] = []

    async def one(i: int) -> None:
        async with scheduler.slot(tenant=tenant, klass="standard", model="m", deadline=None) as d:
            entered.append(i)
            clock.advance(0.05)
            d.responded()
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(one(i)) for i in range(12)]
    await asyncio.sleep(0)
    assert scheduler.snapshot().window == {"m": 4}  # starts at 8, within [1, 4]
    # The engine reports saturation: the window shrinks as requests finish.
    scheduler.engine_load("m", EngineLoad(waiting=40, kv_cache_usage=0.99))
    await asyncio.gather(*tasks)
    assert scheduler.snapshot().window["m"] < 4
    assert sorted(entered) == list(range(12))


async def test_settle_charges_the_real_cost() -> None:
    clock = FakeClock()
    scheduler = Scheduler(parse_config({}), clock)
    tenant = make_tenant("t")
    async with scheduler.slot(tenant=tenant, klass="standard", model="m", deadline=None, cost=266) as d:
        d.settle(42)
    assert scheduler.snapshot().served == {("m", "t"): 42}


async def test_one_lower_class_alone_grows_the_window_it_cannot_fill() -> None:
    """`standard` may fill only part of the window (the nested reservation keeps the rest
    for the classes above), yet it is the window that holds it back: the window grows."""
    clock = FakeClock()
    scheduler = Scheduler(parse_config({"scheduler": {"window_reserve": 0.25}}), clock)
    tenant = make_tenant("t")

    async def loop() -> None:
        for _ in range(20):
            async with scheduler.slot(tenant=tenant, klass="standard", model="m", deadline=None) as d:
                await asyncio.sleep(0)
                clock.advance(0.05)
                d.responded()
                scheduler.engine_load("m", IDLE)  # an engine that keeps up

    await asyncio.gather(*(loop() for _ in range(64)))
    assert scheduler.snapshot().window["m"] == 64
