"""The self-sizing dispatch window (`dispatch_window: auto`), on a fake clock."""

from __future__ import annotations

import asyncio

from qosgate.config import parse_config
from qosgate.scheduler import EngineLoad, Scheduler, WindowController
from qosgate.scheduler.window import INTERVAL_S

from tests.fakes import FakeClock, make_tenant

IDLE = EngineLoad(waiting=0, kv_cache_usage=0.2)


def controller(window: int = 8, minimum: int = 2, maximum: int = 64) -> WindowController:
    return WindowController(minimum, maximum, window)


def step(c: WindowController, now: float, *, latency: float = 0.1, queued: int = 10,
         in_flight: int | None = None, load: EngineLoad | None = IDLE) -> int:
    if load is not None:
        c.engine_load(load, now)
    for _ in range(5):
        c.latency(latency)
    c.decide(now, queued=queued, in_flight=c.window if in_flight is None else in_flight)
    return c.window


def test_grows_while_the_engine_keeps_up_and_the_window_limits() -> None:
    c = controller()
    windows = [step(c, i * INTERVAL_S) for i in range(30)]
    assert windows[0] == 9 and windows == sorted(windows)
    assert windows[-1] == 64  # capped at window_max


def test_holds_without_demand() -> None:
    c = controller()
    assert [step(c, i * INTERVAL_S, queued=0) for i in range(5)] == [8] * 5
    # A full window with nothing queued is not a reason to grow either.
    assert step(c, 10.0, queued=0, in_flight=8) == 8


def test_decides_at_most_once_per_interval() -> None:
    c = controller()
    step(c, 0.0)
    assert [step(c, INTERVAL_S / 10 * i) for i in range(1, 9)] == [9] * 8


def test_shrinks_when_requests_wait_inside_the_engine() -> None:
    c = controller(window=40)
    assert step(c, 0.0, load=EngineLoad(waiting=12, kv_cache_usage=0.5)) == 32
    # A request or two between arrival and the engine's next step is no saturation.
    assert step(c, 1.0, load=EngineLoad(waiting=1, kv_cache_usage=0.5)) == 36


def test_shrinks_when_the_kv_cache_is_nearly_full() -> None:
    c = controller(window=40)
    assert step(c, 0.0, load=EngineLoad(waiting=0, kv_cache_usage=0.95)) == 32


def test_shrinks_on_latency_far_above_the_unloaded_baseline_down_to_the_minimum() -> None:
    c = controller(window=16)
    step(c, 0.0, latency=0.05, queued=0)  # unloaded: the baseline
    windows = [step(c, (i + 1) * INTERVAL_S, latency=0.5) for i in range(12)]
    assert windows[0] == 12 and windows[-1] == 2


def test_latency_alone_steers_a_model_without_engine_metrics() -> None:
    c = controller()
    step(c, 0.0, latency=0.05, queued=0, load=None)
    assert step(c, 1.0, latency=0.06, load=None) == 9  # within tolerance: grows
    assert step(c, 2.0, latency=0.2, load=None) == 7  # 4x the baseline: shrinks


def test_a_stale_engine_reading_is_ignored() -> None:
    c = controller()
    c.engine_load(EngineLoad(waiting=50, kv_cache_usage=1.0), 0.0)
    assert step(c, 60.0, load=None) == 9


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
