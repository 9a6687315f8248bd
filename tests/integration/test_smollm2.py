"""smollm2 through tritonclient against a real tritonserver running our vllm backend.

Everything here talks to the session's LocalTriton (tests/conftest.py); run with
QOSGATE_TEST_MODELS=smollm2 to start only this model. The engine's own counters are read
from Triton's metrics endpoint (vllm_engine_*), so cancellation is checked where it
matters: in the engine, not in the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import psutil
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from conftest import free_port, kill_triton, require_model, wait_ready
from conftest import test_models as models_under_test
from qosgate import paths
from qosgate.launcher import LocalTriton, TritonPorts

pytestmark = pytest.mark.integration

MODEL = "smollm2"
# SmolLM2-Instruct's chat template, written out: the backend takes a raw prompt.
FRANCE = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0}
# Where the one-slot server's engine computes: vLLM, left to itself, binds to the first.
LAST_CPU = max(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def smollm2(triton: LocalTriton) -> LocalTriton:
    require_model(MODEL)
    return triton


@dataclasses.dataclass(slots=True)
class Chunk:
    """One response of a generation stream."""

    text: str
    final: bool
    finish_reason: str | None
    num_output_tokens: int | None
    num_input_tokens: int | None


def _tensor(name: str, datatype: str, value: object) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=triton_to_np_dtype(datatype)))
    return tensor


def generation_inputs(
    prompt: str, *, stream: bool, sampling: dict | None = None
) -> list[grpcclient.InferInput]:
    inputs = [
        _tensor("text_input", "BYTES", prompt.encode()),
        _tensor("stream", "BOOL", stream),
        _tensor("exclude_input_in_output", "BOOL", True),
        _tensor("return_finish_reason", "BOOL", True),
        _tensor("return_num_input_tokens", "BOOL", True),
        _tensor("return_num_output_tokens", "BOOL", True),
    ]
    if sampling is not None:
        inputs.append(_tensor("sampling_parameters", "BYTES", json.dumps(sampling).encode()))
    return inputs


def _chunk(result: grpcclient.InferResult) -> Chunk:
    def first(name: str) -> object | None:
        values = result.as_numpy(name)
        return None if values is None or values.size == 0 else values.reshape(-1)[0]

    text = first("text_output")
    reason = first("finish_reason")
    out_tokens = first("num_output_tokens")
    in_tokens = first("num_input_tokens")
    return Chunk(
        text=text.decode() if isinstance(text, bytes) else "",
        final=result.get_response().parameters["triton_final_response"].bool_param,
        finish_reason=reason.decode() or None if isinstance(reason, bytes) else None,
        num_output_tokens=int(out_tokens) if out_tokens is not None else None,
        num_input_tokens=int(in_tokens) if in_tokens is not None else None,
    )


class StreamCall:
    """One gRPC bidi stream carrying one request; iterate its chunks, or cancel it."""

    def __init__(
        self, client: grpcclient.InferenceServerClient, inputs: list, parameters: dict | None = None
    ) -> None:
        self._done = asyncio.Event()
        self._responses = client.stream_infer(
            self._requests(inputs, parameters), stream_timeout=300
        )

    async def _requests(self, inputs: list, parameters: dict | None) -> AsyncIterator[dict]:
        yield {
            "model_name": MODEL,
            "inputs": inputs,
            "parameters": parameters,
            "enable_empty_final_response": True,
        }
        # Keep our half of the stream open until the final response arrived.
        await self._done.wait()

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            async for result, error in self._responses:
                if error is not None:
                    raise error
                chunk = _chunk(result)
                yield chunk
                if chunk.final:
                    return
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._done.set()
        self._responses.cancel()


async def generate(inputs: list, parameters: dict | None = None, *, url: str) -> list[Chunk]:
    async with grpcclient.InferenceServerClient(url) as client:
        return [chunk async for chunk in StreamCall(client, inputs, parameters).chunks()]


def engine_metrics(triton: LocalTriton) -> dict[str, float]:
    """vllm_engine_* samples from Triton's metrics endpoint, keyed by name{labels}."""
    url = f"http://127.0.0.1:{triton.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(vllm_engine_\w+)\{([^}]*)\}\s+(\S+)$", line)
        if match and f'model="{MODEL}"' in match.group(2):
            reason = re.search(r'reason="(\w+)"', match.group(2))
            key = match.group(1) + (f"[{reason.group(1)}]" if reason else "")
            samples[key] = float(match.group(3))
    return samples


def test_dtype_auto_is_bfloat16_only_on_a_cpu_that_computes_in_it(smollm2: LocalTriton) -> None:
    # model.json says "auto"; an AVX2-only CPU emulates bfloat16 (6 x slower at 64 sequences).
    flags = next(line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")).split()
    expected = "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"
    ready = re.search(r"vllm backend: \S+ ready \(dtype=torch\.(\w+)", smollm2.log_path.read_text(errors="replace"))
    assert ready is not None, "the backend's ready line names no dtype"
    assert ready.group(1) == expected


async def test_greedy_answer_mentions_paris(smollm2: LocalTriton) -> None:
    chunks = await generate(
        generation_inputs(FRANCE, stream=False, sampling={**GREEDY, "max_tokens": 32}),
        url=smollm2.ports.grpc_url,
    )
    assert len(chunks) == 1 and chunks[0].final
    assert "Paris" in chunks[0].text, chunks[0].text
    assert chunks[0].finish_reason in {"stop", "length"}
    assert chunks[0].num_input_tokens and chunks[0].num_input_tokens > 5


async def test_prompt_is_repeated_unless_excluded(smollm2: LocalTriton) -> None:
    inputs = generation_inputs(FRANCE, stream=False, sampling={**GREEDY, "max_tokens": 4})
    inputs = [i for i in inputs if i.name() != "exclude_input_in_output"]
    (chunk,) = await generate(inputs, url=smollm2.ports.grpc_url)
    assert chunk.text.startswith(FRANCE) and len(chunk.text) > len(FRANCE)


async def test_stream_yields_deltas_then_final_and_counts_tokens(smollm2: LocalTriton) -> None:
    sampling = {**GREEDY, "max_tokens": 24, "ignore_eos": True}
    url = smollm2.ports.grpc_url
    streamed = await generate(generation_inputs(FRANCE, stream=True, sampling=sampling), url=url)
    (whole,) = await generate(generation_inputs(FRANCE, stream=False, sampling=sampling), url=url)

    assert len(streamed) >= 5, "streaming must deliver several chunks"
    assert [c.final for c in streamed] == [False] * (len(streamed) - 1) + [True]
    assert sum(1 for c in streamed if c.text) >= 5
    assert streamed[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in streamed[:-1])
    # Each response counts the tokens of its delta; together: every token generated.
    assert sum(c.num_output_tokens or 0 for c in streamed) == 24 == whole.num_output_tokens
    assert "".join(c.text for c in streamed) == whole.text


async def test_prefix_cache_lookups_and_hits_are_counted(smollm2: LocalTriton) -> None:
    queries, hits = "vllm_engine_prefix_cache_queries_total", "vllm_engine_prefix_cache_hits_total"
    # About 400 tokens, new to this engine: the first call computes them all, the second
    # finds at least its first full blocks (128 tokens each on CPUs) cached.
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 40
    before = engine_metrics(smollm2)
    for _ in range(2):
        await generate(
            generation_inputs(prompt, stream=False, sampling={**GREEDY, "max_tokens": 1}),
            url=smollm2.ports.grpc_url,
        )
    # The engine reports a step's counters just after that step's outputs: poll.
    deadline = time.monotonic() + 10
    while (after := engine_metrics(smollm2))[hits] - before[hits] < 256:
        assert time.monotonic() < deadline, f"no prefix cache hits counted: {before} -> {after}"
        await asyncio.sleep(0.1)
    assert after[queries] - before[queries] >= 2 * 300


async def test_cancelled_stream_is_aborted_in_the_engine(smollm2: LocalTriton) -> None:
    budget = 1500  # about a minute of decoding here, if nothing stopped it
    tokens, running = "vllm_engine_generation_tokens_total", "vllm_engine_requests_running"
    before = engine_metrics(smollm2)
    async with grpcclient.InferenceServerClient(smollm2.ports.grpc_url) as client:
        call = StreamCall(
            client,
            generation_inputs(
                FRANCE, stream=True, sampling={"max_tokens": budget, "ignore_eos": True}
            ),
        )
        received = 0
        with pytest.raises(asyncio.CancelledError):
            async for _ in call.chunks():
                received += 1
                if received == 3:
                    # The engine reports the request in its running batch...
                    assert engine_metrics(smollm2)[running] == 1
                    call.cancel()
    assert received == 3

    # ...and, once the backend saw the cancellation and aborted it, no longer.
    deadline = time.monotonic() + 15
    while (after := engine_metrics(smollm2))[running] != 0:
        assert time.monotonic() < deadline, f"the engine still runs the cancelled request: {after}"
        await asyncio.sleep(0.1)
    # Stopped for good: no decode steps for it any more.
    await asyncio.sleep(1.0)
    settled = engine_metrics(smollm2)
    assert settled[tokens] == after[tokens]
    assert settled[tokens] - before.get(tokens, 0) < budget / 10


async def test_32_concurrent_streams_all_complete(smollm2: LocalTriton) -> None:
    sampling = {"max_tokens": 32, "ignore_eos": True, "temperature": 0.8, "seed": 1}
    questions = [
        f"<|im_start|>user\nCount to {n}.<|im_end|>\n<|im_start|>assistant\n" for n in range(32)
    ]
    started = time.monotonic()
    results = await asyncio.gather(
        *(
            generate(
                generation_inputs(q, stream=True, sampling=sampling), url=smollm2.ports.grpc_url
            )
            for q in questions
        )
    )
    elapsed = time.monotonic() - started
    for chunks in results:
        assert chunks[-1].final and chunks[-1].finish_reason == "length"
        assert sum(c.num_output_tokens or 0 for c in chunks) == 32
    print(f"32 streams x 32 tokens in {elapsed:.1f}s")


def _prompt_with_sampling(raw: bytes) -> Callable[[], list[grpcclient.InferInput]]:
    return lambda: [
        _tensor("text_input", "BYTES", b"hi"),
        _tensor("sampling_parameters", "BYTES", raw),
    ]


MALFORMED = {
    "wrong dtype": (
        lambda: [_tensor("text_input", "INT32", 7)],
        r"text_input.*(data ?type|datatype|INT32)",
    ),
    "missing text_input": (
        lambda: [_tensor("stream", "BOOL", False)],
        r"text_input",
    ),
    "bad sampling JSON": (
        _prompt_with_sampling(b"{max_tokens: 4"),
        r"sampling_parameters is not valid JSON",
    ),
    "unknown sampling key": (
        _prompt_with_sampling(b'{"max_tokenz": 4}'),
        r"unknown sampling parameter\(s\) max_tokenz",
    ),
    "max_tokens beyond the model length": (
        _prompt_with_sampling(b'{"max_tokens": 100000}'),
        r"max_tokens=100000 exceeds the model's maximum length max_model_len=2048",
    ),
    "invalid sampling value": (
        _prompt_with_sampling(b'{"temperature": -1}'),
        r"temperature must be non-negative",
    ),
    "non-integer priority": (
        lambda: [_tensor("text_input", "BYTES", b"hi")],
        r"vllm_priority must be an integer",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_is_refused_and_model_keeps_serving(
    smollm2: LocalTriton, case: str
) -> None:
    make_inputs, message = MALFORMED[case]
    parameters = {"vllm_priority": "high"} if case == "non-integer priority" else None
    with pytest.raises(InferenceServerException) as refused:
        await generate(make_inputs(), parameters, url=smollm2.ports.grpc_url)
    assert re.search(message, refused.value.message()), refused.value.message()

    chunks = await generate(
        generation_inputs(FRANCE, stream=False, sampling={**GREEDY, "max_tokens": 2}),
        url=smollm2.ports.grpc_url,
    )
    assert chunks[-1].final and chunks[-1].num_output_tokens == 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text_input": "hi", "sampling_parameters": "{oops"}, "not valid JSON"),
        ({"text_input": "hi", "sampling_parameters": '{"max_tokens": 100000}'}, "exceeds"),
        ({"stream": False}, "text_input"),
    ],
)
def test_refusals_are_invalid_argument_class(
    smollm2: LocalTriton, body: dict, message: str
) -> None:
    # gRPC stream errors carry only a message; Triton's HTTP generate endpoint shows
    # the class: INVALID_ARG becomes 400 (INTERNAL would be 500).
    url = f"http://127.0.0.1:{smollm2.ports.http}/v2/models/{MODEL}/generate"
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert message in refused.value.read().decode()


@pytest.fixture(scope="module", autouse=True)
def one_slot_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTriton | None]:
    """smollm2 with room for a single running sequence, so that requests queue in the
    engine's scheduler and the order it picks them in becomes visible; on LAST_CPU.
    Started with the module's first test, so that its start-up (half a minute, mostly
    vLLM's) runs beside the tests on the session's server instead of before the first test
    on this one, and only if a selected test uses it. The module's last test stops it the
    polite way; killed here only if a test failed first."""
    wanted = any(
        item.module is request.module and "one_slot_smollm2" in getattr(item, "fixturenames", ())
        for item in request.session.items
    )
    if not wanted or MODEL not in models_under_test():
        yield None
        return
    repo = tmp_path_factory.mktemp("one-slot-repo")
    source = paths.model_repository() / MODEL
    (repo / MODEL / "1").mkdir(parents=True)
    shutil.copy(source / "config.pbtxt", repo / MODEL / "config.pbtxt")
    engine = json.loads((source / "1" / "model.json").read_text())
    (repo / MODEL / "1" / "model.json").write_text(json.dumps({**engine, "max_num_seqs": 1}))
    server = LocalTriton(
        models=[MODEL],
        ports=TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port()),
        model_repository=repo,
        log_path=repo / "tritonserver.log",
        cpus=[LAST_CPU],
    )
    server.start()
    try:
        yield server
    finally:
        kill_triton(server)


@pytest.fixture
def one_slot_smollm2(one_slot_server: LocalTriton | None) -> LocalTriton:
    require_model(MODEL)
    assert one_slot_server is not None
    wait_ready(one_slot_server)
    return one_slot_server


async def test_priority_reaches_the_engine_scheduler(one_slot_smollm2: LocalTriton) -> None:
    # One stream, requests in this order: a blocker takes the only slot, three
    # low-priority requests queue, then one high-priority request. First come, first
    # served would finish the urgent one last; vLLM's priority policy runs it next.
    def request(request_id: str, priority: int, max_tokens: int) -> dict:
        sampling = {**GREEDY, "max_tokens": max_tokens, "ignore_eos": True}
        return {
            "model_name": MODEL,
            "inputs": generation_inputs(FRANCE, stream=True, sampling=sampling),
            "request_id": request_id,
            "parameters": {"vllm_priority": priority},
            "enable_empty_final_response": True,
        }

    blocker = request("blocker", 5, 24)
    queued = [request(f"low-{n}", 5, 4) for n in range(3)] + [request("urgent", 1, 4)]
    blocker_running, all_final = asyncio.Event(), asyncio.Event()

    async def requests() -> AsyncIterator[dict]:
        yield blocker
        # Only once it holds the slot: otherwise a low request could take it first.
        await blocker_running.wait()
        for item in queued:
            yield item
        await all_final.wait()

    finished: list[str] = []
    async with grpcclient.InferenceServerClient(one_slot_smollm2.ports.grpc_url) as client:
        async for result, error in client.stream_infer(requests(), stream_timeout=120):
            assert error is None, error
            response = result.get_response()
            blocker_running.set()
            if response.parameters["triton_final_response"].bool_param:
                finished.append(response.id)
                if len(finished) == 1 + len(queued):
                    all_final.set()
                    break
    assert finished[:2] == ["blocker", "urgent"], finished


def _process_tree(root_pid: int) -> list[psutil.Process]:
    """The server, its descendants and anything else in its process group."""
    root = psutil.Process(root_pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == root_pid:
                found.setdefault(proc.pid, proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return list(found.values())


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_leaves_no_process_behind(one_slot_smollm2: LocalTriton) -> None:
    """LocalTriton.stop (what `qosgate up` and `make run` do on Ctrl-C) on a vLLM server:
    last in this module, it ends the one-slot server."""
    server = one_slot_smollm2
    assert server.pid is not None
    tree = _process_tree(server.pid)
    names = [_describe(p) for p in tree]
    # vLLM's engine runs in processes of its own: the ones that used to outlive
    # a killed tritonserver.
    assert any("EngineCore" in name for name in names), names
    assert any("triton_python_backend_stub" in name for name in names), names
    # Its worker computes on the CPUs given, and on no other.
    workers = [p for p in tree if "VLLM::Worker" in p.name()]
    assert workers and all(set(p.cpu_affinity()) == {LAST_CPU} for p in workers), names
    server.stop()
    # multiprocessing's resource tracker ignores SIGTERM and leaves when its parent's pipe
    # closes: give such helpers a bounded moment to see their parents gone.
    deadline = time.monotonic() + 10
    while (leftovers := [_describe(p) for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers == []
    # ... and the polite way: the model unloaded within Triton's exit timeout, rather than
    # a stub killed mid-shutdown (it used to segfault on every stop).
    log = server.log_path.read_text(errors="replace")
    assert f"successfully unloaded '{MODEL}'" in log, server.log_tail()
    assert "Exit timeout expired" not in log and "Segfault" not in log, server.log_tail()
