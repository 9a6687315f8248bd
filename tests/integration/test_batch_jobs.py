"""Batch jobs through the real stack: real tritonserver with smollm2 (vLLM), the gateway
as its own `qosgate serve` process (so it can be killed -9), the real Python client and CLI.

The interactive-latency factor under a running job is printed; the asserted bound is
generous on purpose (a shared 2-core machine); bench/ measures it properly.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from qosgate.launcher import LocalTriton
from qosgate.v1 import batch_pb2, generation_pb2
from qosgate_client import Client, ClientError

pytestmark = pytest.mark.integration

ACME_KEY = "batch-test-acme-key"
GLOBEX_KEY = "batch-test-globex-key"
ALLOWED_HOOKS = "http://127.0.0.1:9/hooks/"
BIN = Path(sys.executable).parent
GENEROUS_FACTOR = 10.0


@pytest.fixture
def gateway(triton: LocalTriton, tmp_path: Path) -> Iterator[GatewayProcess]:
    require_model("smollm2")
    port = free_port()
    config = {
        "listen": f"127.0.0.1:{port}",
        "metrics_listen": "127.0.0.1:0",
        "openai": {"listen": "127.0.0.1:0", "files_db": str(tmp_path / "openai_files.sqlite3")},
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
        "usage_db": str(tmp_path / "usage.sqlite3"),
        "models": {"smollm2": {"default_max_tokens": 16}},
        "tenants": [
            {
                "name": "acme",
                "api_keys": [{"key": ACME_KEY}],
                "default_class": "interactive",
                "max_class": "critical",
            },
            {"name": "globex", "api_keys": [{"key": GLOBEX_KEY}]},
        ],
        "batch": {
            "db": str(tmp_path / "batch.sqlite3"),
            "retry_base_delay_s": 0.2,
            "callback_allowlist": [ALLOWED_HOOKS],
            "tenants": {"globex": {"max_queued_items": 5}},
        },
    }
    with GatewayProcess.running(config, tmp_path) as process:
        yield process


def generation_items(count: int, max_tokens: int = 2) -> list[batch_pb2.BatchItem]:
    return [
        batch_pb2.BatchItem(
            custom_id=f"item-{n}",
            generate=generation_pb2.GenerateRequest(
                prompt=f"Count to {n}:",
                sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            ),
        )
        for n in range(count)
    ]


def submit(client: Client, items: list[batch_pb2.BatchItem], **header: str) -> batch_pb2.Batch:
    return client.create_batch(batch_pb2.BatchHeader(model="smollm2", **header), items)


def wait_done(
    client: Client, batch_id: str, at_least: int | None = None, timeout_s: float = 300.0
) -> batch_pb2.Batch:
    """Poll until the job finishes (or, with `at_least`, until that many items are done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.get_batch(batch_id)
        done = batch.counts.succeeded + batch.counts.failed
        if at_least is not None and done >= at_least:
            return batch
        if batch.status in (batch_pb2.BATCH_STATUS_COMPLETED, batch_pb2.BATCH_STATUS_CANCELLED):
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} not done: {client.get_batch(batch_id)}")


def interactive_latency(client: Client) -> float:
    started = time.perf_counter()
    client.generate(
        "smollm2",
        "What is the capital of France?",
        max_tokens=8,
        temperature=0.0,
        priority_class="interactive",
    )
    return time.perf_counter() - started


def test_500_items_complete_once_each_while_interactive_stays_fast(gateway: GatewayProcess) -> None:
    with Client(gateway.target, ACME_KEY) as client:
        unloaded = statistics.median(interactive_latency(client) for _ in range(5))
        batch = submit(client, generation_items(500))
        assert batch.counts.total == 500
        loaded = []
        while (
            client.get_batch(batch.id).status != batch_pb2.BATCH_STATUS_COMPLETED
            and len(loaded) < 10
        ):
            loaded.append(interactive_latency(client))
        batch = wait_done(client, batch.id)
        results = list(client.batch_results(batch.id))
    factor = statistics.median(loaded) / unloaded if loaded else float("nan")
    print(
        f"\ninteractive latency: unloaded {unloaded * 1000:.0f} ms, during the 500-item job "
        f"{statistics.median(loaded) * 1000:.0f} ms (median of {len(loaded)}): factor {factor:.2f}"
    )
    assert batch.status == batch_pb2.BATCH_STATUS_COMPLETED
    assert batch.counts.succeeded == 500, batch.counts
    assert sorted(r.custom_id for r in results) == sorted(f"item-{n}" for n in range(500))
    assert [r.offset for r in results] == list(range(500))
    assert all(r.generation.usage.completion_tokens >= 1 for r in results)
    assert len(loaded) >= 3, "the job finished before interactive latency could be sampled"
    assert factor < GENEROUS_FACTOR


def test_kill_9_midway_then_restart_gives_exactly_one_result_per_item(
    gateway: GatewayProcess,
) -> None:
    total = 120
    with Client(gateway.target, ACME_KEY) as client:
        batch = submit(client, generation_items(total, max_tokens=4))
        wait_done(client, batch.id, at_least=total // 2)
    gateway.kill()
    gateway.start()
    with Client(gateway.target, ACME_KEY) as client:
        batch = wait_done(client, batch.id)
        results = list(client.batch_results(batch.id))
    assert batch.status == batch_pb2.BATCH_STATUS_COMPLETED
    assert batch.counts.succeeded == total, batch.counts
    ids = [r.custom_id for r in results]
    assert len(ids) == len(set(ids)) == total
    assert set(ids) == {f"item-{n}" for n in range(total)}


def test_cancel_stops_dispatch_within_a_second_and_keeps_results(gateway: GatewayProcess) -> None:
    with Client(gateway.target, ACME_KEY) as client:
        batch = submit(client, generation_items(300, max_tokens=8))
        wait_done(client, batch.id, at_least=10)
        started = time.monotonic()
        client.cancel_batch(batch.id)
        batch = wait_done(client, batch.id, timeout_s=5.0)
        stopped_s = time.monotonic() - started
        done_at_cancel = batch.counts.succeeded + batch.counts.failed
        time.sleep(1.0)
        later = client.get_batch(batch.id)
        results = list(client.batch_results(batch.id))
    print(
        f"\ncancel: job stopped {stopped_s * 1000:.0f} ms after CancelBatch, {done_at_cancel} items done"
    )
    assert batch.status == batch_pb2.BATCH_STATUS_CANCELLED
    assert stopped_s < 1.0
    assert later.counts == batch.counts  # nothing dispatched after the cancel
    assert batch.counts.cancelled == 300 - done_at_cancel
    assert len(results) == done_at_cancel >= 10


def test_submit_refuses_bad_callbacks_and_limits_and_hides_other_tenants(
    gateway: GatewayProcess,
) -> None:
    with Client(gateway.target, ACME_KEY) as acme, Client(gateway.target, GLOBEX_KEY) as globex:
        with pytest.raises(ClientError) as refused:
            submit(acme, generation_items(2), callback_url="http://127.0.0.1:8001/steal")
        assert refused.value.code == "INVALID_ARGUMENT" and "allowlist" in refused.value.message
        with pytest.raises(ClientError) as limited:
            submit(globex, generation_items(6))
        assert limited.value.code == "RESOURCE_EXHAUSTED"
        assert limited.value.retry_after_s
        mine = submit(acme, generation_items(2), callback_url=ALLOWED_HOOKS + "done")
        with pytest.raises(ClientError) as hidden:
            globex.get_batch(mine.id)
        assert hidden.value.code == "NOT_FOUND"
        assert globex.list_batches().batches == []
        assert [b.id for b in acme.list_batches().batches] == [mine.id]


def run_cli(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QOSGATE_API_KEY": ACME_KEY, "QOSGATE_TARGET": gateway.target}
    return subprocess.run(
        [str(BIN / "qosgate-client"), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_walkthrough_and_malformed_file(gateway: GatewayProcess, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"custom_id": "a", "generate": {"prompt": "hi"}}\n'
        "{oops\n"
        '{"custom_id": "a", "generate": {"prompt": "again"}}\n'
    )
    refused = run_cli(gateway, "batch", "submit", str(bad), "--model", "smollm2")
    assert refused.returncode == 2
    assert "line 2" in refused.stderr and "line 3" in refused.stderr
    assert run_cli(gateway, "batch", "list").stdout == ""  # nothing was queued

    good = tmp_path / "requests.jsonl"
    good.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"q{n}",
                    "generate": {"prompt": f"Say {n}", "sampling": {"max_tokens": 2}},
                }
            )
            + "\n"
            for n in range(20)
        )
    )
    submitted = run_cli(gateway, "batch", "submit", str(good), "--model", "smollm2")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.split()[0]
    assert "20/20 items sent" in submitted.stderr
    # --follow streams results while the job runs and ends when it has finished.
    out = tmp_path / "results.jsonl"
    fetched = run_cli(gateway, "batch", "results", batch_id, "--follow", "--out", str(out))
    assert fetched.returncode == 0, fetched.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"q{n}" for n in range(20))
    assert all("generation" in line for line in lines)
    resumed = run_cli(gateway, "batch", "results", batch_id, "--offset", "15")
    assert [json.loads(line)["custom_id"] for line in resumed.stdout.splitlines()] == [
        line["custom_id"] for line in lines[15:]
    ]
    status = run_cli(gateway, "batch", "status", batch_id, "--wait")
    assert status.returncode == 0 and "completed" in status.stdout
    assert "succeeded=20" in status.stdout
