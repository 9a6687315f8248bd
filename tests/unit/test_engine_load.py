"""Reading the engines' saturation off Triton's metrics text (the three engines we know),
and scraping it from a real HTTP server."""

from __future__ import annotations

import logging
import socket

import pytest
from aiohttp import web

from qosgate.scheduler import EngineLoad
from qosgate.upstream.engine_load import EngineLoadReader, parse_engine_load
from tests.fakes import until

OURS = """\
# HELP vllm_engine_requests_waiting Requests queued in the engine's scheduler
# TYPE vllm_engine_requests_waiting gauge
vllm_engine_requests_waiting{model="smollm2",version="1"} 3
# HELP vllm_engine_kv_cache_usage Fraction of the engine's KV cache in use
# TYPE vllm_engine_kv_cache_usage gauge
vllm_engine_kv_cache_usage{model="smollm2",version="1"} 0.42
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="minilm",version="1"} 7
"""

NVIDIA_VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model="llama",version="1"} 5
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model="llama",version="1"} 0.93
"""

TRTLLM = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 30
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 300
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 400
"""


BATCHER = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="minilm",version="1"} 32
nv_inference_pending_request_count{model="smollm2",version="1"} 0
"""


def test_our_vllm_backend() -> None:
    loads = parse_engine_load(OURS)
    assert loads["smollm2"] == EngineLoad(waiting=3, kv_cache_usage=0.42)
    # Triton's other families say nothing about saturation.
    assert "minilm" not in loads


def test_a_dynamic_batchers_pending_requests_are_its_waiting_queue() -> None:
    loads = parse_engine_load(BATCHER + OURS)
    assert loads["minilm"] == EngineLoad(waiting=32, kv_cache_usage=None)
    # A decoupled LLM takes its requests at once: its engine's own queue is what counts.
    assert loads["smollm2"] == EngineLoad(waiting=3, kv_cache_usage=0.42)


def test_nvidia_vllm_backend() -> None:
    assert parse_engine_load(NVIDIA_VLLM)["llama"] == EngineLoad(waiting=5, kv_cache_usage=0.93)


def test_nvidia_tensorrt_llm_backend() -> None:
    assert parse_engine_load(TRTLLM)["tensorrt_llm"] == EngineLoad(waiting=2, kv_cache_usage=0.75, running=30)


def test_what_an_llm_engine_runs_is_read_where_it_says() -> None:
    ours = OURS + 'vllm_engine_requests_running{model="smollm2",version="1"} 64\n'
    nvidia = NVIDIA_VLLM + 'vllm:num_requests_running{model="llama",version="1"} 12\n'
    assert parse_engine_load(ours)["smollm2"].running == 64
    assert parse_engine_load(nvidia)["llama"].running == 12
    # A batcher says nothing of it.
    assert parse_engine_load(BATCHER)["minilm"].running is None


def test_engine_samples_amid_a_large_page_of_other_families() -> None:
    others = "".join(
        f"# HELP nv_inference_request_duration_us Cumulative inference request duration\n"
        f"# TYPE nv_inference_request_duration_us counter\n"
        f'nv_inference_request_duration_us{{model="m{i}",version="1"}} {i}\n'
        for i in range(500)
    )
    loads = parse_engine_load(others + OURS + NVIDIA_VLLM + others)
    assert loads == {
        "smollm2": EngineLoad(waiting=3, kv_cache_usage=0.42),
        "llama": EngineLoad(waiting=5, kv_cache_usage=0.93),
    }
    # Not a metrics page at all (a proxy's error page): no reading, no exception.
    assert parse_engine_load("<html><body>502 Bad Gateway</body></html>\n") == {}


async def test_the_reader_scrapes_over_one_kept_alive_connection_and_names_a_dead_port_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clients: list[object] = []

    async def metrics(request: web.Request) -> web.Response:
        clients.append(request.transport and request.transport.get_extra_info("peername"))
        return web.Response(text=OURS)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    per_model: dict[str, EngineLoad] = {}
    per_upstream: dict[tuple[str, str], EngineLoad] = {}
    reader = EngineLoadReader(
        [("live", f"http://127.0.0.1:{port}/metrics"), ("dead", f"http://127.0.0.1:{dead}/metrics")],
        per_model.__setitem__,
        lambda upstream, model, load: per_upstream.__setitem__((upstream, model), load),
    )
    caplog.set_level(logging.WARNING, "qosgate.upstream.engine_load")
    reader.start()
    try:
        await until(lambda: len(clients) >= 3)
    finally:
        await reader.close()
        await runner.cleanup()
    assert per_model["smollm2"] == EngineLoad(waiting=3, kv_cache_usage=0.42)
    assert per_upstream == {("live", "smollm2"): EngineLoad(waiting=3, kv_cache_usage=0.42)}
    assert len(set(clients)) == 1, "every scrape went over the first connection"
    dead_port_warnings = [r for r in caplog.records if str(dead) in r.getMessage()]
    assert len(dead_port_warnings) == 1
