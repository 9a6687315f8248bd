"""The OpenAI Batch API with the official SDK, against `qosgate serve` as a real process
(so it can be killed) and real Triton (smollm2, minilm)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from qosgate.launcher import LocalTriton

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ACME_KEY = "oai-batch-acme-key"
OTHER_KEY = "oai-batch-other-key"
LINES = 200
# Each tenant's uploads kept at once: room for every test's files, and for one of the two
# big ones below, not both.
STORED_BYTES = 100_000


@pytest.fixture
def gateway(triton: LocalTriton, tmp_path: Path) -> Iterator[tuple[GatewayProcess, str]]:
    require_model("smollm2")
    require_model("minilm")
    http = f"127.0.0.1:{free_port()}"
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": "127.0.0.1:0",
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
        "usage_db": str(tmp_path / "usage.sqlite3"),
        "batch": {"db": str(tmp_path / "batch.sqlite3")},
        "openai": {"listen": http, "files_db": str(tmp_path / "openai_files.sqlite3"), "max_stored_bytes": STORED_BYTES},
        "models": {"smollm2": {"default_temperature": 0}},
        "tenants": [
            {"name": "acme", "api_keys": [{"key": ACME_KEY}]},
            {"name": "other", "api_keys": [{"key": OTHER_KEY}], "models": ["minilm"]},
        ],
    }
    with GatewayProcess.running(config, tmp_path) as process:
        yield process, f"http://{http}/v1"


def _client(base_url: str, key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key)


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _chat_line(i: int) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "smollm2", "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 4},
    }


def _wait(client: openai.OpenAI, batch_id: str, done: Any, timeout_s: float = 400) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.5)


def test_200_chat_lines_survive_a_kill_9_with_one_output_line_each(gateway: tuple[GatewayProcess, str]) -> None:
    process, base_url = gateway
    client = _client(base_url)
    uploaded = client.files.create(file=("requests.jsonl", _jsonl([_chat_line(i) for i in range(LINES)])), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == LINES

    # Kill it while some items are done and others are at the model.
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 20)
    process.kill()
    process.start()

    finished = _wait(client, batch.id, lambda b: b.status == "completed")
    assert finished.request_counts.completed == LINES and finished.request_counts.failed == 0
    assert finished.output_file_id is not None and finished.error_file_id is None
    lines = [json.loads(line) for line in client.files.content(finished.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(LINES))
    for line in lines:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_embedding_batch_cancel_and_tenant_isolation(gateway: tuple[GatewayProcess, str]) -> None:
    _, base_url = gateway
    acme, other = _client(base_url), _client(base_url, OTHER_KEY)
    lines = [
        {"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm", "input": [f"text {i}"]}}
        for i in range(3)
    ]
    uploaded = other.files.create(file=("embed.jsonl", _jsonl(lines)), purpose="batch")
    batch = other.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    done = _wait(other, batch.id, lambda b: b.status == "completed")
    assert done.output_file_id is not None
    rows = [json.loads(line) for line in other.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["e-0", "e-1", "e-2"]
    assert all(len(r["response"]["body"]["data"][0]["embedding"]) == 384 for r in rows)

    # Another tenant sees none of it.
    with pytest.raises(openai.NotFoundError):
        acme.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        acme.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        acme.files.content(done.output_file_id)
    assert batch.id not in [b.id for b in acme.batches.list()]

    # A line the tenant may not run refuses the whole batch, naming the line; nothing is queued.
    chat = other.files.create(file=("chat.jsonl", _jsonl([_chat_line(0)])), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError, match="input file line 1: .*may not use model 'smollm2'"):
        other.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="differs from the batch endpoint"):
        other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    # Lines that are no JSON a request can carry: refused as a request body would be.
    good = json.dumps(lines[0]).encode()
    for bad, why in (
        (b"\xff\xfe\x00", "not JSON"),
        (good.replace(b"text 0", b"caf\xe9"), "not JSON"),
        (b"[" * 5000 + b"]" * 5000, "not JSON: nested too deeply"),
        (good.replace(b'"e-0"', b'"e-0", "n": ' + b"1" * 5000), "not JSON"),
        (good.replace(b"text 0", b"\\udc00"), "not JSON text: a string holds an unpaired surrogate"),
    ):
        refused = other.files.create(file=("bad.jsonl", good + b"\n" + bad + b"\n"), purpose="batch")
        with pytest.raises(openai.BadRequestError, match=f"input file line 2: the line is {why}"):
            other.batches.create(input_file_id=refused.id, endpoint="/v1/embeddings", completion_window="24h")
        other.files.delete(refused.id)
    assert [b.id for b in other.batches.list()] == [batch.id]

    # Cancel: nothing more is dispatched; the batch ends cancelled.
    big = acme.files.create(file=("big.jsonl", _jsonl([_chat_line(i) for i in range(100)])), purpose="batch")
    running = acme.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert acme.batches.cancel(running.id).status in ("cancelling", "cancelled")
    cancelled = _wait(acme, running.id, lambda b: b.status == "cancelled", timeout_s=60)
    assert cancelled.request_counts.completed < 100


def test_uploads_are_listed_a_page_at_a_time_and_deleted_by_their_tenant_only(gateway: tuple[GatewayProcess, str]) -> None:
    _, base_url = gateway
    acme, other = _client(base_url), _client(base_url, OTHER_KEY)
    uploads = [acme.files.create(file=(f"in-{i}.jsonl", _jsonl([_chat_line(i)])), purpose="batch") for i in range(3)]
    theirs = other.files.create(file=("theirs.jsonl", _jsonl([_chat_line(9)])), purpose="batch")
    ids = [u.id for u in uploads]

    # Newest first by default, oldest first with order=asc; two pages of two.
    first = acme.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    assert [f.id for f in first.get_next_page().data] == ids[:1]
    assert [f.id for f in acme.files.list(limit=2, order="asc")] == ids  # the SDK follows has_more
    assert [f.id for f in acme.files.list(purpose="batch")] == ids[::-1]
    assert list(acme.files.list(purpose="fine-tune")) == []
    assert [f.id for f in other.files.list()] == [theirs.id]
    with pytest.raises(openai.BadRequestError, match="order"):
        acme.files.list(order="sideways")

    # A batch made from an upload keeps its items once the upload is deleted.
    batch = acme.batches.create(input_file_id=ids[0], endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.files.delete(ids[0])  # another tenant's file is no file
    deleted = acme.files.delete(ids[0])
    assert (deleted.id, deleted.deleted) == (ids[0], True)
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        acme.files.delete(ids[0])
    assert [f.id for f in acme.files.list()] == ids[:0:-1]
    done = _wait(acme, batch.id, lambda b: b.status == "completed")
    assert done.request_counts.completed == 1 and done.input_file_id == ids[0]
    # Output files are the batch's results, not stored uploads: not deletable.
    with pytest.raises(openai.BadRequestError, match="cannot be deleted"):
        acme.files.delete(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(done.output_file_id)
    assert acme.files.content(done.output_file_id).text.count("\n") == 1

    # The storage a tenant's uploads take is bounded: past it, uploads wait for deletes.
    big = acme.files.create(file=("big-1.jsonl", b"x" * (STORED_BYTES * 3 // 5)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="storage limit"):
        acme.files.create(file=("big-2.jsonl", b"x" * (STORED_BYTES * 3 // 5)), purpose="batch")
    assert other.files.create(file=("big.jsonl", b"x" * (STORED_BYTES * 3 // 5)), purpose="batch").bytes  # its own
    acme.files.delete(big.id)
    assert acme.files.create(file=("big-2.jsonl", b"x" * (STORED_BYTES * 3 // 5)), purpose="batch").bytes
