"""The Redis quota store on a real redis-server: two Admission instances, each with its own
RedisQuotaStore and connection (= two gateway processes), enforce one set of limits, and
two gateways count one daily token budget.

Buckets run on Redis server time, so these tests use real time; rates are chosen so that
the refill during a test is far below one request and outcomes are exact.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from conftest import free_port, require_model
from gateway_harness import TINY_KEY, GatewayThread, gateway_config
from qosgate.auth import Tenant
from qosgate.clock import MonotonicClock
from qosgate.config import QuotaStoreConfig
from qosgate.errors import Unavailable
from qosgate.quota import Admission, Admitted, Refused
from qosgate.quota.redis_store import PROBE_INTERVAL_S, RedisQuotaStore
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.usage import UsageRecord, UsageSummary
from qosgate.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.fakes import FakeClock, make_tenant
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration


# The async fixture below lives on the session loop (asyncio_default_fixture_loop_scope).
ON_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")


def store_config(server: RedisServer, prefix: str, **fields: object) -> QuotaStoreConfig:
    return QuotaStoreConfig(backend="redis", redis_url=server.url, key_prefix=prefix, **fields)


@pytest.fixture
async def gateways(redis_server: RedisServer) -> AsyncIterator[tuple[Admission, Admission]]:
    """Two admissions sharing one Redis (one key prefix per test: no state leaks between)."""
    config = store_config(redis_server, f"test-{uuid.uuid4().hex[:8]}")
    clock = MonotonicClock()
    stores = [RedisQuotaStore.from_config(config, clock=clock) for _ in range(2)]
    yield Admission(stores[0], clock), Admission(stores[1], clock)
    for store in stores:
        await store.aclose()


def tenant(**limits: float) -> Tenant:
    return make_tenant("acme", limits=limits)


@ON_SESSION_LOOP
async def test_two_gateways_share_one_request_rate(gateways: tuple[Admission, Admission]) -> None:
    a, b = gateways
    # Burst 10; refilling one request takes 10 s, far longer than this test.
    acme = tenant(requests_per_second=0.1, burst=10)
    verdicts = await asyncio.gather(*(g.admit(acme) for _ in range(10) for g in (a, b)))
    admitted = [v for v in verdicts if isinstance(v, Admitted)]
    refused = [v for v in verdicts if isinstance(v, Refused)]
    assert len(admitted) == 10
    assert len(refused) == 10
    # The wait is Redis's view of the shared bucket, whichever gateway answers.
    for r in refused:
        assert 9.0 < r.retry_after_s <= 10.0
        assert "requests_per_second limit 0.1 (burst 10) exceeded" in r.violations[0].description


@ON_SESSION_LOOP
async def test_concurrency_limit_spans_gateways(gateways: tuple[Admission, Admission]) -> None:
    a, b = gateways
    acme = tenant(max_concurrent=3)
    held = [await a.admit(acme), await a.admit(acme), await b.admit(acme)]
    assert all(isinstance(v, Admitted) for v in held)
    for g in (a, b):
        refused = await g.admit(acme)
        assert isinstance(refused, Refused)
        assert "max_concurrent limit 3 reached" in refused.violations[0].description
    first = held[0]
    assert isinstance(first, Admitted)
    await first.permit.release()
    await first.permit.release()  # idempotent: frees one slot only
    assert isinstance(await b.admit(acme), Admitted)
    assert isinstance(await a.admit(acme), Refused)


@ON_SESSION_LOOP
async def test_tokens_reserved_on_one_gateway_settle_for_both(
    gateways: tuple[Admission, Admission],
) -> None:
    a, b = gateways
    acme = tenant(tokens_per_minute=600)  # 10 tokens/s
    big = await a.admit(acme, cost_tokens=500)
    assert isinstance(big, Admitted)
    refused = await b.admit(acme, cost_tokens=200)  # 100 left: 100 missing at 10/s
    assert isinstance(refused, Refused)
    assert 9.0 < refused.retry_after_s <= 10.0
    assert "tokens_per_minute limit 600 exceeded" in refused.violations[0].description
    await big.permit.release(actual_tokens=100)  # 400 come back
    second = await b.admit(acme, cost_tokens=200)
    assert isinstance(second, Admitted)
    await second.permit.release(actual_tokens=700)  # 500 beyond the estimate: debt
    refused = await a.admit(acme, cost_tokens=1)
    assert isinstance(refused, Refused)
    assert 19.0 < refused.retry_after_s <= 20.1


_CRASHING_GATEWAY = textwrap.dedent(
    """
    import asyncio, sys
    from qosgate.clock import MonotonicClock
    from qosgate.config import LimitsConfig, QuotaStoreConfig
    from qosgate.quota.redis_store import RedisQuotaStore

    async def main():
        config = QuotaStoreConfig(
            backend="redis", redis_url=sys.argv[1], key_prefix=sys.argv[2], lease_s=1.0
        )
        store = RedisQuotaStore.from_config(config, clock=MonotonicClock())
        refused = await store.acquire("acme", LimitsConfig(max_concurrent=1), 0.0, 0)
        print("held" if refused is None else "refused", flush=True)
        await asyncio.sleep(3600)  # holding the slot until killed

    asyncio.run(main())
    """
)


@ON_SESSION_LOOP
async def test_slots_of_a_killed_gateway_expire_with_their_lease(redis_server: RedisServer) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CRASHING_GATEWAY,
        redis_server.url,
        prefix,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert holder.stdout is not None
    clock = MonotonicClock()
    store = RedisQuotaStore.from_config(store_config(redis_server, prefix), clock=clock)
    admission = Admission(store, clock)
    acme = tenant(max_concurrent=1)
    try:
        line = await asyncio.wait_for(holder.stdout.readline(), timeout=30)
        assert line.strip() == b"held"
        # While the holder lives it renews its lease: still held well past one lease.
        await asyncio.sleep(2.0)
        assert isinstance(await admission.admit(acme), Refused)
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        killed = time.monotonic()
        while not isinstance(verdict := await admission.admit(acme), Admitted):
            assert time.monotonic() - killed < 5.0, "the dead gateway's slot never expired"
            await asyncio.sleep(0.05)
        # Freed by the lease (1 s, renewed every 1/3 s), not before its last renewal ran out.
        assert time.monotonic() - killed > 0.3
        await verdict.permit.release()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        await store.aclose()


@ON_SESSION_LOOP
async def test_unreachable_redis_fails_closed_or_open_and_logs_once_per_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path, free_port())
    server.start()
    clock = FakeClock()  # paces the outage probes only; the buckets use Redis time
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    deny = RedisQuotaStore.from_config(store_config(server, prefix), clock=clock)
    allow = RedisQuotaStore.from_config(store_config(server, prefix, on_error="allow"), clock=clock)
    closed, open_ = Admission(deny, clock), Admission(allow, clock)
    acme = tenant(requests_per_second=0.1, burst=100, max_concurrent=100)
    try:
        assert isinstance(await closed.admit(acme), Admitted)
        server.stop()
        caplog.set_level(logging.WARNING, logger="qosgate.quota.redis_store")
        for _ in range(5):
            with pytest.raises(Unavailable) as refused:
                await closed.admit(acme)
            assert refused.value.retry_after_s == PROBE_INTERVAL_S
        # A tenant with no limit has nothing in Redis to count: decided here, at once,
        # without a round trip, whatever the store's on_error says.
        unlimited = tenant()
        assert not closed.in_process(acme.limits) and closed.in_process(unlimited.limits)
        free = closed.admit_now(unlimited, cost_tokens=40)
        assert isinstance(free, Admitted) and free.permit.release_now(50) is None
        admitted_blind = [await open_.admit(acme) for _ in range(5)]
        assert all(isinstance(v, Admitted) for v in admitted_blind)
        outages = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(outages) == 2  # one per store, not one per request
        assert "refusing" in outages[0].getMessage()
        assert "admitting unchecked" in outages[1].getMessage()
        assert server.url.split("//")[1].split("/")[0] in outages[0].getMessage()
        # Releasing what was admitted blind touches nothing in Redis and raises nothing.
        for verdict in admitted_blind:
            assert isinstance(verdict, Admitted)
            await verdict.permit.release()

        server.start()  # same port, empty state
        assert isinstance(await open_.admit(acme), Admitted)  # breaker still open: blind
        clock.advance(PROBE_INTERVAL_S)
        assert isinstance(await closed.admit(acme), Admitted)
        back = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(back) == 1
    finally:
        await deny.aclose()
        await allow.aclose()
        server.stop()


def test_two_gateways_in_front_of_triton_share_one_limit(
    triton, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Real gateways on their own loops: `tiny` (burst 1, one request per 10 s) gets one
    request through the pair, not one through each."""
    require_model("identity")
    shared = {
        "backend": "redis",
        "redis_url": redis_server.url,
        "key_prefix": f"test-{uuid.uuid4().hex[:8]}",
    }
    configs = [
        gateway_config(
            triton.ports.grpc_url,
            quota_store=shared,
            usage_db=str(tmp_path / f"usage-{i}.sqlite3"),
            batch={"db": str(tmp_path / f"batch-{i}.sqlite3")},
        )
        for i in range(2)
    ]
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.array([1.0, 2.0], dtype=np.float32).tobytes())
    key = (("authorization", f"Bearer {TINY_KEY}"),)
    with GatewayThread(configs[0]) as a, GatewayThread(configs[1]) as b:
        deadline = time.monotonic() + 30
        while not (a.gateway.pool.live and b.gateway.pool.live):
            assert time.monotonic() < deadline, "gateways never saw a ready upstream"
            time.sleep(0.1)
        with grpc.insecure_channel(a.url) as via_a, grpc.insecure_channel(b.url) as via_b:
            first = service_pb2_grpc.GRPCInferenceServiceStub(via_a)
            second = service_pb2_grpc.GRPCInferenceServiceStub(via_b)
            reply = first.ModelInfer(request, metadata=key, timeout=30)
            assert reply.raw_output_contents[0] == request.raw_input_contents[0]
            with pytest.raises(grpc.RpcError) as refused:
                second.ModelInfer(request, metadata=key, timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests_per_second limit 0.1 (burst 1)" in refused.value.details()


@ON_SESSION_LOOP
async def test_day_usage_is_shared_by_gateways_and_kept_three_days(redis_server: RedisServer) -> None:
    config = store_config(redis_server, f"test-{uuid.uuid4().hex[:8]}")
    clock = MonotonicClock()
    one, other = (RedisQuotaStore.from_config(config, clock=clock) for _ in range(2))
    try:
        await one.record_day_usage("acme", "2026-01-01", UsageRecord("acme", "m", "r1", 10, 5, "stop"))
        await other.record_day_usage("acme", "2026-01-01", UsageRecord("acme", "m", "r2", 7, 1, "length"))
        assert await one.day_usage("acme", "2026-01-01") == UsageSummary(2, 17, 6)
        assert await other.day_usage("acme", "2026-01-02") == UsageSummary()
        assert await other.day_usage("globex", "2026-01-01") == UsageSummary()
    finally:
        await one.aclose()
        await other.aclose()
    client = redis.Redis.from_url(redis_server.url)
    (key,) = client.keys(f"{config.key_prefix}:*:day:*")
    assert 3 * 86_400 - 60 < client.ttl(key) <= 3 * 86_400
    client.close()


def test_two_gateways_share_one_daily_token_budget(triton, redis_server: RedisServer, tmp_path: Path) -> None:
    """What one gateway spent counts on the other: its GetUsage shows it, and a request the
    rest of the budget cannot hold is refused there."""
    require_model("smollm2")
    budget = 150
    shared = {"backend": "redis", "redis_url": redis_server.url, "key_prefix": f"test-{uuid.uuid4().hex[:8]}"}
    tenants = [
        {"name": "metered", "api_keys": [{"key": "metered-key"}], "limits": {"daily_token_budget": budget}}
    ]
    configs = [
        gateway_config(
            triton.ports.grpc_url,
            tenants=tenants,
            quota_store=shared,
            usage_db=str(tmp_path / f"usage-{i}.sqlite3"),
            batch={"db": str(tmp_path / f"batch-{i}.sqlite3")},
        )
        for i in range(2)
    ]
    prompt = "The capital of France is"
    metadata = (("authorization", "Bearer metered-key"),)

    def generate(channel: grpc.Channel, max_tokens: int) -> generation_pb2.GenerateResponse:
        return generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            generation_pb2.GenerateRequest(
                model="smollm2",
                prompt=prompt,
                sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            ),
            metadata=metadata,
            timeout=120,
        )

    with GatewayThread(configs[0]) as a, GatewayThread(configs[1]) as b:
        with grpc.insecure_channel(a.url) as via_a, grpc.insecure_channel(b.url) as via_b:
            reply = generate(via_a, 16)
            spent = reply.usage.prompt_tokens + reply.usage.completion_tokens
            usage = admin_pb2_grpc.AdminServiceStub(via_b).GetUsage(
                admin_pb2.GetUsageRequest(), metadata=metadata, timeout=10
            )
            assert (usage.today.requests, usage.remaining_daily_tokens) == (1, budget - spent)
            # A fresh budget would hold this request; what gateway a left of it cannot.
            max_tokens = budget - spent - estimate_prompt_tokens(prompt) + 1
            assert max_tokens >= 1 and estimate_prompt_tokens(prompt) + max_tokens <= budget
            with pytest.raises(grpc.RpcError) as refused:
                generate(via_b, max_tokens)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "daily_token_budget" in refused.value.details()
