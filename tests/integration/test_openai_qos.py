"""Priority holds across APIs: a batch-class flood sent over one API (OpenAI HTTP or
qosgate.v1 gRPC) does not take the latency of critical requests sent over the other, on
one gateway in front of smollm2 on real Triton. Bounds are generous: the machine is small
and shared."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import openai
import pytest

from conftest import require_model
from gateway_harness import GatewayThread, bearer, gateway_config
from qosgate.launcher import LocalTriton
from qosgate.v1 import generation_pb2, generation_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "oai-qos-key"
WINDOW = 4
FLOOD_STREAMS = 12  # well above the window: batch requests queue in the gateway
FLOOD_TOKENS, CRITICAL_TOKENS = 48, 8
SAMPLES = 3
GENEROUS_FACTOR = 4.0
COUNTING_PROMPT = "The numbers from one to one thousand: 1, 2, 3, 4,"

Send = Callable[[str, int], Awaitable[None]]


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    require_model("smollm2")
    config = gateway_config(
        triton.ports.grpc_url,
        models={"smollm2": {"dispatch_window": WINDOW, "default_temperature": 0}},
        tenants=[{"name": "mixed", "api_keys": [{"key": KEY}], "default_class": "standard", "max_class": "critical"}],
    )
    with GatewayThread(config) as thread:
        yield thread.wait_ready()


def _http(gateway: GatewayThread) -> Send:
    client = openai.AsyncOpenAI(base_url=gateway.openai_url, api_key=KEY, max_retries=0)

    async def send(klass: str, max_tokens: int) -> None:
        await client.completions.create(
            model="smollm2", prompt=COUNTING_PROMPT, max_tokens=max_tokens, extra_headers={"x-priority": klass}
        )

    return send


def _grpc(channel: grpc.aio.Channel) -> Send:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)

    async def send(klass: str, max_tokens: int) -> None:
        request = generation_pb2.GenerateRequest(
            model="smollm2",
            prompt=COUNTING_PROMPT,
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
            priority_class=klass,
        )
        await stub.Generate(request, metadata=tuple(bearer(KEY).items()), timeout=240)

    return send


async def _timed(send: Send, klass: str, max_tokens: int) -> float:
    started = time.monotonic()
    await send(klass, max_tokens)
    return time.monotonic() - started


async def _critical_latencies(send: Send) -> list[float]:
    return [await _timed(send, "critical", CRITICAL_TOKENS) for _ in range(SAMPLES)]


async def _batch_queued(gateway: GatewayThread) -> int:
    snapshot = gateway.gateway.scheduler.snapshot()
    return sum(n for (model, klass, _), n in snapshot.queued.items() if model == "smollm2" and klass == "batch")


async def _isolated(gateway: GatewayThread, flood: Send, critical: Send) -> None:
    await _critical_latencies(critical)  # warm up the path
    unloaded = statistics.median(await _critical_latencies(critical))
    flood_latencies: list[float] = []

    async def flood_stream() -> None:
        while True:
            flood_latencies.append(await _timed(flood, "batch", FLOOD_TOKENS))

    streams = [asyncio.create_task(flood_stream()) for _ in range(FLOOD_STREAMS)]
    try:
        deadline = time.monotonic() + 60
        while not await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_batch_queued(gateway), gateway.loop)):
            assert time.monotonic() < deadline, "the batch flood never queued in the gateway"
            await asyncio.sleep(0.1)
        loaded = await _critical_latencies(critical)
        # The comparison below needs finished batch requests, a window's worth; the rest of
        # the flood is cancelled rather than drained (the gateway then cancels it upstream).
        while len(flood_latencies) < WINDOW:
            assert time.monotonic() < deadline + 60, "no batch request of the flood finished"
            await asyncio.sleep(0.1)
    finally:
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    print(
        f"\ncritical p50 unloaded {unloaded * 1000:.0f} ms, under flood {statistics.median(loaded) * 1000:.0f} ms;"
        f" batch p50 {statistics.median(flood_latencies) * 1000:.0f} ms over {len(flood_latencies)} requests"
    )
    assert statistics.median(loaded) < GENEROUS_FACTOR * unloaded + 1.0
    # A critical request does not wait its turn behind the flood the way a batch one does.
    assert statistics.median(loaded) < statistics.median(flood_latencies)


async def test_critical_grpc_keeps_its_latency_under_an_http_batch_flood(gateway: GatewayThread) -> None:
    async with grpc.aio.insecure_channel(gateway.url) as channel:
        await _isolated(gateway, flood=_http(gateway), critical=_grpc(channel))


async def test_critical_http_keeps_its_latency_under_a_grpc_batch_flood(gateway: GatewayThread) -> None:
    async with grpc.aio.insecure_channel(gateway.url) as channel:
        await _isolated(gateway, flood=_grpc(channel), critical=_http(gateway))
