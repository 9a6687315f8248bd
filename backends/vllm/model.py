"""qosgate's Python-based Triton backend `vllm`: a decoupled model on vLLM's AsyncLLM.

A model folder selects it with `backend: "vllm"` and puts the engine arguments in
`<version>/model.json`, exactly like NVIDIA's vLLM backend, so the same folder runs on
the `tritonserver:<yy.mm>-vllm-python-py3` image. The tensor contract is the vLLM
backend's (inputs text_input, stream, sampling_parameters, exclude_input_in_output,
return_finish_reason, return_num_input_tokens, return_num_output_tokens; outputs
text_output, finish_reason, num_input_tokens, num_output_tokens). Two additions:

- priority: Triton's python backend (2.51) does not expose a request's `priority` to
  Python, and Triton's frontends consume the `priority` request parameter themselves.
  So the priority travels as the request parameter `vllm_priority` (an integer, smaller
  runs first, default 0) and reaches vLLM's priority scheduler (model.json
  `"scheduling_policy": "priority"`).
- cancellation: a request whose client went away (response_sender.is_cancelled()) is
  aborted in the engine, so it stops consuming decode steps.

The engine's own scheduler counters are exported as Triton custom metrics
(`vllm_engine_*` on Triton's metrics port): what the engine really ran, not what this
backend believes it asked for.

Runs inside Triton's python stub; it has no imports from qosgate.
"""

from __future__ import annotations

# torch and vLLM read text files with the locale's encoding; the stub may start with
# an ASCII locale. This must precede their import.
import locale

locale.setlocale(locale.LC_ALL, "C.UTF-8")

import asyncio
import dataclasses
import functools
import gc
import json
import os
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import triton_python_backend_utils as pb_utils

# vLLM is imported where it is used, not here: Triton imports model.py once more in a
# short-lived stub for its auto-complete pass, and importing vLLM costs 7-15 s on 2 cores.
if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

PRIORITY_PARAMETER = "vllm_priority"
# How often queued or running requests are checked for client cancellation: a
# cancelled request costs at most this much engine time before it is aborted.
CANCEL_POLL_S = 0.1
# How long the engine-core process gets to exit at unload before vLLM kills it and its
# worker. It has nothing left to finish by then (every request was aborted), but its
# teardown (the worker's, a full garbage collection, interpreter exit) took 4-5 s on 2
# cores, past the exit timeout `qosgate up` gives Triton (5 s), which then killed this
# stub mid-shutdown (a segfault on every stop). Killed, they leave no shared memory.
ENGINE_EXIT_S = 1.0
# Keys a client may not set: the backend owns how outputs are delivered, and one
# request yields one completion (send n requests for n completions).
RESERVED_SAMPLING_KEYS = frozenset({"output_kind", "skip_clone", "n"})
FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


class InvalidRequest(ValueError):
    """A request the client must fix; answered with INVALID_ARG, the model keeps serving."""


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One Triton request, validated and translated for the engine."""

    prompt: str
    sampling: SamplingParams
    priority: int
    stream: bool
    exclude_input_in_output: bool
    return_finish_reason: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool


def _single_input(request: Any, name: str) -> Any | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"input '{name}' must hold exactly one element, got {values.size}")
    return values[0]


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"input '{name}' is not valid UTF-8: {exc}") from None
    return str(value)


@functools.cache
def allowed_sampling_keys() -> frozenset[str]:
    from vllm.sampling_params import SamplingParams

    public = (name for name in SamplingParams.__struct_fields__ if not name.startswith("_"))
    return frozenset(public) - RESERVED_SAMPLING_KEYS


def _sampling_params(raw: str | None, stream: bool, max_model_len: int) -> SamplingParams:
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    settings: dict[str, Any] = {}
    if raw:
        try:
            settings = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
    allowed = allowed_sampling_keys()
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise InvalidRequest(
            f"unknown sampling parameter(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    settings["output_kind"] = kind.value  # msgspec converts from the plain value
    try:
        # strict=False accepts numbers and booleans sent as JSON strings, as the
        # official backend's clients do ({"max_tokens": "64"}).
        params = msgspec.convert(settings, SamplingParams, strict=False)
    except (msgspec.ValidationError, VLLMClientError, ValueError) as exc:
        raise InvalidRequest(f"invalid sampling_parameters: {exc}") from None
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"max_tokens={params.max_tokens} exceeds the model's maximum length "
            f"max_model_len={max_model_len}"
        )
    return params


def _priority(request: Any) -> int:
    try:
        parameters = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        parameters = {}
    value = parameters.get(PRIORITY_PARAMETER, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidRequest(
            f"request parameter {PRIORITY_PARAMETER} must be an integer, got {value!r}"
        ) from None


def parse_request(request: Any, max_model_len: int) -> GenerationRequest:
    """Validate one Triton request; raises InvalidRequest with a message for the client."""
    prompt = _single_input(request, "text_input")
    if prompt is None:
        raise InvalidRequest("input 'text_input' is required")
    flags = {}
    for name in FLAG_INPUTS:
        value = _single_input(request, name)
        flags[name] = bool(value) if value is not None else False
    raw_sampling = _single_input(request, "sampling_parameters")
    return GenerationRequest(
        prompt=_text(prompt, "text_input"),
        sampling=_sampling_params(
            _text(raw_sampling, "sampling_parameters") if raw_sampling is not None else None,
            flags["stream"],
            max_model_len,
        ),
        priority=_priority(request),
        **flags,
    )


def _error_response(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class EngineMetrics:
    """Publishes the engine's scheduler counters as Triton custom metrics.

    vLLM calls record() on its output-handling task with the stats the EngineCore
    process reports after each step: running/waiting requests, KV-cache use, generated
    tokens and finished requests by reason. It is a vLLM StatLoggerBase by shape, not by
    inheritance, so that this module imports vLLM lazily.
    """

    def __init__(self, families: TritonEngineMetricFamilies) -> None:
        self._families = families

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        families = self._families
        if scheduler_stats is not None:
            families.running.set(scheduler_stats.num_running_reqs)
            families.waiting.set(scheduler_stats.num_waiting_reqs)
            families.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            # Counted when the scheduler first looks a request up in the cache; a
            # preempted request's second lookup is left out, as vLLM's own metric does.
            cache = scheduler_stats.prefix_cache_stats
            if cache.queries:
                families.prefix_cache_queries.increment(cache.queries)
                families.prefix_cache_hits.increment(cache.hits)
        if iteration_stats is not None:
            if iteration_stats.num_generation_tokens:
                families.generation_tokens.increment(iteration_stats.num_generation_tokens)
            for finished in iteration_stats.finished_requests:
                families.finished(str(finished.finish_reason)).increment(1)
                families.queued_seconds.increment(finished.queued_time)
                families.prefill_seconds.increment(finished.prefill_time)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


class TritonEngineMetricFamilies:
    """The Triton metric objects EngineMetrics writes to, labelled with the model name."""

    def __init__(self, model_name: str, model_version: str) -> None:
        self._labels = {"model": model_name, "version": model_version}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._running_family = pb_utils.MetricFamily(
            "vllm_engine_requests_running", "Requests in the engine's running batch", gauge
        )
        self._waiting_family = pb_utils.MetricFamily(
            "vllm_engine_requests_waiting", "Requests queued in the engine's scheduler", gauge
        )
        self._kv_family = pb_utils.MetricFamily(
            "vllm_engine_kv_cache_usage",
            "Fraction of the engine's KV cache in use (0..1): the gateway's `auto` window reads it",
            gauge,
        )
        self._tokens_family = pb_utils.MetricFamily(
            "vllm_engine_generation_tokens_total", "Tokens the engine generated", counter
        )
        self._finished_family = pb_utils.MetricFamily(
            "vllm_engine_requests_finished_total",
            "Requests the engine finished, by finish reason (aborted ones are not reported)",
            counter,
        )
        self._cache_queries_family = pb_utils.MetricFamily(
            "vllm_engine_prefix_cache_queries_total",
            "Prompt tokens the engine looked up in its prefix cache",
            counter,
        )
        self._cache_hits_family = pb_utils.MetricFamily(
            "vllm_engine_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (their prefill was skipped)",
            counter,
        )
        self._queued_family = pb_utils.MetricFamily(
            "vllm_engine_request_queued_seconds_total",
            "Time finished requests waited in the engine's queue before their first step",
            counter,
        )
        self._prefill_family = pb_utils.MetricFamily(
            "vllm_engine_request_prefill_seconds_total",
            "Time finished requests spent from their first step to their first token",
            counter,
        )
        self.running = self._running_family.Metric(labels=self._labels)
        self.waiting = self._waiting_family.Metric(labels=self._labels)
        self.kv_cache_usage = self._kv_family.Metric(labels=self._labels)
        self.generation_tokens = self._tokens_family.Metric(labels=self._labels)
        self.prefix_cache_queries = self._cache_queries_family.Metric(labels=self._labels)
        self.prefix_cache_hits = self._cache_hits_family.Metric(labels=self._labels)
        self.queued_seconds = self._queued_family.Metric(labels=self._labels)
        self.prefill_seconds = self._prefill_family.Metric(labels=self._labels)
        self._finished: dict[str, Any] = {}
        self._lock = threading.Lock()

    def finished(self, reason: str) -> Any:
        with self._lock:
            metric = self._finished.get(reason)
            if metric is None:
                metric = self._finished_family.Metric(labels={**self._labels, "reason": reason})
                self._finished[reason] = metric
            return metric

    def close(self) -> None:
        """Destroy the metric objects now, while the stub's shared memory still exists:
        left to interpreter exit, their destructors write to freed memory (segfault)."""
        with self._lock:
            self._finished.clear()
        self.running = self.waiting = self.kv_cache_usage = self.generation_tokens = None
        self.prefix_cache_queries = self.prefix_cache_hits = None
        self.queued_seconds = self.prefill_seconds = None
        self._running_family = self._waiting_family = self._kv_family = None
        self._tokens_family = self._finished_family = None
        self._cache_queries_family = self._cache_hits_family = None
        self._queued_family = self._prefill_family = None

    def logger_factory(self) -> Callable[..., EngineMetrics]:
        """What vLLM's stat_loggers expects: a callable (vllm_config, engine_index)."""

        def build(vllm_config: Any, engine_index: int = 0) -> EngineMetrics:
            return EngineMetrics(self)

        return build


def cpu_bf16_native(cpuinfo: str) -> bool:
    """Whether the CPU computes in bfloat16 itself (AVX512-BF16 or AMX) rather than
    converting every operand: from /proc/cpuinfo's `flags` lines."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_cpu_dtype(settings: dict[str, Any], bf16_native: bool) -> dict[str, Any]:
    """On vLLM's CPU backend, `"dtype": "auto"` means bfloat16 where the CPU computes in
    it, else float32: on an AVX2-only CPU bfloat16 is emulated, and SmolLM2-135M ran 6 x
    slower in it at 64 sequences (23 against 139 tokens/s). Any other dtype is kept."""
    if settings.get("dtype", "auto") != "auto":
        return settings
    return {**settings, "dtype": "bfloat16" if bf16_native else "float32"}


class TritonPythonModel:
    """Triton's entry points: initialize, execute (returns at once), finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the vllm backend needs model_transaction_policy { decoupled: true }"
            )
        engine_file = os.path.join(args["model_repository"], args["model_version"], "model.json")
        with open(engine_file, encoding="utf-8") as f:
            engine_settings = json.load(f)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                engine_settings = resolve_cpu_dtype(engine_settings, cpu_bf16_native(f.read()))

        try:
            engine_args = AsyncEngineArgs(**engine_settings)
        except TypeError as exc:
            raise pb_utils.TritonModelException(f"{engine_file}: {exc}") from None
        self._metrics = TritonEngineMetricFamilies(args["model_name"], args["model_version"])
        self._active: dict[str, asyncio.Task[None]] = {}
        self._senders: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        # The engine and its output-handling task belong to the loop thread.
        self._engine: AsyncLLM = asyncio.run_coroutine_threadsafe(
            self._start_engine(engine_args), self._loop
        ).result()
        self._max_model_len = self._engine.model_config.max_model_len
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch_cancellations(), self._loop)
        self.logger.log_info(
            f"vllm backend: {engine_args.model} ready (dtype={self._engine.model_config.dtype}, "
            f"max_model_len={self._max_model_len}, scheduling_policy={engine_args.scheduling_policy})"
        )

    async def _start_engine(self, engine_args: AsyncEngineArgs) -> AsyncLLM:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(engine_args, stat_loggers=[self._metrics.logger_factory()])

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                generation = parse_request(request, self._max_model_len)
            except InvalidRequest as exc:
                sender.send(
                    _error_response(str(exc), pb_utils.TritonError.INVALID_ARG),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            except Exception as exc:  # noqa: BLE001 - one bad request must not fail the batch
                self.logger.log_error(f"vllm backend: cannot read request: {exc!r}")
                sender.send(
                    _error_response(
                        f"cannot read request: {type(exc).__name__}", pb_utils.TritonError.INTERNAL
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            request_id = f"{request.request_id() or 'triton'}-{uuid.uuid4().hex}"
            asyncio.run_coroutine_threadsafe(
                self._start(request_id, generation, sender), self._loop
            )

    async def _start(self, request_id: str, generation: GenerationRequest, sender: Any) -> None:
        from vllm.exceptions import VLLMClientError

        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            self._active[request_id] = task
            self._senders[request_id] = sender
        try:
            await self._generate(request_id, generation, sender)
        except asyncio.CancelledError:
            # The client cancelled: leaving generate() aborts the request in the engine.
            # Triton still expects the final flag to release the request.
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except (InvalidRequest, VLLMClientError) as exc:
            sender.send(
                _error_response(str(exc), pb_utils.TritonError.INVALID_ARG),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        except Exception as exc:  # noqa: BLE001 - the model must keep serving the others
            self.logger.log_error(f"vllm backend: request {request_id} failed: {exc!r}")
            sender.send(
                _error_response(
                    f"generation failed: {type(exc).__name__}", pb_utils.TritonError.INTERNAL
                ),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        finally:
            with self._lock:
                self._active.pop(request_id, None)
                self._senders.pop(request_id, None)

    async def _generate(self, request_id: str, generation: GenerationRequest, sender: Any) -> None:
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        engine = self._engine
        prompt = parse_model_prompt(engine.model_config, generation.prompt)
        (engine_input,) = await engine.renderer.render_cmpl_async(
            [prompt], engine.renderer.default_cmpl_tok_params
        )
        num_input_tokens = len(engine_input["prompt_token_ids"])
        if num_input_tokens >= self._max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_input_tokens} tokens; max_model_len is {self._max_model_len}"
            )
        async for output in engine.generate(
            engine_input, generation.sampling, request_id, priority=generation.priority
        ):
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
            sender.send(self._response(output, generation, num_input_tokens), flags=flags)

    def _response(
        self, output: RequestOutput, generation: GenerationRequest, num_input_tokens: int
    ) -> Any:
        completion = output.outputs[0]
        text = completion.text
        # Like the official backend: a non-streamed answer repeats the prompt unless
        # the client excludes it; stream deltas never do.
        if not generation.stream and not generation.exclude_input_in_output:
            text = generation.prompt + text
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))
        ]
        if generation.return_finish_reason:
            reason = completion.finish_reason or ""
            tensors.append(
                pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_))
            )
        if generation.return_num_input_tokens:
            tensors.append(
                pb_utils.Tensor("num_input_tokens", np.array([num_input_tokens], dtype=np.uint32))
            )
        if generation.return_num_output_tokens:
            # Streaming: the tokens in this delta; otherwise the whole completion.
            tensors.append(
                pb_utils.Tensor(
                    "num_output_tokens", np.array([len(completion.token_ids)], dtype=np.uint32)
                )
            )
        return pb_utils.InferenceResponse(output_tensors=tensors)

    async def _watch_cancellations(self) -> None:
        # Polled, because the python backend signals cancellation only through
        # is_cancelled(); a request still queued in the engine yields no output to
        # check it on.
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            with self._lock:
                watched = [(rid, self._senders[rid], task) for rid, task in self._active.items()]
            for request_id, sender, task in watched:
                if sender.is_cancelled() and not task.done():
                    self.logger.log_info(
                        f"vllm backend: request {request_id} cancelled by the client; aborting"
                    )
                    task.cancel()

    def finalize(self) -> None:
        async def shutdown() -> None:
            self._watcher.cancel()
            with self._lock:
                tasks = list(self._active.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._engine.shutdown(timeout=ENGINE_EXIT_S)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._metrics.close()
        # What is left (vLLM's client, torch, the tokenizer) goes with the process: frozen,
        # the interpreter's last collection skips it. Collecting it took the stub past
        # Triton's exit timeout, which then killed the stub mid-collection (a segfault).
        gc.freeze()
