"""The callback allowlist matches scheme, host, port and a path prefix at a `/` boundary;
the HTTP sender POSTs the job as JSON to a real local HTTP server."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from qosgate.errors import InvalidArgument
from qosgate.jobs.callbacks import CallbackPolicy, HttpCallbackSender
from qosgate.jobs.model import Job, JobCounts, JobStatus

POLICY = CallbackPolicy(["https://hooks.example.com/qosgate/", "http://127.0.0.1:8080"])


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/qosgate/",
        "https://hooks.example.com/qosgate/job-done?x=1",
        "https://HOOKS.example.com/qosgate/a/b",
        "http://127.0.0.1:8080/anything",
    ],
)
def test_allowed(url: str) -> None:
    POLICY.check(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example.com/qosgate/x",  # scheme differs
        "https://hooks.example.com/qosgatex/x",  # prefix without a / boundary
        "https://hooks.example.com.evil.net/qosgate/x",  # host suffix trick
        "https://hooks.example.com:444/qosgate/x",  # port differs
        "http://127.0.0.1:8001/",  # Triton's port on the same host
        "ftp://127.0.0.1:8080/x",
        "not a url",
    ],
)
def test_refused(url: str) -> None:
    with pytest.raises(InvalidArgument):
        POLICY.check(url)


def test_empty_allowlist_refuses_everything() -> None:
    with pytest.raises(InvalidArgument, match="allowlist"):
        CallbackPolicy([]).check("https://hooks.example.com/qosgate/")


async def test_http_sender_posts_the_job_as_json() -> None:
    received: list[tuple[str, dict[str, object]]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/hooks/done"
        job = Job(
            id="batch_1",
            tenant="acme",
            status=JobStatus.COMPLETED,
            model="m",
            description="nightly",
            callback_url=url,
            counts=JobCounts(total=3, succeeded=2, failed=1),
            created_at=1.0,
            started_at=2.0,
            finished_at=3.0,
            expires_at=4.0,
        )
        assert await HttpCallbackSender(timeout_s=5).send(job)
        refused = dataclasses.replace(job, callback_url="http://127.0.0.1:9/closed")
        assert not await HttpCallbackSender(timeout_s=5).send(refused)
    finally:
        server.shutdown()
    ((path, body),) = received
    assert path == "/hooks/done"
    assert body["id"] == "batch_1" and body["status"] == "completed"
    assert body["counts"] == {"total": 3, "succeeded": 2, "failed": 1, "cancelled": 0}
    assert "tenant" not in body
