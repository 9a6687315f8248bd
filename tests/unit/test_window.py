"""The self-sizing dispatch window (`dispatch_window: auto`) and its class caps, on a fake
clock."""

from __future__ import annotations

import asyncio

import pytest
from qosgate.config import parse_config
from qosgate.scheduler import EngineLoad, Scheduler, WindowController
from qosgate.scheduler.window import (
    IDLE_RESTART_S,
    INTERVAL_S,
    FAIR_MARGIN,
    SHARE_GAIN,
    FairCaps,
    FairPart,
    Pressure,
    TenantDemand,
    fair_edge,
)

from tests.fakes import FakeClock, make_tenant

IDLE = EngineLoad(waiting=0, kv_cache_usage=0.2)
CRITICAL, STANDARD, BATCH = 0, 2, 3
LIMITED = Pressure(limited=True, idle=False, tenants={}, share={})
NOT_LIMITED = Pressure(limited=False, idle=False, tenants={}, share={})


def controller(window: int = 8, minimum: int = 2, maximum: int = 64, **objectives: float) -> WindowController:
    levels = {"critical": CRITICAL, "standard": STANDARD}
    return WindowController(minimum, maximum, window, objectives={levels[k]: v for k, v in objectives.items()})


def step(c: WindowController, now: float, *, latency: dict[int, float] | None = None,
         pressure: Pressure = LIMITED, load: EngineLoad | None = IDLE) -> int:
    """One interval: the given classes each report a few dispatches, then the decision."""
    if load is not None:
        c.engine_load(load, now)
    for level, seconds in (latency or {BATCH: 0.1}).items():
        for _ in range(3):
            c.latency(level, seconds, now)
    c.decide(now + INTERVAL_S, pressure)
    return c.window


def test_slow_start_doubles_until_the_first_shrink_then_grows_by_an_eighth() -> None:
    c = controller(window=4)
    assert [step(c, i) for i in range(5)] == [8, 16, 32, 64, 64]  # capped at window_max
    assert step(c, 5, load=EngineLoad(waiting=20, kv_cache_usage=0.95)) == 51
    assert [step(c, 6 + i) for i in range(3)] == [57, 64, 64]


def test_holds_while_the_window_is_not_what_limits() -> None:
    c = controller()
    assert [step(c, i, pressure=NOT_LIMITED) for i in range(5)] == [8] * 5


def test_decides_at_most_once_per_interval() -> None:
    c = controller()
    assert c.decide(0.0, LIMITED) is not None
    assert c.window == 16
    for i in range(1, 10):
        assert c.decide(INTERVAL_S * i / 10, LIMITED) is None


def test_shrinks_when_requests_keep_waiting_inside_the_engine() -> None:
    c = controller(window=40)
    c.slow_start = False
    queue = EngineLoad(waiting=12, kv_cache_usage=0.5)
    # A burst of arrivals waits for one engine step (a batcher: for a batch to form): no
    # saturation yet, though no reason to grow either...
    assert step(c, 0, load=queue) == 40
    # ...but a queue still there a second later is.
    assert step(c, 1, load=queue) == 32
    # A request or two between arrival and the engine's next step never is.
    c2 = controller(window=40)
    c2.slow_start = False
    assert [step(c2, i, load=EngineLoad(waiting=1, kv_cache_usage=0.5)) for i in range(3)] == [45, 50, 56]


def test_one_reading_without_a_queue_ends_the_persistence() -> None:
    c = controller(window=40)
    c.slow_start = False
    queue, empty = EngineLoad(waiting=12, kv_cache_usage=None), EngineLoad(waiting=0, kv_cache_usage=None)
    # A batcher that empties its queue at every batch is keeping up, however full it
    # was in between (it grows after each reading without a queue).
    assert [step(c, i, load=queue if i % 2 else empty) for i in range(4)] == [45, 45, 50, 50]


def test_shrinks_when_the_kv_cache_is_nearly_full() -> None:
    c = controller(window=40)
    assert step(c, 0, load=EngineLoad(waiting=0, kv_cache_usage=0.95)) == 32


def test_a_stale_engine_reading_is_ignored() -> None:
    c = controller()
    c.engine_load(EngineLoad(waiting=50, kv_cache_usage=1.0), 0.0)
    assert step(c, 60, load=None) == 16


def test_an_llm_engine_full_at_its_seats_holds_the_window_there() -> None:
    c = controller(window=48, maximum=256)
    c.slow_start = False
    # The window is past what the engine runs at once: requests wait in it, and the
    # reading says it runs 40 meanwhile.
    full = EngineLoad(waiting=10, kv_cache_usage=0.3, running=40)
    assert step(c, 0, load=full) == 48  # a queue for one step is no saturation (nor room)
    assert step(c, 1, load=full) == 40  # persisted a second: 40 seats, down to them
    # With requests still queued in the gateway the window stays at the seats: a higher
    # class's request finds the seats a lower class's reservation leaves free.
    quiet = EngineLoad(waiting=0, kv_cache_usage=0.3, running=30)
    assert [step(c, 2 + i, load=quiet) for i in range(4)] == [40] * 4
    # After SEATS_PROBE_S without a queue at them it tries a little more.
    assert step(c, 6, load=quiet) == 45
    assert step(c, 7, load=quiet) == 45
    # And back to the seats when the engine queues again.
    c.engine_load(EngineLoad(waiting=10, kv_cache_usage=0.3, running=40), 12.0)
    assert step(c, 13, load=EngineLoad(waiting=10, kv_cache_usage=0.3, running=40)) == 40


def test_a_window_below_the_seats_grows_to_them_and_no_further() -> None:
    c = controller(window=32, maximum=256)
    c.seats, c.seats_at = 40, 0.0
    c.slow_start = False
    assert [step(c, i, load=EngineLoad(waiting=0, kv_cache_usage=0.3, running=30)) for i in range(3)] == [36, 40, 40]


def test_an_llm_engine_doubles_only_to_the_slow_start_bound_until_its_seats_show() -> None:
    llm = EngineLoad(waiting=0, kv_cache_usage=0.3, running=20)
    c = controller(window=8, maximum=256)
    # Past LLM_SLOW_START (32) by an eighth: a first overshoot of its seats is small.
    assert [step(c, i, load=llm) for i in range(6)] == [16, 32, 36, 40, 45, 50]
    # A batcher (no running count) doubles on.
    b = controller(window=8, maximum=256)
    assert [step(b, i) for i in range(5)] == [16, 32, 64, 128, 256]
    # Seats known (learnt before an idle restart): doubling up to them is safe.
    k = controller(window=8, maximum=256)
    k.seats, k.seats_at = 100, 0.0
    assert [step(k, i, load=llm) for i in range(5)] == [16, 32, 64, 100, 100]


def test_latency_alone_never_shrinks_the_window() -> None:
    # A batching engine gets slower per request as the window grows, long before it is
    # saturated: only the engine's own queue and KV cache say when it is.
    c = controller(window=8)
    assert [step(c, i, latency={BATCH: 0.05 * (i + 1)}) for i in range(4)] == [16, 32, 64, 64]


def test_an_idle_model_starts_over() -> None:
    c = controller(window=4)
    assert [step(c, i) for i in range(3)] == [8, 16, 32]
    idle = Pressure(limited=False, idle=True, tenants={}, share={})
    t = 3.0
    while t < 3 + IDLE_RESTART_S + 2 * INTERVAL_S:
        step(c, t, pressure=idle)
        t += INTERVAL_S
    assert c.window == 4
    assert step(c, t) == 8  # slow start again


def test_an_idle_llm_engine_starts_over_at_what_it_runs() -> None:
    # Its requests stay a whole generation: a burst after a pause gets its seats at once,
    # not a doubling per interval from the start.
    idle = Pressure(limited=False, idle=True, tenants={}, share={})
    llm = EngineLoad(waiting=0, kv_cache_usage=0.0, running=0)

    def pause(c: WindowController, t: float) -> float:
        end = t + IDLE_RESTART_S + 2 * INTERVAL_S
        while t < end:
            step(c, t, pressure=idle, load=llm)
            t += INTERVAL_S
        return t

    c = controller(window=8, maximum=256)
    assert step(c, 0, load=llm) == 16
    t = pause(c, 1.0)
    assert c.window == 32  # seats not known: the slow start's bound
    c.seats = 20
    pause(c, t)
    assert c.window == 20
    capped = controller(window=8, maximum=24)
    pause(capped, 0.0)
    assert capped.window == 24  # never past window_max


def demand(name: str, weight: float, outstanding: float, occupancy: float | None = 0.1,
           served: float = 0.0) -> FairPart:
    return FairPart(name, weight, outstanding, occupancy, served)


def cap_at(tenants: list[FairPart], cap: float) -> int | None:
    found = fair_edge(tenants, cap)
    return None if found is None else int(found.left_over + FAIR_MARGIN * found.edge)


def test_the_fair_edge_is_where_a_closed_loop_tenant_runs_out_of_queue() -> None:
    # 1:2:4, 32 outstanding each (callers that send their next request as one returns):
    # the heaviest covers its 4/7 of the cap up to 56.
    tenants = [demand("light", 1, 32), demand("medium", 2, 32), demand("heavy", 4, 32)]
    found = fair_edge(tenants, cap=96)
    assert found is not None and found.edge == pytest.approx(56) and found.left_over == 0
    assert found.shares == pytest.approx({"light": 1 / 7, "medium": 2 / 7, "heavy": 4 / 7})
    # Twice the requests, twice the edge.
    assert cap_at([demand(t.name, t.weight, 64) for t in tenants], cap=96) == int(FAIR_MARGIN * 112)


def test_a_tenant_that_sends_less_than_its_share_is_served_all_it_asks() -> None:
    # An open loop of 2 requests at a time does not compete: the others' fair parts are of
    # what it leaves, and it never holds the cap down to its own size.
    tenants = [demand("trickle", 4, 2), demand("a", 1, 32), demand("b", 1, 32)]
    assert cap_at(tenants, cap=96) == 2 + int(FAIR_MARGIN * 64)
    # One competitor alone has nobody to be fair to.
    assert fair_edge([demand("trickle", 4, 2), demand("a", 1, 32)], cap=96) is None
    assert fair_edge([demand("a", 1, 32)], cap=96) is None


def test_a_competitor_keeps_competing_down_to_a_lower_bar() -> None:
    # 20 outstanding against a part of 64 (1/2 of 128): 31% competes, 16% does not...
    tenants = [demand("a", 1, 20), demand("b", 1, 64)]
    assert set(fair_edge(tenants, cap=128).shares) == {"a", "b"}
    dipped = [demand("a", 1, 14), demand("b", 1, 64)]
    assert fair_edge(dipped, cap=128) is None
    # ...unless it competed before: its count dips while its answers travel back.
    assert set(fair_edge(dipped, cap=128, competed=frozenset({"a", "b"})).shares) == {"a", "b"}


def test_the_fair_edge_counts_how_long_each_tenant_occupies_a_slot_per_unit_of_service() -> None:
    # Equal weights; one tenant's generations (max_tokens 128) hold a slot for 1.85x as
    # long per unit of cost as the other's (max_tokens 8): equal service takes that much
    # more of the window, so its 24 streams cover the fair cap only up to 24 + 24/1.85.
    long, short = demand("long", 1, 24, occupancy=0.464), demand("short", 1, 24, occupancy=0.25)
    found = fair_edge([long, short], cap=64)
    assert found is not None and found.edge == pytest.approx(24 * (0.464 + 0.25) / 0.464)


def test_a_tenant_without_finished_requests_counts_as_typical() -> None:
    tenants = [demand("new", 1, 32, occupancy=None), demand("old", 1, 32, occupancy=0.2)]
    assert cap_at(tenants, cap=96) == int(FAIR_MARGIN * 64)


def report(tenants: dict[str, tuple[float, int]], t: float, per_weight: float = 1.0) -> list[TenantDemand]:
    """The core's report at time `t` of tenants (name -> weight, outstanding), served in
    proportion to their weights since 0 (`per_weight` units of cost per second per unit
    of weight) at 0.1 seconds in flight per unit of cost."""
    return [TenantDemand(name, weight, n, ended_s=0.1 * per_weight * weight * t, ended_cost=per_weight * weight * t,
                         charged=per_weight * weight * t)
            for name, (weight, n) in tenants.items()]


def test_the_controller_caps_a_class_and_its_tenants_where_they_stay_queued() -> None:
    c = controller(window=96)
    c.slow_start = False
    tenants = {"light": (1.0, 32), "medium": (2.0, 32), "heavy": (4.0, 32)}

    def at(t: float, who: dict[str, tuple[float, int]]) -> Pressure:
        return Pressure(limited=False, idle=False, tenants={STANDARD: report(who, t)}, share={STANDARD: 0.75})

    c.decide(0.0, at(0.0, tenants))
    # 0.95 of the edge, 56, split 1:2:4 in whole requests (fractions carried over).
    assert c.fair == {STANDARD: FairCaps(53, {"light": 7, "medium": 15, "heavy": 30})} and c.window == 96
    # The heavy tenant's demand dips for an interval (its answers on the way back to it):
    # smoothed, the cap moves by half the dip.
    c.decide(INTERVAL_S, at(INTERVAL_S, {**tenants, "heavy": (4.0, 24)}))
    assert c.fair[STANDARD].total == int(FAIR_MARGIN * 28 * 7 / 4)
    # Once only one tenant is left there is nothing to cap.
    c.decide(2 * INTERVAL_S, at(2 * INTERVAL_S, {"heavy": (4.0, 32)}))
    assert c.fair == {}


def test_whole_request_parts_average_to_the_fraction() -> None:
    c = controller(window=96)
    c.slow_start = False
    tenants = {"light": (1.0, 32), "medium": (2.0, 32), "heavy": (4.0, 32)}
    light = []
    for i in range(70):
        t = i * INTERVAL_S
        c.decide(t, Pressure(limited=False, idle=False, tenants={STANDARD: report(tenants, t)}, share={STANDARD: 0.75}))
        light.append(c.fair[STANDARD].tenants["light"])
    assert set(light) == {7, 8}
    assert sum(light) / len(light) == pytest.approx(FAIR_MARGIN * 56 / 7, abs=0.05)


def test_occupancy_is_request_seconds_per_unit_of_cost_over_recent_intervals() -> None:
    c = controller(window=64)
    c.slow_start = False
    # Equal weights, 24 streams each; "long" has held a slot 0.4 s per unit of cost and
    # "short" 0.2 s (its requests finish sooner for the service they give); each got the
    # same service.
    def at(t: float) -> Pressure:
        return Pressure(limited=False, idle=False, share={STANDARD: 1.0}, tenants={STANDARD: [
            TenantDemand("long", 1.0, 24, ended_s=0.4 * 100 * t, ended_cost=100 * t, charged=100 * t),
            TenantDemand("short", 1.0, 24, ended_s=0.2 * 100 * t, ended_cost=100 * t, charged=100 * t)]})

    for i in range(4):
        c.decide(i * INTERVAL_S, at(i * INTERVAL_S))
    # Long's fair part is 2/3 of the cap: its 24 cover a cap of 36.
    assert c.fair[STANDARD].total == int(FAIR_MARGIN * 36)
    assert c.fair[STANDARD].tenants == {"long": pytest.approx(23, abs=1), "short": pytest.approx(11, abs=1)}


def test_a_tenant_served_short_of_its_share_gets_a_larger_part_until_it_is_not() -> None:
    c = controller(window=64)
    c.slow_start = False
    served = {"light": 0.0, "heavy": 0.0}

    def at(i: int, heavy_share: float) -> Pressure:
        served["light"] += 100 * (1 - heavy_share)
        served["heavy"] += 100 * heavy_share
        return Pressure(limited=False, idle=False, share={STANDARD: 1.0}, tenants={STANDARD: [
            TenantDemand("light", 1.0, 32, ended_s=i * 10.0, ended_cost=served["light"], charged=served["light"],
                         dispatched=i * 100),
            TenantDemand("heavy", 3.0, 32, ended_s=i * 30.0, ended_cost=served["heavy"], charged=served["heavy"],
                         dispatched=i * 300)]})

    c.decide(0.0, at(0, 0.75))
    # Heavy gets 0.6 of the service where its weight says 0.75: 20% short. Its part grows
    # a little each interval while that lasts (the service is summed over ~10 s).
    parts = []
    for i in range(1, 41):
        c.decide(i * INTERVAL_S, at(i, 0.6))
        caps = c.fair[STANDARD].tenants
        parts.append(caps["heavy"] / (caps["heavy"] + caps["light"]))
    assert parts[-1] > parts[0] + 0.05
    # Served its share again: the correction stops moving (within a request of rounding).
    for i in range(41, 400):
        c.decide(i * INTERVAL_S, at(i, 0.75))
    caps = c.fair[STANDARD].tenants
    settled = caps["heavy"] / (caps["heavy"] + caps["light"])
    c.decide(400 * INTERVAL_S, at(400, 0.75))
    caps = c.fair[STANDARD].tenants
    assert caps["heavy"] / (caps["heavy"] + caps["light"]) == pytest.approx(settled, abs=0.05)


def test_a_share_measured_on_few_dispatches_moves_the_correction_by_less() -> None:
    # Two tenants short of their share alike, one's service counted over 300 dispatches an
    # interval (an embedding model), the other's over one (a small part of an LLM engine,
    # its generations seconds long): which of the second's requests happened to end in an
    # interval is most of what its share shows, and a full correction on it is a random walk.
    def correction(dispatched_per_interval: int) -> float:
        c = controller(window=64)
        c.slow_start = False
        for i in range(4):
            # light 10 and heavy 300 units of service an interval: 3% where its weight says 25%.
            c.decide(i * INTERVAL_S, Pressure(limited=False, idle=False, share={STANDARD: 1.0}, tenants={STANDARD: [
                TenantDemand("light", 1.0, 32, ended_s=i * 1.0, ended_cost=i * 10.0, charged=i * 10.0,
                             dispatched=i * dispatched_per_interval),
                TenantDemand("heavy", 3.0, 32, ended_s=i * 30.0, ended_cost=i * 300.0, charged=i * 300.0,
                             dispatched=i * 30 * dispatched_per_interval)]}))
        return c._tenants[(STANDARD, "light")].correction

    many, few = correction(300), correction(1)
    shortfall = (0.25 - 10 / 310) / 0.25
    assert many == pytest.approx((1 + SHARE_GAIN * shortfall) ** 3)
    assert 1.0 < few < 1.0 + (many - 1.0) / 4


def lower(c: WindowController) -> int:
    """The one nested limit every class below critical gets."""
    assert set(c.lower) == {STANDARD, BATCH}, c.lower
    (cap,) = set(c.lower.values())
    return cap


def pair(level_tenants: dict[int, int]) -> Pressure:
    return Pressure(limited=False, idle=False,
                    tenants={level: report({f"t{level}": (1.0, n)}, 1.0) for level, n in level_tenants.items()},
                    share={CRITICAL: 1.0, STANDARD: 0.83, BATCH: 0.75})


def test_a_latency_objective_caps_the_lower_classes_not_the_window() -> None:
    c = controller(window=64, critical=2.0)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, pressure=pair({CRITICAL: 1}))  # critical alone: its baseline
    # The flood: critical's first responses at 4x the baseline, twice the objective. The
    # lower classes' cap shrinks in proportion, at most by half per interval; the window
    # stays, so critical itself may use all of it.
    flood = pair({CRITICAL: 1, BATCH: 300})
    assert step(c, 1, latency={CRITICAL: 0.2, BATCH: 0.3}, pressure=flood) == 64
    assert lower(c) == 32
    step(c, 2, latency={CRITICAL: 0.15, BATCH: 0.3}, pressure=flood)
    assert lower(c) == 21  # 1.5x the allowed: by 2/3
    # Within the objective but not well within: hold.
    step(c, 3, latency={CRITICAL: 0.09, BATCH: 0.3}, pressure=flood)
    assert lower(c) == 21
    # Well within it: grow back by an eighth.
    step(c, 4, latency={CRITICAL: 0.06, BATCH: 0.3}, pressure=flood)
    assert lower(c) == 23
    # An interval without a critical sample is no evidence either way.
    step(c, 5, latency={BATCH: 0.3}, pressure=flood)
    assert lower(c) == 23
    # Bounded below by one request.
    for i in range(6, 14):
        step(c, i, latency={CRITICAL: 1.0, BATCH: 0.3}, pressure=flood)
    assert lower(c) == 1


def test_without_an_objective_a_flood_keeps_the_engine_full() -> None:
    c = controller(window=64)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, pressure=pair({CRITICAL: 1}))
    for i in range(1, 5):
        step(c, i, latency={CRITICAL: 0.5, BATCH: 0.3}, pressure=pair({CRITICAL: 1, BATCH: 300}))
    assert c.lower == {} and c.window == 64


def test_the_lower_cap_lifts_once_the_protected_class_is_gone() -> None:
    c = controller(window=64, critical=2.0)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, pressure=pair({CRITICAL: 1}))
    step(c, 1, latency={CRITICAL: 0.4, BATCH: 0.3}, pressure=pair({CRITICAL: 1, BATCH: 300}))
    assert lower(c) == 32
    # No critical dispatch for ACTIVE_S: batch alone is not held back.
    for i in range(2, 14):
        step(c, i, latency={BATCH: 0.3}, pressure=pair({BATCH: 300}))
    assert c.lower == {}


def test_first_responses_slower_than_an_interval_still_count() -> None:
    c = controller(window=64, critical=2.0)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, pressure=pair({CRITICAL: 1}))  # 0.1 s allowed
    # Under the flood critical requests get no first response within the interval: their
    # age is what they have waited at least, and past the allowed latency it counts.
    c.dispatched(CRITICAL, "c1", 1.0)
    c.dispatched(CRITICAL, "c2", 1.0)
    flood = pair({CRITICAL: 2, BATCH: 300})
    step(c, 1, latency={BATCH: 0.3}, pressure=flood)
    assert lower(c) == 32  # aged 0.5 s: by half
    # One answers (its sample is the latency itself), the other ends unanswered
    # (cancelled): neither waits any more, and an interval without samples holds.
    c.latency(CRITICAL, 0.12, 1.6, key="c1")
    c.ended(CRITICAL, "c2")
    step(c, 2, latency={BATCH: 0.3}, pressure=flood)
    assert lower(c) == 26  # 0.12 against 0.1 allowed
    step(c, 3, latency={BATCH: 0.3}, pressure=flood)
    assert lower(c) == 26


def test_a_class_still_streaming_stays_protected_after_its_first_response() -> None:
    c = controller(window=16, critical=2.0)
    c.slow_start = False
    step(c, 0, latency={CRITICAL: 0.05}, pressure=pair({CRITICAL: 1}))
    c.dispatched(CRITICAL, "c1", 1.0)
    c.latency(CRITICAL, 0.3, 1.3, key="c1")
    step(c, 2, latency={BATCH: 0.3}, pressure=pair({CRITICAL: 1, BATCH: 100}))
    assert lower(c) == 8
    # Its tokens stream for a long while: no new sample, and the cap holds meanwhile.
    for i in range(3, 20):
        step(c, i, latency={BATCH: 0.3}, pressure=pair({CRITICAL: 1, BATCH: 100}))
        assert lower(c) == 8


@pytest.mark.parametrize("objective", [0.5, 1.0])
def test_a_latency_objective_must_exceed_one(objective: float) -> None:
    with pytest.raises(Exception, match="latency_objective.critical"):
        parse_config({"scheduler": {"latency_objective": {"critical": objective}}})


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
    # The engine reports saturation that persists: the window shrinks as requests finish.
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
    scheduler = Scheduler(parse_config({"scheduler": {"window_reserve": 0.25}, "models": {"m": {"window_max": 64}}}),
                          clock)
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


class FakeEngine:
    """An engine that never saturates: every step of fake time it finishes everything
    dispatched to it (equal latency for all), and reports no queue."""

    STEP_S = 0.01

    def __init__(self, clock: FakeClock, scheduler: Scheduler) -> None:
        self.clock, self.scheduler = clock, scheduler
        self.running: list[asyncio.Future[None]] = []

    def run(self) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self.running.append(future)
        return future

    async def serve(self, seconds: float) -> None:
        until = self.clock.now() + seconds
        while self.clock.now() < until:
            for _ in range(8):  # let the callers answered come back
                await asyncio.sleep(0)
            self.clock.advance(self.STEP_S)
            done, self.running = self.running, []
            for future in done:
                future.set_result(None)
            self.scheduler.engine_load("m", IDLE)


async def test_closed_loop_tenants_get_their_weights_however_large_the_engine() -> None:
    """Three tenants 1:2:4, 32 requests each always outstanding (each sent again as soon
    as it returns), on an engine that takes whatever it is sent: the window grows past
    what the heaviest tenant's 32 can fill, yet the class is capped where it stays queued,
    so completions follow the weights, not the callers' concurrency."""
    clock = FakeClock()
    scheduler = Scheduler(parse_config({"models": {"m": {"window_max": 256}}}), clock)
    engine = FakeEngine(clock, scheduler)
    weights = {"light": 1.0, "medium": 2.0, "heavy": 4.0}
    tenants = {name: make_tenant(name, weight=w) for name, w in weights.items()}
    served = dict.fromkeys(weights, 0)
    start = clock.now()

    async def caller(name: str) -> None:
        while clock.now() < start + 20.0:
            async with scheduler.slot(tenant=tenants[name], klass="standard", model="m", deadline=None) as d:
                await engine.run()
                d.responded()
            if clock.now() > start + 5.0:
                served[name] += 1

    await asyncio.gather(engine.serve(21.0), *(caller(n) for n in weights for _ in range(32)))
    total = sum(served.values())
    # Wider than the heavy tenant's 32 could fill at 4/7: without the cap the shares would
    # follow the callers' concurrency.
    assert scheduler.snapshot().window["m"] > 56
    for name, weight in weights.items():
        assert served[name] / total == pytest.approx(weight / 7, rel=0.05), served


def test_when_who_competes_changes_the_shares_start_over() -> None:
    c = controller(window=96)
    c.slow_start = False
    served = {"light": 0.0, "medium": 0.0, "heavy": 0.0}

    def at(i: int, rates: dict[str, float]) -> Pressure:
        for name, rate in rates.items():
            served[name] += rate
        weights = {"light": 1.0, "medium": 2.0, "heavy": 4.0}
        return Pressure(limited=False, idle=False, share={STANDARD: 1.0}, tenants={STANDARD: [
            TenantDemand(name, weights[name], 32, ended_s=i * 3.2, ended_cost=served[name], charged=served[name],
                         dispatched=i * 100)
            for name in rates]})

    # Heavy away: light and medium share 1:2, each its share, the corrections at rest.
    for i in range(40):
        c.decide(i * INTERVAL_S, at(i, {"light": 100, "medium": 200}))
    # Heavy is back. What light and medium got alone is not a shortfall of heavy's: the
    # shares are counted afresh among the three, from where heavy's requests start.
    for i in range(40, 44):
        c.decide(i * INTERVAL_S, at(i, {"light": 43, "medium": 86, "heavy": 171}))
    assert {name: c._tenants[(STANDARD, name)].correction for name in served} == pytest.approx(
        {"light": 1.0, "medium": 1.0, "heavy": 1.0}, abs=0.01)


def test_a_reload_that_changes_weights_starts_the_shares_over() -> None:
    c = controller(window=96)
    c.slow_start = False

    def at(i: int, weights: dict[str, float], served: dict[str, float]) -> Pressure:
        return Pressure(limited=False, idle=False, share={STANDARD: 1.0}, tenants={STANDARD: [
            TenantDemand(name, weight, 32, ended_s=i * 3.2, ended_cost=served[name] * i, charged=served[name] * i,
                         dispatched=i * 100)
            for name, weight in weights.items()]})

    # At 1:1, x served a third: its correction grows.
    for i in range(40):
        c.decide(i * INTERVAL_S, at(i, {"x": 1.0, "y": 1.0}, {"x": 100, "y": 200}))
    assert c._tenants[(STANDARD, "x")].correction > 1.5
    # Reweighed to 1:4, the same service is x's share already: what was learnt is for
    # other weights, and goes.
    c.decide(40 * INTERVAL_S, at(40, {"x": 1.0, "y": 4.0}, {"x": 100, "y": 200}))
    assert c._tenants[(STANDARD, "x")].correction == 1.0
