"""GenerationPlane with an in-process fake Triton: accounting on every way a call can end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import struct
from collections.abc import AsyncGenerator, Sequence

import pytest
from tritonclient.grpc import service_pb2

from qosgate.config import parse_config
from qosgate.dataplane.call import Call, Header
from qosgate.dataplane.generation import Finished, GenerationCall, GenerationPlane
from qosgate.dataplane.plane import DataPlane
from qosgate.errors import InvalidArgument, PermissionDenied, QuotaExceeded
from qosgate.generation_types import ChatMessage, FinishReason, Role
from qosgate.scheduler import Scheduler
from qosgate.upstream.pool import Route
from qosgate.upstream.routing import affinity_key
from qosgate.usage import UsageLedger, UsageMeter, UsageRecord
from tests.fakes import FakeClock, make_dataplane, make_edge

DAY0 = 1_767_225_600.0
RPC = "Generate"


def _response(text: str, tokens: int, *, final: bool = False, reason: str = "") -> service_pb2.ModelInferResponse:
    """A vLLM-contract response as Triton sends it."""
    response = service_pb2.ModelInferResponse()
    for name, datatype, raw in (
        ("text_output", "BYTES", struct.pack("<I", len(text.encode())) + text.encode()),
        ("num_input_tokens", "UINT32", struct.pack("<I", 7)),
        ("num_output_tokens", "UINT32", struct.pack("<I", tokens)),
        ("finish_reason", "BYTES", struct.pack("<I", len(reason)) + reason.encode()),
    ):
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(raw)
    if final:
        response.parameters["triton_final_response"].bool_param = True
    return response


class FakeEngine:
    """Plays a list of responses; `hold` pauses before the last one until released."""

    def __init__(self, responses: list[service_pb2.ModelInferResponse], *, fail_first: Exception | None = None) -> None:
        self.responses = responses
        self.fail_first = fail_first
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.keys: list[bytes | None] = []  # the route's affinity key, per request
        self.closed = 0
        self.hold = asyncio.Event()
        self.hold.set()

    async def stream(
        self, route: Route, request: bytes, *, headers: Sequence[Header] = (), timeout_s: float | None = None
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        self.requests.append(service_pb2.ModelInferRequest.FromString(request))
        self.keys.append(route.key)
        try:
            if self.fail_first is not None:
                failure, self.fail_first = self.fail_first, None
                raise failure
            for i, response in enumerate(self.responses):
                if i == len(self.responses) - 1:
                    await self.hold.wait()
                route.responded()
                yield response
        finally:
            route.done()
            self.closed += 1


STORY = [_response("Once", 1), _response(" upon", 1), _response(" a time", 2, final=True, reason="length")]


def _plane(
    engine: FakeEngine, ledger: UsageLedger | None = None, **limits: int
) -> tuple[GenerationPlane, UsageLedger, Scheduler, DataPlane]:
    config = parse_config(
        {
            "models": {
                "smollm2": {
                    "dispatch_window": 1,
                    "default_max_tokens": 4,
                    "default_temperature": 0.0,
                    "routing": {"policy": "prefix_affinity", "session_header": "X-Session-Id"},
                }
            },
            "tenants": [
                {
                    "name": "acme",
                    "api_keys": [{"key": "k-acme"}],
                    "models": ["smollm2"],
                    "max_class": "critical",
                    "limits": {"max_concurrent": 1, **limits},
                }
            ],
        }
    )
    ledger = ledger or UsageLedger(":memory:", wall_time=lambda: DAY0 + 3600)
    usage = UsageMeter(ledger, wall_time=lambda: DAY0 + 3600)
    dataplane = make_dataplane(config, FakeClock(), usage=usage, wall=DAY0 + 3600)
    plane = GenerationPlane(config=config, edge=make_edge(config, dataplane), engine=engine, clock=dataplane.clock)
    return plane, ledger, dataplane.scheduler, dataplane


def _call(*headers: Header, priority_class: str | None = None) -> Call:
    """A call of the test tenant, with its key, as a front end decodes it."""
    return Call(RPC, [(b"authorization", b"Bearer k-acme"), *headers], priority_class=priority_class)


async def _collect(plane: GenerationPlane, generation: GenerationCall, call: Call | None = None) -> list[str | Finished]:
    async with contextlib.aclosing(plane.generate(call or _call(), generation)) as items:
        return [item async for item in items]


async def test_stream_yields_deltas_then_usage_and_records_it() -> None:
    engine = FakeEngine(STORY)
    plane, ledger, scheduler, _ = _plane(engine)
    items = await _collect(plane, GenerationCall(model="smollm2", prompt="Tell me"), _call(priority_class="critical"))
    assert items[:-1] == ["Once", " upon", " a time"]
    finished = items[-1]
    assert isinstance(finished, Finished)
    assert finished.finish_reason is FinishReason.LENGTH
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (7, 4)
    day = ledger.day_summary("acme", "2026-01-01")
    assert (day.requests, day.prompt_tokens, day.completion_tokens) == (1, 7, 4)
    # Dispatched at the class's level, for Triton and for the engine's own scheduler.
    sent = engine.requests[0]
    assert sent.parameters["priority"].uint64_param == 1
    assert sent.parameters["vllm_priority"].int64_param == 1
    # The model's defaults fill what the call left unset.
    assert json.loads(sent.raw_input_contents[2][4:]) == {"max_tokens": 4, "temperature": 0.0}
    assert scheduler.snapshot().in_flight.get("smollm2", 0) == 0
    # The permit was released: max_concurrent=1 admits the next call.
    assert len(await _collect(plane, GenerationCall(model="smollm2", prompt="Again"))) == 4


async def test_chat_is_rendered_with_the_template() -> None:
    engine = FakeEngine(STORY)
    plane, _, _, _ = _plane(engine)
    await _collect(plane, GenerationCall(model="smollm2", messages=(ChatMessage(Role.USER, "Hi"),)))
    text_input = engine.requests[0].raw_input_contents[0][4:].decode()
    assert text_input == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


async def test_the_route_hint_is_the_rendered_prompt_and_the_session_header() -> None:
    engine = FakeEngine(STORY)
    plane, _, _, _ = _plane(engine)
    system = ChatMessage(Role.SYSTEM, "You answer for acme.")
    call = GenerationCall(model="smollm2", messages=(system, ChatMessage(Role.USER, "Hi")))
    await _collect(plane, call, _call((b"x-session-id", b"s-7")))
    await _collect(plane, call)
    rendered = "<|im_start|>system\nYou answer for acme.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    prompt = engine.requests[1].raw_input_contents[0][4:].decode()
    assert prompt.startswith(rendered)
    assert engine.keys == [affinity_key("", 1024, "s-7"), affinity_key(prompt, 1024)]  # prefix_bytes: its default


async def test_a_caller_that_goes_away_frees_everything_and_pays_what_it_saw() -> None:
    engine = FakeEngine(STORY)
    engine.hold.clear()  # the engine is still generating when the caller leaves
    plane, ledger, scheduler, _ = _plane(engine)
    items = plane.generate(_call(), GenerationCall(model="smollm2", prompt="Tell me"))
    assert await anext(items) == "Once"
    assert await anext(items) == " upon"
    assert scheduler.snapshot().in_flight["smollm2"] == 1
    await items.aclose()  # what grpc's cancellation of the servicer leads to
    assert engine.closed == 1, "the upstream stream must be closed (cancelled)"
    assert scheduler.snapshot().in_flight.get("smollm2", 0) == 0
    day = ledger.day_summary("acme", "2026-01-01")
    assert (day.requests, day.completion_tokens) == (1, 2)
    engine.hold.set()
    assert len(await _collect(plane, GenerationCall(model="smollm2", prompt="Again"))) == 4


async def test_engine_failure_before_any_output_costs_nothing() -> None:
    engine = FakeEngine(STORY, fail_first=InvalidArgument("model 'smollm2': prompt too long"))
    plane, ledger, _, _ = _plane(engine, tokens_per_minute=100)
    with pytest.raises(InvalidArgument, match="too long"):
        await _collect(plane, GenerationCall(model="smollm2", prompt="x", max_tokens=90))
    assert ledger.day_summary("acme", "2026-01-01").requests == 0
    # Nothing was charged: the whole bucket is there for the next call.
    assert isinstance((await _collect(plane, GenerationCall(model="smollm2", prompt="x", max_tokens=90)))[-1], Finished)


@pytest.mark.parametrize(
    ("triton_says", "reworded"),
    [
        ("[request id: <id_unknown>] expected 1 inputs but got 7 inputs for model 'minilm'", True),
        ("unexpected inference input 'text_input' for model 'minilm'", True),
        ("prompt too long", False),
    ],
)
async def test_inputs_a_model_does_not_take_say_it_is_no_generation_model(triton_says: str, reworded: bool) -> None:
    engine = FakeEngine(STORY, fail_first=InvalidArgument(f"model 'smollm2': {triton_says}"))
    plane, _, _, _ = _plane(engine)
    with pytest.raises(InvalidArgument) as refused:
        await _collect(plane, GenerationCall(model="smollm2", prompt="x"))
    said = refused.value.message
    assert said.endswith(triton_says)
    assert ("model 'smollm2' is not a generation model" in said) is reworded, said
    assert ("'vllm' adapter" in said) is reworded, said


async def test_daily_budget_refuses_before_dispatch() -> None:
    engine = FakeEngine(STORY)
    plane, _, _, _ = _plane(engine, daily_token_budget=20)
    await _collect(plane, GenerationCall(model="smollm2", prompt="Tell me"))  # 11 tokens used
    with pytest.raises(QuotaExceeded) as refused:
        await _collect(plane, GenerationCall(model="smollm2", prompt="Tell me", max_tokens=8))
    assert "daily_token_budget 20 has 9 tokens left" in refused.value.violations[0].description
    assert refused.value.retry_after_s > 0
    assert len(engine.requests) == 1


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (GenerationCall(model="smollm2"), InvalidArgument, "prompt"),
        (GenerationCall(model="smollm2", prompt="x", max_tokens=0), InvalidArgument, "max_tokens"),
        (GenerationCall(model="smollm2", prompt="x", temperature=-1), InvalidArgument, "temperature"),
        (GenerationCall(model="smollm2", prompt="x", temperature=float("nan")), InvalidArgument, "temperature"),
        (GenerationCall(model="smollm2", prompt="x", temperature=float("inf")), InvalidArgument, "temperature"),
        (GenerationCall(model="smollm2", prompt="x", top_p=float("nan")), InvalidArgument, "top_p"),
        (GenerationCall(model="smollm2", prompt="x", top_p=1.5), InvalidArgument, "top_p"),
        (GenerationCall(model="smollm2", prompt="x", stop=("",)), InvalidArgument, "stop"),
        (GenerationCall(model="smollm2", prompt="x", stop=("a",) * 17), InvalidArgument, "at most 16"),
        (GenerationCall(model="minilm", prompt="x"), PermissionDenied, "minilm"),
    ],
)
async def test_bad_calls_are_refused_before_admission(call: GenerationCall, error: type[Exception], words: str) -> None:
    engine = FakeEngine(STORY)
    plane, _, _, _ = _plane(engine)
    with pytest.raises(error, match=words):
        await _collect(plane, call)
    assert not engine.requests
    assert len(await _collect(plane, GenerationCall(model="smollm2", prompt="fine"))) == 4


class FailingOnceLedger(UsageLedger):
    """A ledger whose first write fails, as a full disk would make it."""

    failed = False

    def record(self, record: UsageRecord) -> None:
        if not self.failed:
            self.failed = True
            raise sqlite3.OperationalError("database or disk is full")
        super().record(record)


async def test_a_ledger_failure_still_frees_the_slot_and_the_permit() -> None:
    engine = FakeEngine(STORY)
    plane, ledger, scheduler, _ = _plane(engine, FailingOnceLedger(":memory:", wall_time=lambda: DAY0))
    with pytest.raises(sqlite3.OperationalError):
        await _collect(plane, GenerationCall(model="smollm2", prompt="Tell me"))
    assert scheduler.snapshot().in_flight.get("smollm2", 0) == 0
    # max_concurrent=1: only a released permit lets this one in.
    assert len(await _collect(plane, GenerationCall(model="smollm2", prompt="Again"))) == 4
    assert ledger.day_summary("acme", "2026-01-01").requests == 1


async def test_a_caller_that_closes_after_the_result_was_served_not_cancelled() -> None:
    plane, _, _, dataplane = _plane(FakeEngine(STORY))
    async with contextlib.aclosing(plane.generate(_call(), GenerationCall(model="smollm2", prompt="Hi"))) as items:
        async for item in items:
            if isinstance(item, Finished):
                break  # as a unary response does: the generator is closed at its last yield
    registry = dataplane.metrics.registry
    labels = {"rpc": RPC, "model": "smollm2", "tenant": "acme", "class": "standard"}
    assert registry.get_sample_value("qosgate_requests_total", {**labels, "code": "OK"}) == 1
    assert registry.get_sample_value("qosgate_requests_total", {**labels, "code": "CANCELLED"}) is None
