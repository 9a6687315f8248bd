"""Batch jobs shared by two gateways: two `qosgate serve` processes on one real PostgreSQL
job store, in front of one real tritonserver (embedding items on minilm, fast here).

A job created on one gateway is read, listed, streamed and cancelled on the other; a
gateway killed with SIGKILL while it runs a job's items leaves them to the other, which
finishes the job with exactly one result per custom_id once their leases have run out; and
the OpenAI Batch API, with the official SDK, works across the two: a file uploaded on one,
the batch created on the other, its output read back on the first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
import yaml
from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from qosgate.launcher import LocalTriton
from qosgate.v1 import batch_pb2, embedding_pb2
from qosgate_client import Client, ClientError

from tests.postgres_server import PostgresServer

pytestmark = pytest.mark.integration

ACME_KEY = "shared-jobs-acme-key"
GLOBEX_KEY = "shared-jobs-globex-key"
LEASE_S = 3.0
FINISHED = (batch_pb2.BATCH_STATUS_COMPLETED, batch_pb2.BATCH_STATUS_CANCELLED)


def gateway_config(directory: Path, triton: LocalTriton, store_url: str) -> dict[str, Any]:
    directory.mkdir()
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": "127.0.0.1:0",
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
        "usage_db": str(directory / "usage.sqlite3"),
        "openai": {"listen": f"127.0.0.1:{free_port()}"},
        "tenants": [
            {"name": "acme", "api_keys": [{"key": ACME_KEY}]},
            {"name": "globex", "api_keys": [{"key": GLOBEX_KEY}]},
        ],
        "batch": {"max_in_flight": 4, "retry_base_delay_s": 0.2},
        "job_store": {"backend": "postgres", "postgres_url": store_url, "lease_s": LEASE_S},
    }


@pytest.fixture
def store_url(postgres: PostgresServer) -> str:
    return postgres.database()


@pytest.fixture
def gateways(
    triton: LocalTriton, store_url: str, tmp_path: Path
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    require_model("minilm")
    with GatewayProcess.side_by_side(
        *((gateway_config(tmp_path / name, triton, store_url), tmp_path / name) for name in ("a", "b"))
    ) as (one, other):
        yield one, other


def embed_items(count: int) -> list[batch_pb2.BatchItem]:
    return [
        batch_pb2.BatchItem(
            custom_id=f"doc-{n}",
            embed=embedding_pb2.EmbedRequest(inputs=[f"document number {n} about batch inference"]),
        )
        for n in range(count)
    ]


def submit(client: Client, count: int) -> batch_pb2.Batch:
    return client.create_batch(batch_pb2.BatchHeader(model="minilm"), embed_items(count))


def wait_finished(client: Client, batch_id: str, timeout_s: float = 120.0) -> batch_pb2.Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.get_batch(batch_id)
        if batch.status in FINISHED:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} not finished: {client.get_batch(batch_id)}")


def test_a_job_created_on_one_gateway_is_read_streamed_and_cancelled_on_the_other(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    one, other = gateways
    with (
        Client(one.target, ACME_KEY) as on_one,
        Client(other.target, ACME_KEY) as on_other,
        Client(other.target, GLOBEX_KEY) as globex,
    ):
        created = submit(on_one, 400)
        seen = on_other.get_batch(created.id)
        assert (seen.id, seen.counts.total, seen.model) == (created.id, 400, "minilm")
        assert [b.id for b in on_other.list_batches().batches] == [created.id]
        with pytest.raises(ClientError) as hidden:
            globex.get_batch(created.id)
        assert hidden.value.code == "NOT_FOUND"
        # Follow the results on the other gateway while both gateways run the items.
        streamed = []
        for result in on_other.batch_results(created.id, follow=True):
            streamed.append(result)
            if len(streamed) == 20:
                break
        assert [r.offset for r in streamed] == list(range(20))
        assert all(len(r.embedding.embeddings[0].values) == 384 for r in streamed)
        cancelled = on_other.cancel_batch(created.id)
        assert cancelled.status in (
            batch_pb2.BATCH_STATUS_CANCELLING,
            batch_pb2.BATCH_STATUS_CANCELLED,
        )
        # The first gateway stops its items at its next lease renewal.
        final = wait_finished(on_one, created.id, timeout_s=LEASE_S * 5)
        time.sleep(LEASE_S / 2)
        later = on_one.get_batch(created.id)
        results = list(on_one.batch_results(created.id))
    assert final.status == batch_pb2.BATCH_STATUS_CANCELLED
    assert later.counts == final.counts  # nothing ran after the job was cancelled
    done = final.counts.succeeded + final.counts.failed
    assert final.counts.failed == 0 and final.counts.cancelled == 400 - done > 0
    assert [r.offset for r in results] == list(range(done))
    assert len({r.custom_id for r in results}) == done
    assert [r.custom_id for r in results[:20]] == [r.custom_id for r in streamed]


def leased_to(store_url: str, batch_id: str, pid: int) -> list[str]:
    """custom_ids of the job's items running under a lease of the gateway process `pid`
    (lease tokens start with the holder's host:pid)."""
    with psycopg.connect(store_url) as conn:
        rows = conn.execute(
            "SELECT custom_id FROM batch_items WHERE job_id = %s AND state = 'running'"
            " AND lease_token LIKE %s",
            (batch_id, f"%:{pid}/%"),
        ).fetchall()
    return [custom_id for (custom_id,) in rows]


def test_kill_9_of_a_gateway_running_items_leaves_the_job_to_the_other(
    gateways: tuple[GatewayProcess, GatewayProcess], store_url: str
) -> None:
    victim, survivor = gateways
    total = 200
    # Created on the victim, which starts running it at once; the survivor joins in.
    with Client(victim.target, ACME_KEY) as on_victim:
        batch = submit(on_victim, total)
    with Client(survivor.target, ACME_KEY) as client:
        assert victim.proc is not None
        pid = victim.proc.pid
        deadline = time.monotonic() + 60
        while not leased_to(store_url, batch.id, pid):
            assert time.monotonic() < deadline, "the victim never ran an item of the job"
            time.sleep(0.05)
        victim.kill()
        killed_at = time.time()
        # What the dead gateway held when it died: nobody renews these leases now.
        orphaned = leased_to(store_url, batch.id, pid)
        finished = wait_finished(client, batch.id)
        results = list(client.batch_results(batch.id))
    done_at = {r.custom_id: r.completed_at.ToNanoseconds() / 1e9 for r in results}
    takeover_s = max((done_at[c] for c in orphaned), default=float("nan")) - killed_at
    print(
        f"\nkill -9: {len(orphaned)} item(s) held by the dead gateway, their results"
        f" {takeover_s:.1f} s after the kill (lease {LEASE_S:g} s)"
    )
    assert finished.status == batch_pb2.BATCH_STATUS_COMPLETED
    assert finished.counts.succeeded == total, finished.counts
    ids = [r.custom_id for r in results]
    assert len(ids) == len(set(ids)) == total
    assert set(ids) == {f"doc-{n}" for n in range(total)}
    assert orphaned, "the victim held no item when it was killed"
    attempts = {r.custom_id: r.attempts for r in results}
    assert all(attempts[custom_id] >= 2 for custom_id in orphaned), attempts


def openai_client(gateway: GatewayProcess, key: str = ACME_KEY) -> openai.OpenAI:
    listen = yaml.safe_load(gateway.config_path.read_text())["openai"]["listen"]
    return openai.OpenAI(base_url=f"http://{listen}/v1", api_key=key, max_retries=0)


def test_openai_batch_round_trip_across_two_gateways(gateways: tuple[GatewayProcess, GatewayProcess]) -> None:
    one, other = gateways
    on_one, on_other = openai_client(one), openai_client(other)
    lines = [
        {"custom_id": f"doc-{n}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "minilm", "input": f"document number {n} about batch inference"}}
        for n in range(20)
    ]
    uploaded = on_one.files.create(
        file=("docs.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()), purpose="batch"
    )
    assert on_other.files.retrieve(uploaded.id).bytes == uploaded.bytes
    with pytest.raises(openai.NotFoundError):  # another tenant's file, on either gateway
        openai_client(other, GLOBEX_KEY).files.retrieve(uploaded.id)
    batch = on_other.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert [b.id for b in on_one.batches.list().data] == [batch.id]
    deadline = time.monotonic() + 120
    while (seen := on_one.batches.retrieve(batch.id)).status != "completed":
        assert seen.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert seen.request_counts is not None and seen.request_counts.completed == 20
    assert seen.output_file_id is not None
    output = [json.loads(line) for line in on_one.files.content(seen.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
    assert all(len(line["response"]["body"]["data"][0]["embedding"]) == 384 for line in output)
    assert output == [json.loads(line) for line in on_other.files.content(seen.output_file_id).text.splitlines()]
    # The upload is listed on either gateway, and deleted through one it is gone from both.
    assert [f.id for f in on_other.files.list()] == [uploaded.id]
    assert on_one.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        on_other.files.retrieve(uploaded.id)
    assert list(on_other.files.list()) == []
