"""The shipped clients against the real stack (Triton with smollm2 and minilm, the gateway
in-process): the `qosgate-client` CLI, the Node.js client's own `node --test` suite, and
KServe streaming from grpc-js (tests/integration/node/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_model
from gateway_harness import ACME_KEY, GatewayThread, gateway_config
from qosgate import paths
from qosgate.launcher import LocalTriton
from scripts.protocol_descriptors import KSERVE, descriptor_set

pytestmark = pytest.mark.integration

NODE_CLIENT = paths.project_root() / "clients" / "node"
CLI = Path(sys.executable).parent / "qosgate-client"


@pytest.fixture(scope="module")
def gateway(
    triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayThread]:
    state = tmp_path_factory.mktemp("clients")
    config = gateway_config(
        triton.ports.grpc_url,
        usage_db=str(state / "usage.sqlite3"),
        batch={"db": str(state / "batch.sqlite3")},
    )
    with GatewayThread(config) as gateway:
        yield gateway


def cli(
    gateway: GatewayThread, *args: str, key: str = ACME_KEY
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QOSGATE_TARGET": gateway.url, "QOSGATE_API_KEY": key}
    return subprocess.run(
        [str(CLI), *args], check=False, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_generate_streams_the_answer_and_prints_usage(gateway: GatewayThread) -> None:
    require_model("smollm2")
    done = cli(
        gateway,
        "generate",
        "--model",
        "smollm2",
        "--temperature",
        "0",
        "--max-tokens",
        "48",
        "What is the capital of France?",
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "[usage] prompt_tokens=" in done.stderr and "finish=" in done.stderr


def test_cli_usage_counts_the_generation(gateway: GatewayThread) -> None:
    require_model("smollm2")
    cli(gateway, "generate", "--model", "smollm2", "--max-tokens", "4", "Hello")
    done = cli(gateway, "usage")
    assert done.returncode == 0, done.stderr
    assert "tenant acme" in done.stdout and "requests=" in done.stdout


def test_cli_embed_prints_one_vector_per_text(gateway: GatewayThread) -> None:
    require_model("minilm")
    done = cli(gateway, "embed", "--model", "minilm", "a cat", "a dog")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["input"] for r in rows] == ["a cat", "a dog"]
    assert all(len(r["embedding"]) == 384 for r in rows)


def test_cli_reports_code_and_message_on_failure(gateway: GatewayThread) -> None:
    done = cli(gateway, "generate", "--model", "smollm2", "hi", key="not-a-key")
    assert done.returncode == 1
    assert "error: UNAUTHENTICATED" in done.stderr


def test_node_client_suite_streams_through_the_gateway(gateway: GatewayThread) -> None:
    require_model("smollm2")
    require_model("minilm")  # the openai package's embeddings
    node = shutil.which("node")
    assert node is not None, "node is not on PATH: install Node.js 20 (docs/development.md)"
    for package in ("@grpc/grpc-js", "openai"):
        assert (NODE_CLIENT / "node_modules" / package).is_dir(), "Node client packages missing: run `make node-deps`"
    env = {
        **os.environ,
        "QOSGATE_TARGET": gateway.url,
        "QOSGATE_OPENAI_BASE_URL": gateway.openai_url,
        "QOSGATE_API_KEY": ACME_KEY,
    }
    done = subprocess.run(
        [node, "--test"],
        check=False,
        cwd=NODE_CLIENT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# fail 0" in done.stdout and "# skipped 0" in done.stdout


def test_node_grpc_js_streams_kserve_through_the_gateway(gateway: GatewayThread, tmp_path: Path) -> None:
    """ModelStreamInfer from grpc-js: another HTTP/2 stack than grpcio's on the relay's
    served streams. Every identity request comes back whole under its own id (protobuf.js
    keeps only the last copy of an embedded message, so the response must carry one), and
    the one for a model that does not exist fails in the stream, which goes on to OK."""
    require_model("identity")
    node = shutil.which("node")
    assert node is not None, "node is not on PATH: install Node.js 20 (docs/development.md)"
    (tmp_path / "kserve.desc").write_bytes(descriptor_set(KSERVE).SerializeToString())
    count = 40
    done = subprocess.run(
        [node, str(Path(__file__).parent / "node" / "kserve_stream.js"), str(tmp_path / "kserve.desc"),
         gateway.url, ACME_KEY, str(count)],
        check=False,
        env={**os.environ, "NODE_PATH": str(NODE_CLIENT / "node_modules")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == 0, result
    answered = {r["id"]: r for r in result["responses"]}
    assert len(result["responses"]) == count + 1
    for n in range(count):
        assert answered[f"node-{n}"]["error"] == ""
        assert answered[f"node-{n}"]["values"] == [n, n + 0.5, -n, 1e6]
    assert "no-such-model" in answered["node-missing"]["error"]  # Triton's in-band answer
