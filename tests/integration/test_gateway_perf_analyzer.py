"""perf_analyzer (tritonclient 2.51.0) through the gateway: short, bounded runs.

It is Triton's own load generator and knows nothing of the gateway: only `-u` and a
header change. Without the header every request fails UNAUTHENTICATED.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import require_model
from gateway_harness import ACME_KEY, GatewayThread, gateway_config
from qosgate import paths

pytestmark = pytest.mark.integration

PERF_ANALYZER = paths.cache_dir() / "tools" / "perf_analyzer"
# Short windows: enough to see every request succeed, bounded in time; up to 10 of them,
# so that one window slowed by other work on the machine does not fail the run.
BOUNDED = (
    "--measurement-mode=count_windows",
    "--measurement-request-count=10",
    "--max-trials=10",
    "--stability-percentage=999",
)


@pytest.fixture(scope="module")
def gateway(triton) -> GatewayThread:
    assert PERF_ANALYZER.exists(), f"perf_analyzer missing at {PERF_ANALYZER}: run `make tools`"
    with GatewayThread(gateway_config(triton.ports.grpc_url)) as running:
        yield running


def perf_analyzer(gateway: GatewayThread, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PERF_ANALYZER), "-i", "grpc", "-u", gateway.url, *BOUNDED, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_perf_analyzer_against_minilm(gateway) -> None:
    require_model("minilm")
    run = perf_analyzer(
        gateway, "-m", "minilm", "--concurrency-range=2", "-H", f"authorization:Bearer {ACME_KEY}"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout
    print(run.stdout[-600:])


def test_perf_analyzer_without_a_key_is_refused(gateway) -> None:
    require_model("minilm")
    run = perf_analyzer(gateway, "-m", "minilm", "--concurrency-range=1", timeout=60)
    assert run.returncode != 0
    assert "missing API key" in run.stdout + run.stderr


def test_perf_analyzer_streaming_against_smollm2(gateway, tmp_path) -> None:
    require_model("smollm2")
    data = tmp_path / "prompts.json"
    data.write_text(
        json.dumps(
            {
                "data": [
                    {
                        "text_input": ["Name a colour."],
                        "stream": [True],
                        "sampling_parameters": [json.dumps({"max_tokens": 8, "temperature": 0})],
                    }
                ]
            }
        )
    )
    run = perf_analyzer(
        gateway,
        "-m",
        "smollm2",
        "--streaming",
        f"--input-data={data}",
        "--concurrency-range=2",
        "-H",
        f"authorization:Bearer {ACME_KEY}",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout
    print(run.stdout[-600:])
