"""Completion callbacks: which URLs a job may name, and the POST made when it ends.

The allowlist exists because the gateway would otherwise make requests on a tenant's
behalf to any address it can reach (its own loopback Triton included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from qosgate.errors import InvalidArgument
from qosgate.jobs.model import Job

log = logging.getLogger(__name__)


class CallbackPolicy:
    """Allows a callback URL only under one of the configured URL prefixes: same scheme,
    same host and port, and a path that starts with the prefix's path at a `/` boundary."""

    def __init__(self, allowed_prefixes: Sequence[str]) -> None:
        self._allowed = tuple(urlsplit(p) for p in allowed_prefixes)

    def check(self, url: str) -> None:
        """Raises InvalidArgument unless `url` may be called."""
        try:
            parts = urlsplit(url)
        except ValueError:  # e.g. "http://[": an unclosed IPv6 literal
            raise InvalidArgument(f"callback_url {url!r} is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"callback_url {url!r} is not an absolute http(s) URL")
        for allowed in self._allowed:
            base = allowed.path.rstrip("/")
            if (
                parts.scheme == allowed.scheme
                and parts.netloc.lower() == allowed.netloc.lower()
                and (parts.path == base or parts.path.startswith(base + "/"))
            ):
                return
        raise InvalidArgument(f"callback_url {url!r} is not in the gateway's callback allowlist")


def job_document(job: Job) -> dict[str, object]:
    """The JSON body of a completion callback."""
    return {
        "id": job.id,
        "status": job.status.value,
        "description": job.description,
        "counts": {
            "total": job.counts.total,
            "succeeded": job.counts.succeeded,
            "failed": job.counts.failed,
            "cancelled": job.counts.cancelled,
        },
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }


class CallbackSender(Protocol):
    """Delivers a finished job to its callback URL; returns whether it was accepted."""

    async def send(self, job: Job) -> bool: ...


class HttpCallbackSender:
    """POSTs the job as JSON with urllib in a worker thread (a 2xx answer counts as done)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s

    async def send(self, job: Job) -> bool:
        return await asyncio.to_thread(self._post, job)

    def _post(self, job: Job) -> bool:
        request = urllib.request.Request(
            job.callback_url,
            data=json.dumps(job_document(job)).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                return 200 <= response.status < 300
        except OSError as error:
            log.warning("callback for batch %s failed: %s", job.id, error)
            return False
