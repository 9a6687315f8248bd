"""LLM-aware QoS on the real engine: fair share counted in tokens, and the in-flight token
quota, through a real gateway (in-process, port 0) in front of smollm2 on real Triton.

The fairness test runs a saturating load on two gateways that differ only in
`scheduler.fair_share`. Counted in tokens, tenants with long and with short generations
get about the same token service, whether they call GenerateStream or KServe
ModelStreamInfer (four tenants in one run); counted in requests, the one with long
generations gets many times more.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from qosgate.launcher import LocalTriton
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from conftest import engine_idle, require_model
from gateway_harness import GatewayThread, bearer, gateway_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Greedy SmolLM2 counts on to max_tokens from this prompt: every request runs its length.
COUNTING_PROMPT = "The numbers from one to one thousand: 1, 2, 3, 4,"
LONG_TOKENS, SHORT_TOKENS = 128, 8
# The quota tests' generations: long enough to hold their tokens while the next one asks.
QUOTA_TOKENS = 48
# Two messages a stalled client reads in one burst arrive this close, in either order.
BURST_ORDER_S = 0.05
WINDOW = 8
STREAMS = 12  # per tenant: together well above the window, so queues form in the gateway
# Start-time fair queueing charges a request's whole estimated cost when it is dispatched,
# and a 128-token generation runs ~6 s on an unloaded 2-core machine (longer when loaded):
# the shares settle only over a few of them. The warm-up lets every window slot turn over
# once. The measurement lasts at least MEASURE_MIN_S steady seconds and until the engine
# has delivered MEASURE_SERVICE token service in them (~350/s here, ~110/s on a loaded CI
# machine), so a slow engine lengthens the measurement instead of judging fairness on a
# handful of tokens. Measured under a benchmark's load, the ratio read 0.96-1.05 (cost)
# and 6-11 (requests) over any 8-20 s from 4 s on.
WARMUP_S = 6.0
MEASURE_MIN_S, MEASURE_SERVICE = 15.0, 3000.0
# On a loaded machine the clients can read nothing for seconds while the engine goes on
# generating (CI saw 20 s of nothing, then 2,560 in one second; beside two CPU hogs here,
# 3-18 s again and again, whether the gateway ran in this process or in its own), then
# one burst of what the engine made meanwhile, nearly all of it the long tenants', and
# every client sends its next request at once. A whole second in which no stream
# delivered anything marks such a stall; the measurement leaves it out with the SETTLE_S
# after it, and sums the steady seconds between stalls: replayed on CI's last failure and
# five failing runs beside the hogs, that measured each within 62-120 s, where waiting
# for one steady stretch measured none, and leaving WARMUP_S after each stall two. A shorter
# stall's burst is bounded by MAX_SECOND_SHARE of the service measured. A stall of
# STALL_DUMP_S or more prints every thread's stack, to tell where this process stood.
# MEASURE_CAP_S bounds the whole load.
SETTLE_S = 3.0
MAX_SECOND_SHARE = 0.2
STALL_DUMP_S = 3.0
MEASURE_CAP_S = 150.0
OUTPUT_WEIGHT = 2  # VTC's w: the token service counted is prompt + 2 x completion


def _tenant(name: str, **limits: int) -> dict[str, object]:
    return {
        "name": name,
        "api_keys": [{"key": f"{name}-key"}],
        "default_class": "standard",
        "max_class": "standard",
        "limits": limits,
    }


def _config(triton: LocalTriton, fair_share: str) -> GatewayThread:
    return GatewayThread(
        gateway_config(
            triton.ports.grpc_url,
            models={"smollm2": {"dispatch_window": WINDOW, "default_temperature": 0.0, "kserve_token_counts": True}},
            scheduler={"fair_share": fair_share, "window_reserve": 0},
            tenants=[
                _tenant("long"),
                _tenant("short"),
                _tenant("kserve-long"),
                _tenant("kserve-short"),
                _tenant("kv", max_inflight_tokens=100),
                _tenant("metered", tokens_per_minute=100),
                _tenant("exact"),
            ],
        )
    )


def _counting(max_tokens: int) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        model="smollm2",
        prompt=COUNTING_PROMPT,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _wait_ready(thread: GatewayThread, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not thread.gateway.pool.live:
        assert time.monotonic() < deadline, "gateway never saw a ready upstream"
        time.sleep(0.1)


@dataclass
class Service:
    """Token service one tenant got: (time, weighted tokens) as its streams delivered them."""

    events: list[tuple[float, float]] = field(default_factory=list)

    def per_second(self, start: float, seconds: int) -> list[float]:
        """Its service in each of the `seconds` whole seconds from `start`."""
        service = [0.0] * seconds
        for at, tokens in self.events:
            if start <= at and (second := int(at - start)) < seconds:
                service[second] += tokens
        return service


class StartLine:
    """The load's streams connect first, then send their first requests one by one in the
    order they were made (the tenants interleaved): the first requests arrive at an empty
    window, which takes them as they come, and a tenant whose requests came first would
    hold more of it than its share for a whole generation (ahead by what it took, lifted
    to nobody: fair share lends no credit to a tenant that was not there yet)."""

    SPACING_S = 0.01

    def __init__(self, streams: int) -> None:
        self._turns = [asyncio.Event() for _ in range(streams)]
        self._connected = 0
        self._all_connected = asyncio.Event()

    async def turn(self, position: int) -> None:
        """Stream `position` is connected; returns when it may send."""
        self._connected += 1
        if self._connected == len(self._turns):
            self._all_connected.set()
        await self._turns[position].wait()

    async def release(self) -> None:
        await asyncio.wait_for(self._all_connected.wait(), 30.0)
        for turn in self._turns:
            turn.set()
            await asyncio.sleep(self.SPACING_S)


async def _stream_loop(url: str, tenant: str, max_tokens: int, service: Service, turn: Awaitable[None]) -> None:
    """One closed-loop stream: connect, wait for its `turn`, then a generation, then the
    next, until cancelled. Each text chunk counts as a generated token when it arrives; the
    final usage corrects the count."""
    metadata = tuple(bearer(f"{tenant}-key").items())
    request = _counting(max_tokens)
    async with grpc.aio.insecure_channel(url) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await channel.channel_ready()
        await turn
        while True:
            chunks = 0
            async for response in stub.GenerateStream(request, metadata=metadata, timeout=MEASURE_CAP_S * 2):
                now = time.monotonic()
                if response.HasField("usage"):
                    extra = response.usage.completion_tokens - chunks
                    service.events.append((now, response.usage.prompt_tokens + OUTPUT_WEIGHT * max(0, extra)))
                elif response.text:
                    chunks += 1
                    service.events.append((now, OUTPUT_WEIGHT))


# One closed-loop stream of a tenant's: (gateway URL, tenant, max_tokens, its Service, its
# turn on the StartLine).
StreamLoop = Callable[[str, str, int, Service, Awaitable[None]], Awaitable[None]]
# A saturating load: (tenant, max_tokens of each of its generations, its streams' loop).
Load = tuple[tuple[str, int, StreamLoop], ...]


async def _kserve_stream_loop(url: str, tenant: str, max_tokens: int, service: Service, turn: Awaitable[None]) -> None:
    """`_stream_loop` through KServe ModelStreamInfer: a request per stream, the tokens of
    each response as the engine counts them (a response carries every token generated
    since the last one was sent), the prompt as the gateway estimates it."""
    metadata = tuple(bearer(f"{tenant}-key").items())
    prompt_tokens = estimate_prompt_tokens(COUNTING_PROMPT)
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        await channel.channel_ready()
        await turn
        while True:
            requests = [_kserve_generation(tenant, max_tokens, count_tokens=True)]
            async for response in stub.ModelStreamInfer(iter(requests), metadata=metadata, timeout=MEASURE_CAP_S * 2):
                assert not response.error_message, response.error_message
                if tokens := _output_tokens(response.infer_response):
                    service.events.append((time.monotonic(), OUTPUT_WEIGHT * tokens))
            service.events.append((time.monotonic(), prompt_tokens))


def _output_tokens(response: service_pb2.ModelInferResponse) -> int:
    """The generated tokens a streamed response carries (its num_output_tokens)."""
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.name == "num_output_tokens":
            return int.from_bytes(raw[:4], "little")
    return 0


GENERATE_STREAM: Load = (("long", LONG_TOKENS, _stream_loop), ("short", SHORT_TOKENS, _stream_loop))
KSERVE_STREAM: Load = (
    ("kserve-long", LONG_TOKENS, _kserve_stream_loop),
    ("kserve-short", SHORT_TOKENS, _kserve_stream_loop),
)


async def _saturate(url: str, load: Load) -> tuple[dict[str, float], str]:
    """The tenants of `load` saturate the model; each one's token service over the steady
    seconds measured, and the service per second of all, for a failure's message."""
    services = {tenant: Service() for tenant, _, _ in load}
    # Interleaved, so no tenant's first requests take the whole window: on a slow
    # (loaded) engine a 128-token generation can outlast the measured interval, and the
    # first holder of every slot would then keep it whatever the fair share decides.
    streams = [(tenant, tokens, stream_loop) for _ in range(STREAMS) for tenant, tokens, stream_loop in load]
    line = StartLine(len(streams))
    loops = [
        asyncio.create_task(stream_loop(url, tenant, tokens, services[tenant], line.turn(position)))
        for position, (tenant, tokens, stream_loop) in enumerate(streams)
    ]
    await line.release()
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as stacks:
        try:
            while True:
                faulthandler.dump_traceback_later(STALL_DUMP_S, file=stacks)
                await asyncio.sleep(0.25)
                now = time.monotonic()
                for loop in loops:
                    if loop.done():
                        loop.result()  # a stream that failed fails the test with its error
                whole = int(now - start)  # the last second still fills
                per_tenant = {tenant: service.per_second(start, whole) for tenant, service in services.items()}
                totals = [sum(second) for second in zip(*per_tenant.values())]
                steady = _steady(totals)
                delivered, burst = sum(totals[i] for i in steady), max((totals[i] for i in steady), default=0.0)
                measured = delivered >= MEASURE_SERVICE and burst <= MAX_SECOND_SHARE * delivered
                if (measured and len(steady) >= MEASURE_MIN_S) or now - start >= WARMUP_S + MEASURE_CAP_S:
                    break
        finally:
            faulthandler.cancel_dump_traceback_later()
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
        stacks.seek(0)
        if stall := stacks.read():
            print(f"this process stalled for {STALL_DUMP_S} s or more; its threads then:\n{stall}")
    timeline = " ".join(f"{second:.0f}" for second in totals)
    assert measured, (
        f"the engine delivered {delivered:.0f} in {len(steady)} steady seconds, "
        f"{burst:.0f} in one of them: {timeline}"
    )
    return {tenant: sum(seconds[i] for i in steady) for tenant, seconds in per_tenant.items()}, timeline


def _steady(totals: list[float]) -> list[int]:
    """Of the seconds in which all tenants got `totals`, those of a steady state: from
    WARMUP_S on, and neither a silent one (a stall) nor within SETTLE_S after one."""
    steady: list[int] = []
    settled_from = WARMUP_S
    for second, total in enumerate(totals):
        if total == 0.0:
            settled_from = second + 1 + SETTLE_S
        elif second >= settled_from:
            steady.append(second)
    return steady


def _ratio(services: dict[str, float], a: str, b: str) -> float:
    """How many times the larger of two token services is the smaller."""
    assert services[a] > 0 and services[b] > 0, services
    return max(services[a], services[b]) / min(services[a], services[b])


@pytest.fixture(scope="module", params=["cost", "requests"])
def fair_share_gateway(request: pytest.FixtureRequest, triton: LocalTriton) -> Iterator[tuple[str, GatewayThread]]:
    require_model("smollm2")
    with _config(triton, request.param) as thread:
        _wait_ready(thread)
        yield request.param, thread


def test_long_and_short_generations_get_equal_token_service(
    fair_share_gateway: tuple[str, GatewayThread], triton: LocalTriton
) -> None:
    fair_share, thread = fair_share_gateway
    engine_idle(triton, "requests of earlier tests still run in the engine")
    if fair_share == "requests":
        services, timeline = asyncio.run(_saturate(thread.url, GENERATE_STREAM))
        print(f"fair_share=requests: token service {services}")
        print(f"token service per second, all tenants: {timeline}")
        # Per-request fair share: the long tenant gets many times the short one's tokens,
        # and the short one still its turns.
        assert services["short"] > 0, (services, timeline)
        assert services["long"] / services["short"] >= 3.0, (services, timeline)
        return
    services, timeline = asyncio.run(_saturate(thread.url, GENERATE_STREAM + KSERVE_STREAM))
    print(f"fair_share=cost: token service {services}")
    print(f"token service per second, all tenants: {timeline}")
    # Aim 1.5 (the bench reports the figure over 90 s); generous for a short run. KServe
    # streams are charged in tokens like the generation API's: each pair holds, and the
    # two APIs' tenants get about the same.
    assert _ratio(services, "long", "short") <= 2.0, (services, timeline)
    assert _ratio(services, "kserve-long", "kserve-short") <= 2.0, (services, timeline)
    apis = {
        "generate": services["long"] + services["short"],
        "kserve": services["kserve-long"] + services["kserve-short"],
    }
    assert _ratio(apis, "generate", "kserve") <= 2.0, (services, timeline)


@pytest.fixture(scope="module")
def quota_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    require_model("smollm2")
    with _config(triton, "cost") as thread:
        _wait_ready(thread)
        yield thread


def test_max_inflight_tokens_queues_then_runs_and_refuses_what_never_fits(quota_gateway: GatewayThread) -> None:
    metadata = tuple(bearer("kv-key").items())

    async def one(
        stub: generation_pb2_grpc.GenerationServiceStub, max_tokens: int, started: asyncio.Event | None = None
    ) -> tuple[float, float]:
        """(time of the first text, time of the final response) of one generation; `started`
        is set at its first text."""
        first = 0.0
        async for response in stub.GenerateStream(_counting(max_tokens), metadata=metadata, timeout=120):
            if response.text and not first:
                first = time.monotonic()
                if started is not None:
                    started.set()
        return first, time.monotonic()

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(quota_gateway.url) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            # Each holds prompt + 48 tokens: one fits in 100, two do not. The second is sent
            # once the first streams (so it is admitted and holds its tokens): however slow
            # the machine, the order is fixed.
            running = asyncio.Event()
            first = asyncio.create_task(one(stub, QUOTA_TOKENS, running))
            await asyncio.wait_for(running.wait(), timeout=60)
            second = asyncio.create_task(one(stub, QUOTA_TOKENS))
            (_, first_end), (second_start, _) = await asyncio.gather(first, second)
            # Queued in the gateway, not refused: it ran, and only after the first finished.
            # Its first text then follows its prefill; a client that stalled meanwhile reads
            # both in one burst, in either order (0.3 ms apart beside two CPU hogs). Run
            # beside the first, it would have streamed while the first had most of its
            # tokens to go.
            assert second_start >= first_end - BURST_ORDER_S, (second_start, first_end)
            # Alone more than the quota: refused at once, with nothing queued.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await one(stub, 1000)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_tokens 100" in (refused.value.details() or "")

    asyncio.run(scenario())
    snapshot = quota_gateway.gateway.scheduler.snapshot()
    assert snapshot.queued.get(("smollm2", "standard", "kv"), 0) == 0


def _kserve_generation(
    request_id: str, max_tokens: int, count_tokens: bool = False, *, stream: bool = True, stop: str = "",
    count_prompt: bool = False,
) -> service_pb2.ModelInferRequest:
    """The vLLM backend's contract, as tritonclient sends it; `count_tokens` asks for each
    response's num_output_tokens, `count_prompt` for num_input_tokens; `stop` ends the
    generation where it writes that text."""
    request = service_pb2.ModelInferRequest(model_name="smollm2", id=request_id)
    sampling = {"max_tokens": max_tokens, "temperature": 0, **({"stop": [stop]} if stop else {})}
    for name, datatype, raw in (
        ("text_input", "BYTES", len(COUNTING_PROMPT).to_bytes(4, "little") + COUNTING_PROMPT.encode()),
        ("stream", "BOOL", b"\x01" if stream else b"\x00"),
        ("sampling_parameters", "BYTES", (text := json.dumps(sampling).encode()) and len(text).to_bytes(4, "little") + text),
        *((("return_num_output_tokens", "BOOL", b"\x01"),) if count_tokens else ()),
        *((("return_num_input_tokens", "BOOL", b"\x01"),) if count_prompt else ()),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


def test_kserve_generations_are_charged_in_tokens_like_the_generation_apis(quota_gateway: GatewayThread) -> None:
    """A ModelStreamInfer request of the LLM counts against tokens_per_minute by its prompt
    and max_tokens, and its usage is what the engine generated: it cannot bypass a token
    quota the generation API enforces."""
    metadata = tuple(bearer("metered-key").items())
    with grpc.insecure_channel(quota_gateway.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        # Prompt + 48 fits the bucket of 100 once; a second right after it does not (the
        # bucket refills 100 a minute, and the first took its 66 in a few seconds).
        served = list(stub.ModelStreamInfer(iter([_kserve_generation("first", QUOTA_TOKENS)]), metadata=metadata, timeout=120))
        assert served and not any(r.error_message for r in served), served
        refused = list(stub.ModelStreamInfer(iter([_kserve_generation("second", QUOTA_TOKENS)]), metadata=metadata, timeout=120))
        assert [r.error_message.split(":")[0] for r in refused] == ["RESOURCE_EXHAUSTED"], refused[:3]
        assert "tokens_per_minute" in refused[0].error_message and refused[0].infer_response.id == "second"
        usage = admin_pb2_grpc.AdminServiceStub(channel).GetUsage(admin_pb2.GetUsageRequest(), metadata=metadata, timeout=30)
    assert usage.today.requests == 1, usage
    assert usage.today.completion_tokens == QUOTA_TOKENS, usage  # greedy counting runs its whole length
    assert usage.today.prompt_tokens > 0, usage


def _values(responses: list[service_pb2.ModelStreamInferResponse], name: str) -> list[bytes]:
    """The raw values of output `name` over a request's responses."""
    return [
        raw
        for response in responses
        for output, raw in zip(response.infer_response.outputs, response.infer_response.raw_output_contents)
        if output.name == name
    ]


def test_kserve_generations_are_charged_the_engine_s_own_counts(quota_gateway: GatewayThread) -> None:
    """Under `kserve_token_counts`, a ModelStreamInfer generation is charged the tokens its
    engine counted, not one per streamed response (which falls short where the engine
    merges deltas) nor max_tokens for a request not streamed (too many where it stops
    early); and its caller gets no output it did not ask for."""
    metadata = tuple(bearer("exact-key").items())
    with grpc.insecure_channel(quota_gateway.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        admin = admin_pb2_grpc.AdminServiceStub(channel)

        def usage() -> tuple[int, int]:
            today = admin.GetUsage(admin_pb2.GetUsageRequest(), metadata=metadata, timeout=30).today
            return today.prompt_tokens, today.completion_tokens

        def served(request: service_pb2.ModelInferRequest) -> tuple[list[service_pb2.ModelStreamInferResponse], tuple[int, int]]:
            """Its responses, and the usage it added."""
            before = usage()
            responses = list(stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=120))
            assert responses and not any(r.error_message for r in responses), responses[:3]
            after = usage()
            return responses, (after[0] - before[0], after[1] - before[1])

        for stream in (False, True):
            # The same greedy generation twice: the caller asks for the counts the second time.
            plain, charged = served(_kserve_generation("plain", 64, stream=stream, stop=" 9"))
            counted, charged_counted = served(_kserve_generation("counted", 64, True, stream=stream, stop=" 9", count_prompt=True))
            names = {o.name for r in plain for o in r.infer_response.outputs}
            assert names == {"text_output"}, names
            texts = [b"".join(v[4:] for v in _values(r, "text_output")) for r in (plain, counted)]
            assert texts[0] and texts[0] == texts[1], texts
            prompt, generated = (
                [int.from_bytes(v, "little") for v in _values(counted, name)] for name in ("num_input_tokens", "num_output_tokens")
            )
            engine = (prompt[-1], sum(generated))
            assert 0 < engine[1] < 64, engine  # the stop ended it early
            assert charged == engine == charged_counted, (stream, charged, engine, charged_counted)

