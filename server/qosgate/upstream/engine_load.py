"""The engines' saturation, read off Triton's Prometheus metrics port, for `auto` windows.

Per model, summed over the upstreams that set `metrics_url`: requests waiting inside the
engine, and the largest KV-cache use (for the dispatch windows); and each upstream's own
reading (for `prefix_affinity` routing, which passes over a saturated replica). The
metrics read (the first family found wins):

| engine                          | waiting requests                            | running requests | KV-cache use                                      |
|---------------------------------|---------------------------------------------|------------------|---------------------------------------------------|
| every Triton model              | `nv_inference_pending_request_count` (the scheduler's queue: a dynamic batcher's pending requests) | - | - |
| our vLLM backend                | + `vllm_engine_requests_waiting`            | `vllm_engine_requests_running` | `vllm_engine_kv_cache_usage` (0..1)               |
| NVIDIA's vLLM backend           | + `vllm:num_requests_waiting`               | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc` (0..1) |
| NVIDIA's TensorRT-LLM backend   | + `nv_trt_llm_request_metrics{request_type="waiting"}` | `...{request_type="active"}` | `nv_trt_llm_kv_cache_block_metrics` used / max blocks |

All carry a `model` label (Triton's model name). Triton's pending count is the batcher's
queue (requests not yet in an executing batch); a decoupled LLM backend takes its
requests at once, so there the engine's own waiting queue is what counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from qosgate.scheduler.window import EngineLoad

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
_TIMEOUT_S = 2.0

_WAITING = ("vllm_engine_requests_waiting", "vllm:num_requests_waiting")
_RUNNING = ("vllm_engine_requests_running", "vllm:num_requests_running")
_KV_USAGE = ("vllm_engine_kv_cache_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_TRTLLM_REQUESTS = "nv_trt_llm_request_metrics"
_TRTLLM_KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
_PENDING = "nv_inference_pending_request_count"
_ENGINE_PREFIXES = ("vllm_engine_", "vllm:", "nv_trt_llm_", _PENDING)


@dataclass(slots=True)
class _Reading:
    waiting: float = 0.0
    running: float | None = None
    kv_cache_usage: float | None = None
    trtllm_kv: dict[str, float] = field(default_factory=dict)


def parse_engine_load(text: str) -> dict[str, EngineLoad]:
    """The engine load per model named in one Prometheus text exposition.

    Only the sample lines read here go to the parser: the rest of the page (Triton's other
    families for every model, and HELP and TYPE lines, which change no sample's name) is
    passed over by prefix. The parser is pure Python and runs on the event loop every
    poll, and a GPU server's page holds hundreds of lines that say nothing here.
    """
    engine_lines = "\n".join(line for line in text.splitlines() if line.startswith(_ENGINE_PREFIXES))
    readings: dict[str, _Reading] = {}
    for family in text_string_to_metric_families(engine_lines):
        for sample in family.samples:
            model = sample.labels.get("model")
            name = sample.name
            if model is None:
                continue
            reading = readings.setdefault(model, _Reading())
            if name in _WAITING or name == _PENDING:
                reading.waiting += sample.value
            elif name in _RUNNING:
                reading.running = (reading.running or 0.0) + sample.value
            elif name in _KV_USAGE:
                reading.kv_cache_usage = max(reading.kv_cache_usage or 0.0, sample.value)
            elif name == _TRTLLM_REQUESTS and sample.labels.get("request_type") == "waiting":
                reading.waiting += sample.value
            elif name == _TRTLLM_REQUESTS and sample.labels.get("request_type") == "active":
                reading.running = (reading.running or 0.0) + sample.value
            elif name == _TRTLLM_KV_BLOCKS:
                reading.trtllm_kv[sample.labels.get("kv_cache_block_type", "")] = sample.value
    loads: dict[str, EngineLoad] = {}
    for model, reading in readings.items():
        usage = reading.kv_cache_usage
        blocks = reading.trtllm_kv
        if usage is None and blocks.get("max"):
            usage = blocks.get("used", 0.0) / blocks["max"]
        loads[model] = EngineLoad(waiting=reading.waiting, kv_cache_usage=usage, running=reading.running)
    return loads


def _merge(loads: Iterable[dict[str, EngineLoad]]) -> dict[str, EngineLoad]:
    merged: dict[str, EngineLoad] = {}
    for per_model in loads:
        for model, load in per_model.items():
            seen = merged.get(model)
            if seen is None:
                merged[model] = load
                continue
            usages = [u for u in (seen.kv_cache_usage, load.kv_cache_usage) if u is not None]
            running = None if seen.running is None and load.running is None else (seen.running or 0.0) + (load.running or 0.0)
            merged[model] = EngineLoad(seen.waiting + load.waiting, max(usages) if usages else None, running)
    return merged


class EngineLoadReader:
    """Scrapes each upstream's metrics URL every POLL_INTERVAL_S and hands the loads on:
    each model's over all upstreams to `publish(model, load)`, each upstream's own to
    `publish_upstream(upstream, model, load)`.

    The scrapes run on the event loop over kept-alive connections: a thread and a new
    connection per scrape (urllib) cost the gateway several milliseconds of CPU each, and
    a thread wanting the GIL stalls the loop's calls while they wait for it."""

    def __init__(
        self,
        sources: Iterable[tuple[str, str]],
        publish: Callable[[str, EngineLoad], None],
        publish_upstream: Callable[[str, str, EngineLoad], None],
    ) -> None:
        sources = list(sources)
        self._names = [name for name, _ in sources]
        self._urls = [url for _, url in sources]
        self._publish = publish
        self._publish_upstream = publish_upstream
        self._task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()

    def start(self) -> None:
        if self._urls:
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="engine load")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as session:
            while True:
                await self._read(session)
                await asyncio.sleep(POLL_INTERVAL_S)

    async def _read(self, session: aiohttp.ClientSession) -> None:
        texts = await asyncio.gather(*(self._fetch(session, url) for url in self._urls))
        readings = [(name, self._parse(text)) for name, text in zip(self._names, texts, strict=True) if text]
        for name, per_model in readings:
            for model, load in per_model.items():
                self._publish_upstream(name, model, load)
        for model, load in _merge(per_model for _, per_model in readings).items():
            self._publish(model, load)

    @staticmethod
    def _parse(text: str) -> dict[str, EngineLoad]:
        try:
            return parse_engine_load(text)
        except ValueError as e:  # not Prometheus text: nothing to learn from it
            log.warning("unreadable engine metrics: %s", e)
            return {}

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url, raise_for_status=True) as response:
                text = (await response.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            # Logged once per outage: a metrics port that is down must not flood the log.
            if url not in self._failing:
                self._failing.add(url)
                log.warning("cannot read engine metrics at %s: %s", url, e)
            return None
        self._failing.discard(url)
        return text
