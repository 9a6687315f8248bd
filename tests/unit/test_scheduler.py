"""The scheduler: its pure core on a fake clock, then the asyncio wrapper's waiting."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from qosgate.auth import Tenant
from qosgate.config import GatewayConfig, parse_config
from qosgate.errors import DeadlineExceeded, InvalidArgument, QuotaExceeded, Unavailable
from qosgate.scheduler import Scheduler, SchedulingCore, Waiter, WaiterState
from qosgate.scheduler.classes import class_window, initial_window
from qosgate.scheduler.core import MAX_UNCONFIGURED_MODELS
from qosgate.scheduler.window import FairCaps

from tests.fakes import FakeClock, make_tenant

MODEL = "m"


def config(
    window: int = 1, max_queued: int = 10_000, exclusive: Sequence[str] = (), **scheduler: Any
) -> GatewayConfig:
    scheduler.setdefault("floor_share", 0.0)
    scheduler.setdefault("window_reserve", 0.0)
    return parse_config(
        {
            "models": {
                MODEL: {"dispatch_window": window, "max_queued": max_queued, "exclusive_classes": list(exclusive)}
            },
            "scheduler": scheduler,
        }
    )


class Harness:
    """A core with one model whose window starts full, so every submit queues."""

    def __init__(self, cfg: GatewayConfig, *, fill_window: bool = True) -> None:
        self.core = SchedulingCore(cfg)
        self.core_config = cfg
        self.clock = FakeClock()
        self.in_flight: list[Waiter] = []  # dispatched, oldest first: release() ends the oldest
        if fill_window:
            for _ in range(initial_window(cfg.model_policy(MODEL))):
                assert self.submit("filler", "critical").state is WaiterState.DISPATCHED

    def submit(
        self,
        tenant: str,
        klass: str,
        *,
        weight: float = 1.0,
        deadline: float | None = None,
        cost: float = 1.0,
        tokens: int = 0,
        token_quota: int | None = None,
    ) -> Waiter:
        waiter = Waiter(
            tenant, weight, klass, MODEL, deadline, self.clock.now(),
            cost=cost, tokens=tokens, token_quota=token_quota,
        )
        self.core.submit(waiter, self.clock.now())
        if waiter.state is WaiterState.DISPATCHED:
            self.in_flight.append(waiter)
        return waiter

    def release(self, waiter: Waiter | None = None) -> list[Waiter]:
        finished = self.in_flight.pop(0) if waiter is None else waiter
        if waiter is not None:
            self.in_flight.remove(waiter)
        return self._decided(self.core.release(finished, self.clock.now()))

    def resize(self, window: int) -> list[Waiter]:
        return self._decided(self.core.resize(MODEL, window, self.clock.now()))

    def resize_with(self, **caps: Any) -> list[Waiter]:
        """Keep the window, set the caps an `auto` window's controller would."""
        window = self.core.snapshot().window.get(MODEL, initial_window(self.core_config.model_policy(MODEL)))
        return self._decided(self.core.resize(MODEL, window, self.clock.now(), **caps))

    def _decided(self, decided: Sequence[Waiter]) -> list[Waiter]:
        self.in_flight += [w for w in decided if w.state is WaiterState.DISPATCHED]
        return list(decided)

    def next_dispatched(self) -> Waiter:
        (waiter,) = self.release()
        assert waiter.state is WaiterState.DISPATCHED
        return waiter


def test_strict_priority_order() -> None:
    h = Harness(config())
    for klass in ["batch", "standard", "interactive", "critical", "batch", "critical"]:
        h.submit("t", klass)
    order = [h.next_dispatched().klass for _ in range(6)]
    assert order == ["critical", "critical", "interactive", "standard", "batch", "batch"]


def test_fifo_within_a_tenant() -> None:
    h = Harness(config())
    waiters = [h.submit("t", "standard") for _ in range(5)]
    assert [h.next_dispatched() for _ in range(5)] == waiters


@pytest.mark.parametrize("floor", [0.05, 0.1, 0.25])
def test_anti_starvation_floor_gives_a_lower_class_its_share(floor: float) -> None:
    h = Harness(config(floor_share_by_class={"batch": floor}))
    for _ in range(1000):
        h.submit("flood", "critical")
        h.submit("bulk", "batch")
    counts = Counter(h.next_dispatched().klass for _ in range(400))
    assert counts["batch"] >= floor * 400 - 1
    # ...and no more than its floor: the rest stays strictly with the higher class.
    assert counts["batch"] <= floor * 400 + 1


def test_floor_share_is_not_banked_while_a_class_is_idle() -> None:
    h = Harness(config(floor_share_by_class={"batch": 0.1}))
    for _ in range(100):
        h.submit("flood", "critical")
    for _ in range(50):
        h.next_dispatched()
    h.submit("bulk", "batch")
    # Batch just arrived: it must earn its credit anew (9 critical first), not spend 50 x 0.1.
    order = [h.next_dispatched().klass for _ in range(10)]
    assert order == ["critical"] * 9 + ["batch"]


def test_each_lower_class_gets_its_floor_alongside_the_others() -> None:
    h = Harness(config(floor_share=0.1))
    for _ in range(500):
        for klass in ["critical", "interactive", "standard", "batch"]:
            h.submit("t", klass)
    counts = Counter(h.next_dispatched().klass for _ in range(1000))
    for klass in ["interactive", "standard", "batch"]:
        assert counts[klass] >= 0.1 * 1000 - 1, counts


@pytest.mark.parametrize(
    "weights",
    [{"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 5.0}],
)
def test_weighted_fair_share_within_five_percent(weights: dict[str, float]) -> None:
    h = Harness(config(max_queue_length=10_000))
    for _ in range(2000):
        for name, weight in weights.items():
            h.submit(name, "standard", weight=weight)
    dispatches = 1000
    counts = Counter(h.next_dispatched().tenant for _ in range(dispatches))
    total = sum(weights.values())
    for name, weight in weights.items():
        expected = weight / total
        assert abs(counts[name] / dispatches - expected) <= 0.05 * expected, counts


def test_a_tenant_returning_from_idle_gets_no_burst() -> None:
    h = Harness(config())
    for _ in range(200):
        h.submit("busy", "standard")
    for _ in range(100):
        h.next_dispatched()
    for _ in range(50):
        h.submit("late", "standard")
    tenants = Counter(h.next_dispatched().tenant for _ in range(20))
    assert tenants == {"busy": 10, "late": 10}


def test_fair_share_is_per_class() -> None:
    h = Harness(config())
    for _ in range(10):
        h.submit("a", "batch")
        h.submit("b", "interactive")
    assert {h.next_dispatched().tenant for _ in range(10)} == {"b"}


def test_deadline_passed_in_queue_is_dropped_not_dispatched() -> None:
    h = Harness(config())
    soon = h.submit("t", "standard", deadline=h.clock.now() + 1.0)
    later = h.submit("t", "standard", deadline=h.clock.now() + 10.0)
    h.clock.advance(2.0)
    decided = h.release()
    assert decided == [soon, later]
    assert soon.state is WaiterState.DROPPED
    assert isinstance(soon.error, DeadlineExceeded)
    assert later.state is WaiterState.DISPATCHED and later.error is None


def test_a_standing_queue_dispatches_its_newest_request_first() -> None:
    """Once a tenant's oldest request has waited over half its time to its deadline, the
    newest goes first: it has the time left to finish in, the old ones would die mid-work."""
    h = Harness(config())
    old = [h.submit("t", "standard", deadline=h.clock.now() + 10.0) for _ in range(3)]
    h.clock.advance(4.0)
    young = h.submit("t", "standard", deadline=h.clock.now() + 10.0)
    assert h.next_dispatched() is old[0]  # waited 4 of its 10 s: still first come, first served
    h.clock.advance(2.0)  # the oldest now waited 6 of 10 s
    fresh = h.submit("t", "standard", deadline=h.clock.now() + 10.0)
    assert [h.next_dispatched() for _ in range(4)] == [fresh, young, old[2], old[1]]


def test_a_queue_without_deadlines_stays_first_come_first_served() -> None:
    h = Harness(config())
    waiters = [h.submit("t", "standard") for _ in range(3)]
    h.clock.advance(3600.0)
    waiters.append(h.submit("t", "standard", deadline=h.clock.now() + 1.0))
    assert [h.next_dispatched() for _ in range(4)] == waiters


def test_arrival_with_passed_deadline_is_refused_when_it_would_queue() -> None:
    h = Harness(config())
    with pytest.raises(DeadlineExceeded):
        h.submit("t", "standard", deadline=h.clock.now())
    assert not any(h.core.snapshot().queued.values())


def test_shedding_takes_the_lowest_sheddable_class_first_never_critical() -> None:
    h = Harness(config(max_queued=4))
    batch = [h.submit("bulk", "batch") for _ in range(2)]
    standard = [h.submit("std", "standard") for _ in range(2)]
    shed: list[Waiter] = []
    for _ in range(3):
        waiter = Waiter("vip", 1.0, "interactive", MODEL, None, h.clock.now())
        shed += h.core.submit(waiter, h.clock.now())
    # Lowest first, newest first within it.
    assert shed == [batch[1], batch[0], standard[1]]
    assert all(w.state is WaiterState.DROPPED and isinstance(w.error, Unavailable) for w in shed)
    assert isinstance(shed[0].error, Unavailable) and shed[0].error.retry_after_s == 1.0
    for _ in range(4):
        h.core.submit(Waiter("ops", 1.0, "critical", MODEL, None, 0.0), 0.0)
    # Only critical left queued: a critical arrival is refused, nothing critical is shed.
    with pytest.raises(Unavailable, match="overloaded"):
        h.submit("ops", "critical")
    assert h.core.snapshot().queued[(MODEL, "critical", "ops")] == 4


def test_shedding_spares_classes_not_listed_as_sheddable() -> None:
    h = Harness(config(max_queued=2, sheddable_classes=["batch"]))
    h.submit("a", "standard")
    h.submit("a", "standard")
    with pytest.raises(Unavailable, match="overloaded"):
        h.submit("b", "critical")


def test_shedding_never_takes_the_arrivals_own_or_a_higher_class() -> None:
    h = Harness(config(max_queued=2))
    h.submit("a", "interactive")
    h.submit("a", "standard")
    with pytest.raises(Unavailable):
        h.submit("b", "batch")
    with pytest.raises(Unavailable):
        h.submit("b", "standard")


def test_shedding_hits_the_busiest_tenant() -> None:
    h = Harness(config(max_queued=4))
    polite = h.submit("polite", "batch")
    hog = [h.submit("hog", "batch") for _ in range(3)]
    (shed,) = h.core.submit(Waiter("x", 1.0, "critical", MODEL, None, 0.0), 0.0)
    assert shed is hog[-1] and polite.state is WaiterState.QUEUED


def test_a_standing_queue_sheds_its_oldest_request() -> None:
    """The request shed is the one its tenant would dispatch last: while the queue stands,
    its oldest, not the newest that would be served next."""
    h = Harness(config(max_queued=3))
    old = h.submit("hog", "batch", deadline=h.clock.now() + 10.0)
    h.clock.advance(6.0)
    newer = [h.submit("hog", "batch", deadline=h.clock.now() + 10.0) for _ in range(2)]
    (shed,) = h.core.submit(Waiter("x", 1.0, "critical", MODEL, None, h.clock.now()), h.clock.now())
    assert shed is old and all(w.state is WaiterState.QUEUED for w in newer)


def test_bounded_queue_per_class() -> None:
    h = Harness(config(max_queue_length=100, max_queue_length_by_class={"batch": 2}))
    h.submit("t", "batch")
    h.submit("t", "batch")
    with pytest.raises(Unavailable, match="queue of class 'batch' for model 'm' is full"):
        h.submit("t", "batch")
    h.submit("t", "standard")  # other classes have their own bound
    assert h.core.snapshot().queued[(MODEL, "batch", "t")] == 2


def test_withdrawn_waiter_is_never_dispatched() -> None:
    h = Harness(config())
    first = h.submit("t", "standard")
    second = h.submit("t", "standard")
    assert h.core.withdraw(first)
    assert not h.core.withdraw(first)
    assert h.core.snapshot().queued[(MODEL, "standard", "t")] == 1
    assert h.next_dispatched() is second
    assert not h.core.withdraw(second)  # dispatched: nothing to withdraw


def test_dispatch_window_caps_in_flight() -> None:
    h = Harness(config(window=3), fill_window=False)
    waiters = [h.submit("t", "standard") for _ in range(5)]
    assert [w.state for w in waiters] == [WaiterState.DISPATCHED] * 3 + [WaiterState.QUEUED] * 2
    assert h.core.snapshot().in_flight == {MODEL: 3}
    assert h.release() == [waiters[3]]
    assert h.core.snapshot().in_flight == {MODEL: 3}
    h.release()
    h.release()
    h.release()
    assert h.core.snapshot().in_flight == {MODEL: 1}


@pytest.mark.parametrize(
    ("window", "reserve", "limits"),
    [
        (8, 0.25, [8, 7, 6, 6]),
        (8, 0.0, [8, 8, 8, 8]),
        (4, 0.5, [4, 3, 2, 2]),
        (1, 0.5, [1, 1, 1, 1]),  # every class keeps at least one slot
    ],
)
def test_class_windows_step_down_the_class_list(
    window: int, reserve: float, limits: list[int]
) -> None:
    cfg = config(window=window, window_reserve=reserve)
    assert [class_window(cfg, k, window) for k in cfg.classes] == limits


def test_window_reserve_keeps_slots_free_for_higher_classes() -> None:
    h = Harness(config(window=4, window_reserve=0.5), fill_window=False)
    flood = [h.submit("bulk", "batch") for _ in range(10)]
    assert sum(w.state is WaiterState.DISPATCHED for w in flood) == 2
    # Higher arrivals during the flood dispatch at once, into the slots reserved for them
    # (limits 4, 3, 2, 2 for critical, interactive, standard, batch)...
    assert h.submit("app", "interactive").state is WaiterState.DISPATCHED
    assert h.submit("app", "interactive").state is WaiterState.QUEUED
    assert h.submit("vip", "critical").state is WaiterState.DISPATCHED
    assert h.core.snapshot().in_flight == {MODEL: 4}
    # ...and a finishing request hands its slot on only below the waiting class's limit.
    assert h.release() == []  # 3 in flight: interactive's limit
    (refill,) = h.release()
    assert refill.klass == "interactive"
    assert h.release() == []  # 2 in flight: batch's limit
    (refill,) = h.release()
    assert refill.klass == "batch" and h.core.snapshot().in_flight == {MODEL: 2}


def test_work_over_a_shrunk_window_does_not_take_the_slots_reserved_above_it() -> None:
    h = Harness(config(window=8, window_reserve=0.5), fill_window=False)
    flood = [h.submit("bulk", "batch") for _ in range(10)]
    assert sum(w.state is WaiterState.DISPATCHED for w in flood) == 4  # batch's limit of 8
    assert h.resize(4) == []  # limits 4, 3, 2, 2: batch is 2 over its own
    # Batch counts only up to its limit for the classes above: their reserved slots are
    # free at once, not after the batch work admitted under the larger window finished.
    vip = [h.submit("vip", "critical") for _ in range(3)]
    assert [w.state for w in vip] == [WaiterState.DISPATCHED] * 2 + [WaiterState.QUEUED]
    assert h.submit("app", "interactive").state is WaiterState.QUEUED
    assert h.core.snapshot().in_flight == {MODEL: 6}
    assert h.core.pressure(MODEL).limited
    # Batch finishing first frees nothing for anyone while it is still over its limit...
    assert h.release(flood[0]) == [] and h.release(flood[1]) == []
    # ...then the queued critical request goes first, and batch waits below its limit.
    assert h.release(flood[2]) == [vip[2]]
    assert h.release(flood[3]) == []  # 3 critical in flight: interactive's limit
    (refill,) = h.release(vip[0])
    assert refill.klass == "interactive"
    assert h.release(vip[1]) == []  # 2 in flight: batch's limit


@pytest.mark.parametrize("exclusive", [(), ("critical",)])
def test_an_exclusive_class_holds_the_classes_below_while_it_is_in_flight(exclusive: tuple[str, ...]) -> None:
    h = Harness(config(window=8, exclusive=exclusive), fill_window=False)
    assert all(h.submit("bulk", "batch").state is WaiterState.DISPATCHED for _ in range(2))
    vip = h.submit("vip", "critical")
    assert vip.state is WaiterState.DISPATCHED
    later = [h.submit("bulk", "batch"), h.submit("app", "interactive")]
    if not exclusive:  # the window has room: lower classes join the critical request
        assert [w.state for w in later] == [WaiterState.DISPATCHED] * 2
        return
    # Held in the gateway though the window has room, and not by it: an `auto` window
    # must not grow for them.
    assert [w.state for w in later] == [WaiterState.QUEUED] * 2
    assert not h.core.pressure(MODEL).limited
    assert h.submit("vip", "critical").state is WaiterState.DISPATCHED  # its own class goes
    assert h.release(h.in_flight[0]) == []  # batch work finishing frees nothing for them
    assert h.release(vip) == []  # the other critical request still holds them
    # The last one out lets them go, highest class first.
    assert [w.klass for w in h.release(h.in_flight[-1])] == ["interactive", "batch"]
    assert h.submit("bulk", "batch").state is WaiterState.DISPATCHED


def test_an_exclusive_class_holds_only_the_classes_below_it() -> None:
    h = Harness(config(window=8, exclusive=("interactive",)), fill_window=False)
    assert h.submit("app", "interactive").state is WaiterState.DISPATCHED
    assert h.submit("vip", "critical").state is WaiterState.DISPATCHED
    assert h.submit("web", "standard").state is WaiterState.QUEUED
    # A critical request in flight holds nobody: critical is not exclusive here.
    h.release(h.in_flight[0])
    assert [w.klass for w in h.in_flight] == ["critical", "standard"]


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_a_due_floor_overrides_an_exclusive_hold(floor: float) -> None:
    h = Harness(config(window=4, exclusive=("critical",), floor_share_by_class={"batch": floor}))
    for _ in range(100):
        h.submit("flood", "critical")
        h.submit("bulk", "batch")
    # Critical requests are always in flight, so batch goes only when its floor is due.
    counts = Counter(h.next_dispatched().klass for _ in range(100))
    assert counts["batch"] == (0 if floor == 0 else pytest.approx(25, abs=1))


def test_a_due_floor_may_use_the_reserved_slots() -> None:
    h = Harness(config(window=4, window_reserve=0.5, floor_share_by_class={"batch": 0.25}))
    for _ in range(100):
        h.submit("flood", "critical")
        h.submit("bulk", "batch")
    counts = Counter(h.next_dispatched().klass for _ in range(100))
    assert counts["batch"] >= 24  # its floor, though critical keeps the window full


def test_models_have_separate_windows_and_unknown_models_the_default_policy() -> None:
    core = SchedulingCore(
        parse_config(
            {"default_model_policy": {"dispatch_window": 2}, "scheduler": {"window_reserve": 0}}
        )
    )
    waiters = [Waiter("t", 1.0, "standard", model, None, 0.0) for model in ["x", "x", "y", "x"]]
    for waiter in waiters:
        core.submit(waiter, 0.0)
    assert [w.state for w in waiters] == [WaiterState.DISPATCHED] * 3 + [WaiterState.QUEUED]
    assert core.snapshot().in_flight == {"x": 2, "y": 1}


def test_unknown_class_is_invalid_argument() -> None:
    h = Harness(config())
    with pytest.raises(InvalidArgument):
        h.submit("t", "gold")


# --- the asyncio wrapper ------------------------------------------------------------------


def tenant(name: str = "acme") -> Tenant:
    return make_tenant(name)


async def enter_and_record(scheduler: Scheduler, name: str, order: list[str]) -> None:
    async with scheduler.slot(tenant=tenant(name), klass="standard", model=MODEL, deadline=None):
        order.append(name)


async def test_slot_fast_path_and_queued_wait() -> None:
    clock = FakeClock()
    scheduler = Scheduler(config(), clock)
    entered: list[float] = []

    async def second() -> None:
        async with scheduler.slot(
            tenant=tenant(), klass="critical", model=MODEL, deadline=None
        ) as d:
            entered.append(d.queue_wait_s)
            assert d.priority_level == 1

    async with scheduler.slot(tenant=tenant(), klass="batch", model=MODEL, deadline=None) as first:
        assert first.queue_wait_s == 0.0 and first.priority_level == 4
        task = asyncio.create_task(second())
        await asyncio.sleep(0)
        assert scheduler.snapshot().queued[(MODEL, "critical", "acme")] == 1
        clock.advance(0.25)
    await task
    assert entered == [0.25]
    assert scheduler.snapshot().in_flight == {MODEL: 0}


async def test_state_for_made_up_model_names_stays_bounded() -> None:
    # A tenant may send any model name; each unconfigured one gets queues on first use.
    scheduler = Scheduler(config(), FakeClock())
    async with scheduler.slot(tenant=tenant(), klass="standard", model="busy", deadline=None):
        for i in range(MAX_UNCONFIGURED_MODELS * 3):
            async with scheduler.slot(
                tenant=tenant(), klass="standard", model=f"made-up-{i}", deadline=None
            ):
                pass
        in_flight = scheduler.snapshot().in_flight
        assert len(in_flight) <= MAX_UNCONFIGURED_MODELS + 1  # + the configured MODEL at most
        assert in_flight["busy"] == 1  # a model with a request in flight is never forgotten
        assert f"made-up-{MAX_UNCONFIGURED_MODELS * 3 - 1}" in in_flight
        assert "made-up-0" not in in_flight
    async with scheduler.slot(tenant=tenant(), klass="standard", model=MODEL, deadline=None):
        async with scheduler.slot(tenant=tenant(), klass="standard", model="x", deadline=None):
            pass
    # The configured model keeps its state however many others come and go.
    assert MODEL in scheduler.snapshot().in_flight


async def test_cancelled_waiter_leaves_the_queue() -> None:
    scheduler = Scheduler(config(), FakeClock())
    order: list[str] = []

    async with scheduler.slot(tenant=tenant(), klass="standard", model=MODEL, deadline=None):
        doomed = asyncio.create_task(enter_and_record(scheduler, "doomed", order))
        survivor = asyncio.create_task(enter_and_record(scheduler, "survivor", order))
        await asyncio.sleep(0)
        doomed.cancel()
        await asyncio.sleep(0)
        assert scheduler.snapshot().queued[(MODEL, "standard", "doomed")] == 0
    await survivor
    assert doomed.cancelled() and order == ["survivor"]


async def test_cancelled_in_the_instant_of_its_grant_hands_the_slot_on() -> None:
    scheduler = Scheduler(config(), FakeClock())
    order: list[str] = []

    async with scheduler.slot(tenant=tenant(), klass="standard", model=MODEL, deadline=None):
        granted = asyncio.create_task(enter_and_record(scheduler, "granted", order))
        after = asyncio.create_task(enter_and_record(scheduler, "after", order))
        await asyncio.sleep(0)
    granted.cancel()  # its future is already resolved: it holds the slot, must pass it on
    await asyncio.wait_for(after, 1.0)
    assert order == ["after"] and granted.cancelled()
    assert scheduler.snapshot().in_flight == {MODEL: 0}


async def test_deadline_while_queued_raises_deadline_exceeded() -> None:
    clock = FakeClock()
    scheduler = Scheduler(config(), clock)
    async with scheduler.slot(tenant=tenant(), klass="standard", model=MODEL, deadline=None):
        with pytest.raises(DeadlineExceeded):
            async with scheduler.slot(
                tenant=tenant(), klass="standard", model=MODEL, deadline=clock.now() + 0.02
            ):
                pytest.fail("must not be dispatched")
        assert scheduler.snapshot().queued[(MODEL, "standard", "acme")] == 0


async def test_shed_waiter_raises_unavailable() -> None:
    scheduler = Scheduler(config(max_queued=1), FakeClock())

    async def batch() -> None:
        async with scheduler.slot(tenant=tenant(), klass="batch", model=MODEL, deadline=None):
            pytest.fail("must be shed")

    async with scheduler.slot(tenant=tenant(), klass="batch", model=MODEL, deadline=None):
        victim = asyncio.create_task(batch())
        await asyncio.sleep(0)
        vip = asyncio.create_task(
            scheduler.slot(
                tenant=tenant(), klass="critical", model=MODEL, deadline=None
            ).__aenter__()
        )
        with pytest.raises(Unavailable, match="shed under overload"):
            await victim
    await vip


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_the_core_consistent(seed: int) -> None:
    """Submit, release, withdraw, resize the window and let time pass at random, with
    token costs and in-flight token quotas; the books must always balance."""
    rng = random.Random(seed)
    window = rng.randint(1, 6)
    quota = rng.choice([None, 10, 25])
    cfg = config(
        window=window,
        max_queued=rng.randint(5, 30),
        floor_share=0.1,
        window_reserve=rng.choice([0.0, 0.25, 0.5]),
    )
    core = SchedulingCore(cfg)
    clock = FakeClock()
    queued: list[Waiter] = []
    running: list[Waiter] = []
    dispatched: set[Waiter] = set()  # Waiter compares by identity

    def account(waiter: Waiter) -> None:
        assert waiter not in dispatched, "dispatched twice"
        if waiter.state is WaiterState.DISPATCHED:
            dispatched.add(waiter)
            running.append(waiter)
        if waiter in queued:
            queued.remove(waiter)

    def tokens_of(tenant: str) -> int:
        return sum(w.tokens for w in running if w.tenant == tenant)

    for _ in range(600):
        op = rng.random()
        if op < 0.5:
            klass = rng.choice(cfg.classes)
            deadline = clock.now() + rng.uniform(0.1, 3.0) if rng.random() < 0.5 else None
            tokens = rng.randint(1, 10)
            waiter = Waiter(
                rng.choice("abcd"), rng.choice([1.0, 2.0]), klass, MODEL, deadline, 0.0,
                cost=rng.uniform(1, 30), tokens=tokens, token_quota=quota,
            )
            try:
                decided = core.submit(waiter, clock.now())
            except (Unavailable, DeadlineExceeded):
                assert waiter.state is WaiterState.PENDING
                continue
            for shed in decided:
                assert shed.state is WaiterState.DROPPED and shed.klass != cfg.classes[0]
                queued.remove(shed)
            if waiter.state is WaiterState.QUEUED:
                queued.append(waiter)
            else:
                account(waiter)
        elif op < 0.75 and running:
            finished = running.pop(rng.randrange(len(running)))
            core.settle(finished, rng.uniform(0, 30))
            for waiter in core.release(finished, clock.now()):
                if waiter.state is WaiterState.DROPPED:
                    assert waiter.deadline is not None and waiter.deadline <= clock.now()
                account(waiter)
        elif op < 0.8:
            window = rng.randint(1, 6)
            for waiter in core.resize(MODEL, window, clock.now()):
                account(waiter)
        elif op < 0.9 and queued:
            waiter = rng.choice(queued)
            assert core.withdraw(waiter)
            queued.remove(waiter)
        else:
            clock.advance(rng.uniform(0.0, 1.0))
        snapshot = core.snapshot()
        assert snapshot.in_flight.get(MODEL, 0) == len(running)
        assert sum(snapshot.queued.values()) == len(queued)
        assert all(w.state is WaiterState.QUEUED for w in queued)
        if quota is not None:
            assert all(tokens_of(t) <= quota for t in "abcd"), "in-flight tokens over the quota"
        blocked = {w.tenant for w in queued if quota is not None and tokens_of(w.tenant) + w.tokens > quota}
        assert all(
            len(running) >= class_window(cfg, w.klass, window)
            for w in queued
            if w.tenant not in blocked
        ), "work-conserving: nothing that may go waits while its class's share of the window has room"


# --- cost-based fair share, in-flight token quotas, moving windows --------------------------

LONG, SHORT = 10 + 2 * 128, 10 + 2 * 8  # prompt + 2 x max_tokens


def backlog_long_and_short(h: Harness, requests: int = 400) -> None:
    for _ in range(requests):
        h.submit("long", "standard", cost=LONG)
        h.submit("short", "standard", cost=SHORT)


def test_fair_share_counts_cost_not_requests() -> None:
    h = Harness(config())
    backlog_long_and_short(h)
    served = Counter[str]()
    for _ in range(300):
        waiter = h.next_dispatched()
        served[waiter.tenant] += int(waiter.cost)
    # Equal weights: equal service, within one long request.
    assert abs(served["long"] - served["short"]) <= LONG, served


def test_per_request_fair_share_is_available_and_is_unfair_in_tokens() -> None:
    h = Harness(config(fair_share="requests"))
    backlog_long_and_short(h)
    dispatched = Counter(h.next_dispatched().tenant for _ in range(300))
    assert dispatched["long"] == dispatched["short"] == 150  # every request counts 1


def test_settling_the_real_cost_moves_the_tenant_tag() -> None:
    h = Harness(config())
    for _ in range(20):
        h.submit("a", "standard", cost=1000)
        h.submit("b", "standard", cost=100)
    first = h.next_dispatched()
    assert first.tenant == "a"
    # Charged 1000, b would now get ten dispatches first; but the request stopped early
    # and really cost 10, so a is owed all but 10 of it and goes again right after b's first.
    h.core.settle(first, 10)
    assert [h.next_dispatched().tenant for _ in range(2)] == ["b", "a"]
    assert h.core.snapshot().served[(MODEL, "a")] == 10  # released by the dispatch after it


def test_a_tenant_returning_from_idle_is_lifted_to_the_busy_ones() -> None:
    h = Harness(config())
    for _ in range(100):
        h.submit("busy", "standard", cost=50)
    for _ in range(40):
        h.next_dispatched()
    for _ in range(20):
        h.submit("late", "standard", cost=50)
    tenants = Counter(h.next_dispatched().tenant for _ in range(20))
    assert tenants == {"busy": 10, "late": 10}


def test_service_while_uncontended_is_not_held_against_a_tenant() -> None:
    h = Harness(config(window=4), fill_window=False)
    # "heavy" alone, every request dispatched at once: it is charged, and the class's
    # virtual time follows it, so "light" arriving later cannot bank its absence.
    for _ in range(4):
        assert h.submit("heavy", "standard", cost=1000).state is WaiterState.DISPATCHED
        h.release()
    for _ in range(4):
        h.submit("filler", "critical")
    for _ in range(10):
        h.submit("heavy", "standard", cost=1000)
        h.submit("light", "standard", cost=1000)
    tenants = Counter(h.next_dispatched().tenant for _ in range(10))
    assert abs(tenants["heavy"] - tenants["light"]) <= 1, tenants


def test_inflight_token_quota_queues_the_tenant_and_lets_others_pass() -> None:
    h = Harness(config(window=8), fill_window=False)
    greedy = [h.submit("greedy", "standard", tokens=300, token_quota=1000) for _ in range(5)]
    assert [w.state for w in greedy] == [WaiterState.DISPATCHED] * 3 + [WaiterState.QUEUED] * 2
    # The window has room: another tenant goes at once, past greedy's queued requests.
    assert h.submit("other", "standard", tokens=300, token_quota=1000).state is WaiterState.DISPATCHED
    assert h.release(greedy[1]) == [greedy[3]]  # its tokens freed: its next request goes
    assert greedy[4].state is WaiterState.QUEUED


def test_a_request_larger_than_the_inflight_token_quota_is_refused() -> None:
    h = Harness(config(window=8), fill_window=False)
    with pytest.raises(QuotaExceeded, match="max_inflight_tokens 100"):
        h.submit("t", "standard", tokens=101, token_quota=100)


def test_freed_tokens_on_one_model_release_the_tenant_on_another() -> None:
    core = SchedulingCore(config(window=8))
    first = Waiter("t", 1.0, "standard", MODEL, None, 0.0, tokens=60, token_quota=100)
    other = Waiter("t", 1.0, "standard", "other", None, 0.0, tokens=60, token_quota=100)
    core.submit(first, 0.0)
    core.submit(other, 0.0)
    assert other.state is WaiterState.QUEUED
    assert list(core.release(first, 0.0)) == [other]
    assert other.state is WaiterState.DISPATCHED


def test_a_larger_window_dispatches_at_once_and_a_smaller_one_as_requests_finish() -> None:
    h = Harness(config(window=2, window_reserve=0.5), fill_window=False)
    batch = [h.submit("bulk", "batch") for _ in range(6)]
    assert sum(w.state is WaiterState.DISPATCHED for w in batch) == 1  # batch's share of 2
    assert len(h.resize(8)) == 3  # batch may now fill 4 of 8 (nested reservation)
    assert h.core.snapshot().window == {MODEL: 8}
    assert h.resize(2) == []  # nothing recalled...
    assert h.release() == [] and h.release() == [] and h.release() == []  # ...none refilled
    (refill,) = h.release()  # below batch's share of 2 again
    assert refill.state is WaiterState.DISPATCHED and h.core.snapshot().in_flight == {MODEL: 1}


def test_a_tenant_beyond_its_part_of_the_fair_cap_waits_while_the_class_has_room() -> None:
    h = Harness(config(window=8), fill_window=False)
    h.resize_with(fair={2: FairCaps(6, {"light": 2, "heavy": 4})})
    light = [h.submit("light", "standard") for _ in range(4)]
    assert [w.state for w in light] == [WaiterState.DISPATCHED] * 2 + [WaiterState.QUEUED] * 2
    heavy = [h.submit("heavy", "standard") for _ in range(5)]
    assert [w.state for w in heavy] == [WaiterState.DISPATCHED] * 4 + [WaiterState.QUEUED]
    # A light request finishing frees light's part, not heavy's.
    assert h.release(light[0]) == [light[2]]
    # A tenant with no part (not competing) is bounded by the class's cap alone: it waits
    # for a slot, and takes the next one by the order of tags (it has been served least).
    trickle = h.submit("trickle", "standard")
    assert trickle.state is WaiterState.QUEUED  # 6 in flight: the cap
    assert h.release(heavy[0]) == [trickle]
    assert h.release(light[1]) == [light[3]]


def test_the_window_grows_for_what_a_capped_class_asks() -> None:
    h = Harness(config(window=8), fill_window=False)
    h.resize_with(fair={2: FairCaps(4, {"a": 2, "b": 2})})
    for _ in range(6):
        h.submit("a", "standard")
        h.submit("b", "standard")
    # Held back by its fair cap, not the window; but 12 asked of a window of 8: the engine
    # is what should tell it to stop growing, and the cap splits whatever it is.
    assert h.core.snapshot().in_flight == {MODEL: 4}
    assert h.core.pressure(MODEL).limited


def test_occupancy_is_reported_per_ended_request_whatever_the_concurrency() -> None:
    # `light` has one request in flight at a time, `heavy` four; each request of either
    # stays 2 s per unit of cost. What the window's caps weigh them by must read alike,
    # and a request still in flight counts nothing until it ends.
    core = SchedulingCore(config(window=16))
    light = [Waiter("light", 1.0, "standard", MODEL, None, 0.0, cost=3.0) for _ in range(3)]
    heavy = [Waiter("heavy", 4.0, "standard", MODEL, None, 0.0, cost=1.0) for _ in range(12)]
    now = 0.0
    for i in range(3):
        batch = [light[i], *heavy[4 * i:4 * i + 4]]
        for w in batch:
            core.submit(w, now)
            assert w.state is WaiterState.DISPATCHED
        for w in batch:
            core.release(w, now + 2.0 * w.cost)
        now += 6.0
    straggler = Waiter("heavy", 4.0, "standard", MODEL, None, 0.0, cost=1.0)
    core.submit(straggler, now)
    core.submit(Waiter("light", 1.0, "standard", MODEL, None, 0.0, cost=3.0), now)
    (reported_tenants,) = core.pressure(MODEL).tenants.values()
    reported = {t.name: t for t in reported_tenants}
    assert reported["light"].ended_s / reported["light"].ended_cost == pytest.approx(2.0)
    assert reported["heavy"].ended_s / reported["heavy"].ended_cost == pytest.approx(2.0)
    assert reported["heavy"].ended_cost == 12.0 and reported["heavy"].charged == 13.0
