"""A KServe v2 load generator for the scenarios perf_analyzer cannot drive: several tenants
and classes at once, open-loop floods that are refused in part, streams timed per token.

It speaks gRPC through tritonclient's generated stubs on grpc.aio, the same way against
Triton and against the gateway; only the target and the metadata differ. `Target.generate`
calls the gateway's own qosgate.v1 GenerationService, where token quotas apply. Every request
ends as an `Outcome` (status code name, timings), never as an exception, because refusals
are what some scenarios measure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import struct
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from qosgate.v1 import generation_pb2, generation_pb2_grpc

# Request bodies are built once per caller; every send reuses the serialised message.
Tensor = service_pb2.ModelInferRequest.InferInputTensor


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who sends: a label, the gateway key and class, or the Triton priority when direct."""

    label: str
    api_key: str | None = None
    klass: str | None = None
    triton_priority: int = 0

    def metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = []
        if self.api_key:
            pairs.append(("authorization", f"Bearer {self.api_key}"))
        if self.klass:
            pairs.append(("x-priority", self.klass))
        return tuple(pairs)


@dataclasses.dataclass(slots=True)
class Outcome:
    """One request: when it started and ended (seconds on the run's clock) and how."""

    caller: str
    start: float
    end: float
    code: str
    token_times: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0  # prompt + completion tokens the gateway charged (qosgate.v1 Generate)
    prompt_tokens: int = 0  # of those, the prompt's

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    def inter_token(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def _bytes_tensor(name: str, value: bytes) -> tuple[Tensor, bytes]:
    return Tensor(name=name, datatype="BYTES", shape=[1]), struct.pack("<I", len(value)) + value


def _bool_tensor(name: str, value: bool) -> tuple[Tensor, bytes]:
    return Tensor(name=name, datatype="BOOL", shape=[1]), bytes([value])


def embedding_request(model: str, text: str, priority: int = 0) -> service_pb2.ModelInferRequest:
    """minilm-style: one text in `text`, BYTES [1, 1]."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    encoded = text.encode()
    request.raw_input_contents.append(struct.pack("<I", len(encoded)) + encoded)
    if priority:
        request.parameters["priority"].uint64_param = priority
    return request


def identity_request(model: str, width: int = 16, priority: int = 0) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, width])
    request.raw_input_contents.append(struct.pack(f"<{width}f", *range(width)))
    if priority:
        request.parameters["priority"].uint64_param = priority
    return request


def generation_request(model: str, prompt: str, max_tokens: int, priority: int = 0
                       ) -> service_pb2.ModelInferRequest:
    """The vLLM backend's streaming contract; ignore_eos makes every stream max_tokens long."""
    request = service_pb2.ModelInferRequest(model_name=model)
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    for tensor, raw in (
        _bytes_tensor("text_input", prompt.encode()),
        _bool_tensor("stream", True),
        _bytes_tensor("sampling_parameters", sampling.encode()),
        _bool_tensor("exclude_input_in_output", True),
    ):
        request.inputs.append(tensor)
        request.raw_input_contents.append(raw)
    # Ask Triton for an empty final response so the stream's end is explicit.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    if priority:  # Triton's priority, and the engine's, which our vLLM backend reads
        request.parameters["priority"].uint64_param = priority
        request.parameters["vllm_priority"].int64_param = priority
    return request


class Target:
    """One gRPC endpoint (Triton, nginx or the gateway) and a clock shared by the run."""

    def __init__(self, url: str, epoch: float | None = None) -> None:
        self.url = url
        self.epoch = time.monotonic() if epoch is None else epoch
        # Large windows: many concurrent streams share one HTTP/2 connection.
        self.channel = grpc.aio.insecure_channel(url, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.lookahead_bytes", 1 << 20)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def now(self) -> float:
        return time.monotonic() - self.epoch

    async def close(self) -> None:
        await self.channel.close()

    async def infer(self, caller: Caller, request: service_pb2.ModelInferRequest,
                    timeout: float) -> Outcome:
        start = self.now()
        try:
            await self.stub.ModelInfer(request, metadata=caller.metadata(), timeout=timeout)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        return Outcome(caller.label, start, self.now(), code)

    async def generate(self, caller: Caller, request: generation_pb2.GenerateRequest,
                       timeout: float) -> Outcome:
        """A unary qosgate.v1 Generate; the outcome carries the tokens the reply reports."""
        start = self.now()
        outcome = Outcome(caller.label, start, start, "OK")
        try:
            reply = await generation_pb2_grpc.GenerationServiceStub(self.channel).Generate(
                request, metadata=caller.metadata(), timeout=timeout)
            outcome.tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            outcome.code = exc.code().name
        outcome.end = self.now()
        return outcome

    async def generate_stream(self, caller: Caller, request: generation_pb2.GenerateStreamRequest,
                              timeout: float) -> Outcome:
        """A qosgate.v1 GenerateStream: a token time per text chunk, the usage at the end."""
        start = self.now()
        outcome = Outcome(caller.label, start, start, "OK")
        try:
            call = generation_pb2_grpc.GenerationServiceStub(self.channel).GenerateStream(
                request, metadata=caller.metadata(), timeout=timeout)
            async for reply in call:
                if reply.HasField("usage"):
                    outcome.prompt_tokens = reply.usage.prompt_tokens
                    outcome.tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
                elif reply.text:
                    outcome.token_times.append(self.now())
        except grpc.aio.AioRpcError as exc:
            outcome.code = exc.code().name
        outcome.end = self.now()
        return outcome

    async def stream(self, caller: Caller, request: service_pb2.ModelInferRequest,
                     timeout: float) -> Outcome:
        start = self.now()
        outcome = Outcome(caller.label, start, start, "OK")
        call = self.stub.ModelStreamInfer(metadata=caller.metadata(), timeout=timeout)
        try:
            await call.write(request)
            await call.done_writing()
            async for reply in call:
                if reply.error_message:
                    outcome.code = "STREAM_ERROR"
                    break
                response = reply.infer_response
                if response.raw_output_contents and len(response.raw_output_contents[0]) > 4:
                    outcome.token_times.append(self.now())
                if response.parameters["triton_final_response"].bool_param:
                    break
        except grpc.aio.AioRpcError as exc:
            outcome.code = exc.code().name
        finally:
            call.cancel()
        outcome.end = self.now()
        return outcome


class OpenAITarget:
    """The gateway's OpenAI-compatible HTTP API (`base_url` like http://host:port/v1), on
    the same run clock as the gRPC targets.

    The client is aiohttp's (its HTTP parser is compiled, as grpc's is): the bench's own
    client runs on the machine it measures, and what a pure-Python one (httpx) spends
    parsing 32 streams of SSE the engine lacks."""

    def __init__(self, base_url: str, epoch: float | None = None) -> None:
        self.base_url = base_url
        self.epoch = time.monotonic() if epoch is None else epoch
        # One pooled client: keep-alive connections, as an SDK would reuse them.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def now(self) -> float:
        return time.monotonic() - self.epoch

    async def close(self) -> None:
        await self.session.close()

    async def completion_stream(self, caller: Caller, body: dict[str, object], timeout: float) -> Outcome:
        """A streamed /v1/completions: a token time per text chunk, the usage at the end."""
        start = self.now()
        outcome = Outcome(caller.label, start, start, "OK")
        headers = dict(caller.metadata())
        try:
            async with self.session.post(f"{self.base_url}/completions", json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status != 200:
                    outcome.code = f"HTTP_{response.status}"
                else:
                    async for raw in response.content:
                        line = raw.decode().rstrip("\r\n")
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: "):])
                        if chunk.get("usage"):
                            outcome.prompt_tokens = chunk["usage"]["prompt_tokens"]
                            outcome.tokens = chunk["usage"]["total_tokens"]
                        elif "error" in chunk:
                            outcome.code = "STREAM_ERROR"
                        elif chunk["choices"] and chunk["choices"][0]["text"]:
                            outcome.token_times.append(self.now())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.code = type(exc).__name__
        outcome.end = self.now()
        return outcome


Send = Callable[[], Awaitable[Outcome]]


async def closed_loop(send: Send, concurrency: int, until: float, now: Callable[[], float],
                      retry_pause: float = 0.01, stagger: float = 0.0) -> list[Outcome]:
    """`concurrency` workers, each sending its next request when the previous one ends,
    or `retry_pause` seconds after it was refused; with `stagger`, their first requests
    spread evenly over that many seconds instead of all at once."""
    outcomes: list[Outcome] = []

    async def worker(delay: float) -> None:
        await asyncio.sleep(delay)
        while now() < until:
            outcome = await send()
            outcomes.append(outcome)
            if not outcome.ok:
                # By default a refused caller retries after a breath, as a client honouring
                # back-off would at minimum; 0 is a hostile caller's tight loop.
                await asyncio.sleep(retry_pause)

    await asyncio.gather(*(worker(i * stagger / concurrency) for i in range(concurrency)))
    return outcomes


async def open_loop(send: Send, rate: float, until: float, now: Callable[[], float],
                    seed: int = 0) -> list[Outcome]:
    """Poisson arrivals at `rate` per second until `until`, however the server keeps up."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Outcome]] = []
    next_at = now()
    while next_at < until:
        delay = next_at - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send()))
        next_at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def ok_between(outcomes: Sequence[Outcome], start: float, end: float) -> list[Outcome]:
    return [o for o in outcomes if o.ok and start <= o.end < end]
