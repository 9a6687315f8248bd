"""Fair share across gateways (scheduler/cluster.py): reports, remote service, holds, and
the core taking them in."""

from __future__ import annotations

import pytest
from qosgate.config import parse_config
from qosgate.scheduler import SchedulingCore, Waiter, WaiterState
from qosgate.scheduler.cluster import (
    ALONE,
    HOLD_TOLERANCE,
    LIMIT_INTERVAL_S,
    RATE_WARMUP_S,
    ClusterExchange,
    ClusterShare,
    ClusterView,
    GatewayReport,
    TenantShare,
)

STANDARD = 2
SHARE = {0: 1.0, 1: 0.92, 2: 0.83, 3: 0.75}


def report(*tenants: TenantShare, window: int = 64, tokens: dict[str, int] | None = None) -> GatewayReport:
    return GatewayReport(tenants=list(tenants), windows={"m": window}, tokens=tokens or {})


def share(tenant: str, weight: float, charged: float, outstanding: int, queued: int) -> TenantShare:
    return TenantShare("m", STANDARD, tenant, weight, charged, outstanding, queued)


def test_a_report_survives_the_wire_and_garbage_is_refused() -> None:
    sent = report(share("acme", 2.0, 12.5, 3, 1), tokens={"acme": 400})
    assert GatewayReport.decode(sent.encode()) == sent
    for garbage in (b"", b"{}", b"[1, 2]", b'{"t": [[1]], "w": {}, "k": {}}'):
        with pytest.raises(ValueError, match="not a gateway report"):
            GatewayReport.decode(garbage)


def test_alone_there_is_nothing_to_take() -> None:
    assert ClusterShare(SHARE).view(0.0, report(share("x", 1, 10, 5, 2)), []) is ALONE


def test_remote_service_and_tokens_are_summed_over_the_other_gateways() -> None:
    view = ClusterShare(SHARE).view(
        0.0,
        report(share("y", 1, 100, 5, 2)),
        [report(share("y", 1, 30, 5, 2), tokens={"y": 100}), report(share("y", 1, 12, 1, 0), tokens={"y": 50})],
    )
    assert view.remote_charged == {("m", STANDARD, "y"): 42}
    assert view.remote_tokens == {"y": 150}


class Cluster:
    """Two gateways' reports over time: x (weight 1) only at this gateway, y (weight 4)
    only at the other; each served at the rates given."""

    def __init__(self) -> None:
        self.sharer = ClusterShare(SHARE)
        self.now = 0.0
        self.x = self.y = 0.0

    def step(self, x_rate: float, y_rate: float, *, x_queued: int = 20, y_queued: int = 0) -> ClusterView:
        self.now += 0.1
        self.x += x_rate * 0.1
        self.y += y_rate * 0.1
        # Windows of 32 each: the engine's capacity, split by the two gateways' sizing.
        return self.sharer.view(self.now, report(share("x", 1, self.x, 32, x_queued), window=32),
                                [report(share("y", 4, self.y, 32, y_queued), window=32)])


def test_a_tenant_ahead_of_a_starved_one_elsewhere_is_limited_in_proportion() -> None:
    cluster = Cluster()
    # Each gateway gives its one tenant what its window lets through: the same rate, where
    # the weights ask for 1:4. Rates need a moment of history before they count.
    views = [cluster.step(100, 100, x_queued=0) for _ in range(int(RATE_WARMUP_S / 0.1) + 2)]
    assert not views[0].limits
    # x is 4x ahead per unit of weight: half way (in ratio) to where it would not be, from
    # the 32 it has in flight here.
    assert views[-1].limits == {("m", STANDARD, "x"): 16}
    # Further cuts wait until the rates could show the last one.
    first = cluster.now
    while (view := cluster.step(100, 100, x_queued=16)).limits == {("m", STANDARD, "x"): 16}:
        pass
    assert view.limits == {("m", STANDARD, "x"): 8}
    assert cluster.now - first >= LIMIT_INTERVAL_S


def test_a_limit_grows_back_once_the_tenant_is_behind_and_goes() -> None:
    cluster = Cluster()
    for _ in range(int(RATE_WARMUP_S / 0.1) + 2):
        cluster.step(100, 100, x_queued=0)
    limits = []
    for _ in range(200):
        limits.append(cluster.step(10, 100, x_queued=16).limits.get(("m", STANDARD, "x")))
    # Its rate takes a moment to show it behind (one more cut meanwhile), then the limit
    # grows back step by step until it holds nothing back.
    assert limits[0] == 16 and limits[-1] is None
    grown = [n for n in limits if n is not None]
    lowest = grown.index(min(grown))
    assert grown[lowest:] == sorted(grown[lowest:]) and grown[-1] > grown[lowest]


def test_no_limit_within_the_tolerance() -> None:
    cluster = Cluster()
    for _ in range(60):
        view = cluster.step(100 * (1 + HOLD_TOLERANCE / 2), 400, x_queued=0)
    assert not view.limits


def test_a_limit_does_not_come_and_go_with_the_competitor_queued_here_or_not() -> None:
    # y's closed loops here are nearly all in flight: one waits in most reports, none in
    # the others. Its service over the cluster is what counts, so the limit on x, 4x ahead
    # of it per unit of weight, holds in every report and only tightens.
    sharer = ClusterShare(SHARE)
    limits = []
    for i in range(100):
        t = 0.1 * (i + 1)
        y_here = share("y", 4, 50 * t, 16, 0 if i % 5 == 0 else 1)
        view = sharer.view(t, report(share("x", 1, 100 * t, 32, 20), y_here, window=32),
                           [report(share("y", 4, 50 * t, 16, 0), window=32)])
        limits.append(view.limits.get(("m", STANDARD, "x")))
    settled = limits[int(RATE_WARMUP_S / 0.1) + 2:]
    assert None not in settled and settled == sorted(settled, reverse=True), limits


def test_no_limit_for_a_competitor_served_nothing() -> None:
    # Stuck elsewhere for a reason this gateway cannot mend: idling its engine would not help.
    cluster = Cluster()
    for _ in range(40):
        view = cluster.step(100, 0)
    assert not view.limits


def test_a_gateway_gone_takes_its_count_with_it_and_nothing_is_limited_alone() -> None:
    cluster = Cluster()
    views = [cluster.step(100, 100) for _ in range(40)]
    assert views[-1].limits
    assert cluster.sharer.view(cluster.now + 0.1, report(share("x", 1, cluster.x, 32, 20)), []) is ALONE


def core() -> SchedulingCore:
    return SchedulingCore(parse_config({"models": {"m": {"dispatch_window": 1}},
                                        "scheduler": {"window_reserve": 0}}))


def waiter(tenant: str, **fields: object) -> Waiter:
    return Waiter(tenant, 1.0, "standard", "m", None, 0.0, **fields)  # type: ignore[arg-type]


def test_service_elsewhere_counts_in_the_order_here() -> None:
    c = core()
    busy = waiter("filler")
    c.submit(busy, 0.0)
    x, y = waiter("x"), waiter("y")
    c.submit(y, 0.0)
    c.submit(x, 0.0)
    # y was served 5 requests' worth at another gateway meanwhile: x goes first here.
    c.cluster_apply(ClusterView({("m", STANDARD, "y"): 5.0}, {}, {}), 0.0)
    assert c.release(busy, 1.0) == [x]
    assert x.state is WaiterState.DISPATCHED and y.state is WaiterState.QUEUED
    # The same report again charges nothing more.
    c.cluster_apply(ClusterView({("m", STANDARD, "y"): 5.0}, {}, {}), 1.0)
    x2 = waiter("x")
    c.submit(x2, 1.0)
    assert c.release(x, 2.0) == [x2]  # x is still 4 behind y


def test_after_redis_is_back_only_what_the_others_serve_from_then_on_counts_here() -> None:
    c = core()
    busy = waiter("filler")
    c.submit(busy, 0.0)
    x, y = waiter("x"), waiter("y")
    c.submit(x, 0.0)
    c.submit(y, 0.0)
    c.cluster_apply(ClusterView({("m", STANDARD, "y"): 0.5}, {}, {}), 0.0)
    # Redis goes away; meanwhile the other gateway serves y 5 more. Back, its total of
    # 5.5 is where counting starts again: y has 0.5 here, not 5.5.
    c.cluster_apply(ALONE, 1.0)
    c.cluster_apply(ClusterView({("m", STANDARD, "y"): 5.5}, {}, {}), 2.0)
    assert c.release(busy, 3.0) == [x]  # x 1, y 0.5
    x2 = waiter("x")
    c.submit(x2, 3.0)
    assert c.release(x, 4.0) == [y]  # y 1.5
    # From then on, service elsewhere counts again: 1 more there, y 2.5.
    c.cluster_apply(ClusterView({("m", STANDARD, "y"): 6.5}, {}, {}), 5.0)
    y2 = waiter("y")
    c.submit(y2, 5.0)
    assert c.release(y, 6.0) == [x2]  # x 2
    x3 = waiter("x")
    c.submit(x3, 6.0)
    assert c.release(x2, 7.0) == [x3]


def test_a_limited_tenant_waits_beyond_its_limit_until_let_go() -> None:
    c = SchedulingCore(parse_config({"models": {"m": {"dispatch_window": 4}}, "scheduler": {"window_reserve": 0}}))
    c.cluster_apply(ClusterView({}, {("m", STANDARD, "x"): 1}, {}), 0.0)
    first, second = waiter("x"), waiter("x")
    c.submit(first, 0.0)
    c.submit(second, 0.0)
    assert first.state is WaiterState.DISPATCHED
    assert second.state is WaiterState.QUEUED  # the window has room, x may not take it
    y = waiter("y")
    c.submit(y, 0.0)
    assert y.state is WaiterState.DISPATCHED
    c.release(y, 1.0)
    assert second.state is WaiterState.QUEUED
    assert c.cluster_apply(ALONE, 1.0) == [second]


def test_tokens_in_flight_elsewhere_count_against_the_tenant_quota() -> None:
    c = SchedulingCore(parse_config({"scheduler": {"window_reserve": 0}}))
    c.cluster_apply(ClusterView({}, {}, {"x": 900}), 0.0)
    big = waiter("x", tokens=200, token_quota=1000)
    c.submit(big, 0.0)
    assert big.state is WaiterState.QUEUED  # 900 elsewhere + 200 > 1000
    assert c.cluster_apply(ClusterView({}, {}, {"x": 700}), 1.0) == [big]


def test_the_report_carries_what_each_tenant_was_charged_and_has_outstanding() -> None:
    c = core()
    a, b = waiter("a", cost=3.0), waiter("a", cost=2.0)
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    c.settle(a, 4.0)
    sent = c.cluster_report()
    assert sent.windows == {"m": 1}
    assert sent.tenants == [TenantShare("m", STANDARD, "a", 1.0, 4.0, 2, 1)]


class FakeRedis:
    """The report exchange, answering from a script: a list of replies, or None (down)."""

    def __init__(self, *replies: list[bytes] | None) -> None:
        self.replies = list(replies)
        self.published: list[bytes] = []

    async def exchange_reports(self, report: bytes, ttl_s: float) -> list[bytes] | None:
        self.published.append(report)
        return self.replies.pop(0)


async def test_the_exchange_publishes_reads_and_says_once_when_redis_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    other = report(share("y", 4, 3.0, 1, 0)).encode()
    redis = FakeRedis([other], None, None, [other, b"garbage", b"more garbage"])
    received: list[list[GatewayReport]] = []
    mine = report(share("x", 1, 1.0, 2, 1))
    exchange = ClusterExchange(redis, lambda: mine, lambda reports: received.append(list(reports)))
    with caplog.at_level("WARNING"):
        for _ in range(4):
            await exchange.exchange_once()
    assert redis.published == [mine.encode()] * 4
    expected = GatewayReport.decode(other)
    assert received == [[expected], [], [], [expected]]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("paused" in m for m in messages) == 1 and sum("resumed" in m for m in messages) == 1
    assert sum("cannot read" in m for m in messages) == 1
