"""Fair share across gateways: two `qosgate serve` processes sharing a real Redis in front
of the real Triton (minilm, its dynamic batcher), with the ingress skewed as a load
balancer skews it: tenant x sends every call to gateway 1, tenant y splits its calls over
both. Each gateway publishes what it served every 100 ms and orders and limits its own
queue by the cluster's totals, so shares follow the weights, not the skew; a gateway or
Redis going away fails no call of the other, and fair share comes back with Redis.

The load is closed loops of KServe ModelInfer calls; shares are completions counted in a
window after a warm-up (the windows and caps settle first).
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import yaml
from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

MODEL = "minilm"
LOOPS = 24  # tenant x's closed loops, all to gateway 1; y's, half to each gateway
WARM_UP_S = 5.0  # for shares to settle: at the start, and after a reweighing
MEASURE_S = 20.0
# Where part of the stack goes away, the load only has to be running first, and the first
# window after only has to serve both tenants (a dead gateway's report expires in 1 s).
LOAD_START_S = 2.0
SERVED_S = 5.0


def tenants(weights: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {"name": name, "api_keys": [{"key": f"cluster-{name}-key"}], "weight": weight,
         "default_class": "standard", "max_class": "standard", "models": [MODEL]}
        for name, weight in weights.items()
    ]


def config(triton: Any, redis_url: str, prefix: str, weights: dict[str, float]) -> dict[str, Any]:
    """A gateway with the defaults for the model (no dispatch_window: `auto`)."""
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": f"127.0.0.1:{free_port()}",
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url, "metrics_url": triton.ports.metrics_url}],
        "quota_store": {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix},
        "tenants": tenants(weights),
    }


def reweigh(gateway: GatewayProcess, weights: dict[str, float]) -> None:
    """Rewrite the gateway's tenants and SIGHUP it (a reload, no restart)."""
    doc = yaml.safe_load(gateway.config_path.read_text())
    doc["tenants"] = tenants(weights)
    gateway.config_path.write_text(yaml.safe_dump(doc))
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while gateway.log_text().count("config reloaded") < 1:
        assert time.monotonic() < deadline, gateway.log_text()[-2000:]
        time.sleep(0.1)


@dataclass
class Tally:
    """Completions per tenant (OK) and failures per gateway, with when each happened."""

    ok: dict[str, list[float]] = field(default_factory=lambda: {"x": [], "y": []})
    failed: dict[int, list[tuple[float, str]]] = field(default_factory=lambda: {1: [], 2: []})

    def between(self, start: float, end: float) -> dict[str, int]:
        return {name: sum(start <= t < end for t in times) for name, times in self.ok.items()}


def embedding_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    text = b"Fair share across gateways follows the weights."
    request.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    return request


async def drive(targets: dict[int, str], tally: Tally, stop: asyncio.Event) -> None:
    """x: LOOPS loops to gateway 1; y: LOOPS / 2 to each; until `stop` is set."""
    request = embedding_request()
    channels = {i: grpc.aio.insecure_channel(t) for i, t in targets.items()}
    stubs = {i: service_pb2_grpc.GRPCInferenceServiceStub(c) for i, c in channels.items()}

    async def loop(tenant: str, gateway: int) -> None:
        metadata = (("authorization", f"Bearer cluster-{tenant}-key"),)
        while not stop.is_set():
            try:
                await stubs[gateway].ModelInfer(request, metadata=metadata, timeout=30)
                tally.ok[tenant].append(time.monotonic())
            except grpc.aio.AioRpcError as e:
                tally.failed[gateway].append((time.monotonic(), e.code().name))
                await asyncio.sleep(0.05)

    loops = [loop("x", 1) for _ in range(LOOPS)]
    loops += [loop("y", gateway) for gateway in (1, 2) for _ in range(LOOPS // 2)]
    try:
        await asyncio.gather(*loops)
    finally:
        for channel in channels.values():
            await channel.close()


class Load:
    """The skewed load in a thread of its own, running while the test acts on the stack."""

    def __init__(self, targets: dict[int, str]) -> None:
        self.tally = Tally()
        self.window = (0.0, 0.0)  # the last window shares_over counted
        self._targets = targets
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self._loop.run_until_complete(drive(self._targets, self.tally, self._stop))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    def shares_over(self, seconds: float) -> dict[str, int]:
        start = time.monotonic()
        self.window = (start, start + seconds)
        time.sleep(seconds)
        return self.tally.between(*self.window)

    def x_share_by_5_s(self) -> list[float]:
        """x's share in each 5 s of the last window, to tell a drift from an excursion."""
        start, end = self.window
        counts = [self.tally.between(start + i, min(end, start + i + 5.0)) for i in range(0, int(end - start), 5)]
        return [round(c["x"] / max(1, c["x"] + c["y"]), 3) for c in counts]


@pytest.fixture
def cluster(triton: Any, redis_server: RedisServer, tmp_path: pathlib.Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    require_model(MODEL)
    prefix = f"cluster-{uuid.uuid4().hex[:8]}"
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    weights = {"x": 1.0, "y": 1.0}
    with GatewayProcess.side_by_side(
        *((config(triton, redis_server.url, prefix, weights), tmp_path / name) for name in ("1", "2"))
    ) as (one, two):
        yield one, two


def ratio(counts: dict[str, int]) -> float:
    assert counts["x"] and counts["y"], counts
    return max(counts["x"] / counts["y"], counts["y"] / counts["x"])


def test_shares_follow_the_weights_not_the_ingress_skew(cluster: tuple[GatewayProcess, GatewayProcess]) -> None:
    one, two = cluster
    with Load({1: one.target, 2: two.target}) as load:
        time.sleep(WARM_UP_S)
        equal = load.shares_over(MEASURE_S)
        # Without the cluster's totals gateway 1 would split its half evenly and y would
        # get gateway 2 besides: about 3x x's service.
        assert ratio(equal) <= 1.2, equal
        for gateway in (one, two):
            reweigh(gateway, {"x": 1.0, "y": 4.0})
        # The limits that hold x back at gateway 1 move once a second, half way each time:
        # after 5 s, 1/32 of the way is left.
        time.sleep(WARM_UP_S)
        # The whole interval: x's share swings by some 0.03 around 0.2 from one 5 s to the
        # next (0.175, 0.236, 0.186, 0.202 in one run), so 10 s of a slow run once read 0.224.
        weighted = load.shares_over(MEASURE_S)
    total = weighted["x"] + weighted["y"]
    assert weighted["x"] / total == pytest.approx(0.2, rel=0.1), (weighted, load.x_share_by_5_s())
    assert weighted["y"] / total == pytest.approx(0.8, rel=0.1), weighted
    assert load.tally.failed == {1: [], 2: []}


def test_redis_going_away_fails_nothing_and_fair_share_comes_back(
    cluster: tuple[GatewayProcess, GatewayProcess], redis_server: RedisServer
) -> None:
    one, two = cluster
    with Load({1: one.target, 2: two.target}) as load:
        time.sleep(LOAD_START_S)
        redis_server.stop()
        # Each gateway falls back to its own fair share, and serves on.
        alone = load.shares_over(SERVED_S)
        redis_server.start()
        time.sleep(10.0)  # the bound for fair share to be back
        back = load.shares_over(MEASURE_S / 2)
    assert load.tally.failed == {1: [], 2: []}
    assert alone["x"] and alone["y"], alone
    assert ratio(back) <= 1.2, back
    for gateway in (one, two):
        log = gateway.log_text()
        # Said once per outage, and once that it is over.
        assert log.count("fair share across gateways paused") == 1, log[-3000:]
        assert log.count("fair share across gateways resumed") == 1, log[-3000:]


def test_a_killed_gateway_fails_no_call_of_the_other(cluster: tuple[GatewayProcess, GatewayProcess]) -> None:
    one, two = cluster
    with Load({1: one.target, 2: two.target}) as load:
        time.sleep(LOAD_START_S)
        killed = time.monotonic()
        two.kill(signal.SIGKILL)
        after = load.shares_over(SERVED_S)
    assert load.tally.failed[1] == []
    assert all(t >= killed for t, _ in load.tally.failed[2])
    # The dead gateway's report expires: gateway 1 alone serves both at its own fair
    # share (x has all its loops there, y half of its).
    assert after["x"] and after["y"], after
