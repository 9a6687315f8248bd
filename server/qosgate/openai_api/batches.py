"""The OpenAI Batch API on the batch jobs of `qosgate.jobs`.

An input file's lines become the same items a BatchService upload makes (checked by the
same `new_item`), so a batch runs, persists, survives a restart and stays the tenant's own
exactly like a gRPC one. The OpenAI-only fields live in the FileStore; output and error
files are rendered from the job's stored results, one line per custom_id.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qosgate import error_table, errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.config import BatchConfig
from qosgate.jobs.model import ItemKind, ItemResult, Job, JobStatus, NewItem
from qosgate.jobs.runner import JobRunner
from qosgate.jobs.store import JobStore
from qosgate.openai_api import wire
from qosgate.openai_api.errors import HTTP_BY_REASON
from qosgate.openai_api.files import BatchLink, FileStore, StoredFile
from qosgate.services.batch import RESULTS_PAGE, job_limits, new_item
from qosgate.v1 import batch_pb2, embedding_pb2, generation_pb2

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Items handed to the job store per transaction while a file is turned into a job.
_ITEMS_PER_WRITE = 500
_OUTPUT, _ERRORS = "-output", "-errors"
_STATUS = {
    JobStatus.QUEUED: "in_progress",
    JobStatus.RUNNING: "in_progress",
    JobStatus.COMPLETED: "completed",
    JobStatus.CANCELLING: "cancelling",
    JobStatus.CANCELLED: "cancelled",
}
_ROW_BY_ERROR = {klass.__name__: row for klass, row in error_table.TABLE.items()}


class BatchCreateRequest(BaseModel):
    """`POST /v1/batches`."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    # OpenAI offers 24h only; jobs here run until done (or cancelled) either way.
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class OpenAIBatches:
    """Files and batches for one tenant at a time; every method takes the caller."""

    def __init__(
        self,
        *,
        files: FileStore,
        jobs: JobStore,
        runner: JobRunner,
        directory: TenantDirectory,
        config: BatchConfig,
        max_file_bytes: int,
        max_stored_bytes: int,
    ) -> None:
        self._files = files
        self._jobs = jobs
        self._runner = runner
        self._directory = directory
        self._config = config
        self._max_file_bytes = max_file_bytes
        self._max_stored_bytes = max_stored_bytes

    # -- files ---------------------------------------------------------------------------

    async def upload(self, tenant: Tenant, *, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        if purpose != "batch":
            raise errors.InvalidArgument(f"purpose {purpose!r} is not supported; use 'batch'")
        if len(content) > self._max_file_bytes:
            raise errors.InvalidArgument(f"file is larger than {self._max_file_bytes} bytes")
        stored = await self._files.add_file(
            tenant.name, purpose=purpose, filename=filename, content=content, max_stored_bytes=self._max_stored_bytes
        )
        return _file_json(stored)

    async def file(self, tenant: Tenant, file_id: str) -> dict[str, Any]:
        job_id, suffix = _output_of(file_id)
        if job_id is None:
            return _file_json(await self._files.get_file(tenant.name, file_id))
        job = await self._jobs.get_job(tenant.name, job_id)
        content = await self.file_content(tenant, file_id)
        return {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(job.finished_at or job.created_at),
            "filename": f"{job_id}{suffix}.jsonl",
            "purpose": "batch_output",
            "status": "processed",
        }

    async def list_files(
        self, tenant: Tenant, *, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> dict[str, Any]:
        """The tenant's uploaded files, a page at a time (output and error files are not
        stored: each batch names its own)."""
        # One more than asked tells whether another page exists.
        stored = await self._files.list_files(
            tenant.name, purpose=purpose, limit=limit + 1, after_id=after, ascending=ascending
        )
        return _page([_file_json(file) for file in stored[:limit]], has_more=len(stored) > limit)

    async def delete_file(self, tenant: Tenant, file_id: str) -> dict[str, Any]:
        job_id, _ = _output_of(file_id)
        if job_id is not None:
            await self._jobs.get_job(tenant.name, job_id)  # NotFound where it is not the tenant's
            raise errors.InvalidArgument(
                f"{file_id!r} is rendered from batch {job_id!r}'s results, not stored: it cannot be deleted"
            )
        await self._files.delete_file(tenant.name, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, tenant: Tenant, file_id: str) -> bytes:
        job_id, suffix = _output_of(file_id)
        if job_id is None:
            return await self._files.content(tenant.name, file_id)
        link = await self._files.batch_link(tenant.name, job_id)
        job = await self._jobs.get_job(tenant.name, job_id)
        lines = [
            json.dumps(_result_line(link.endpoint, job.model, result)) + "\n"
            async for result in self._results(tenant, job_id)
            if (result.error is None) == (suffix == _OUTPUT)
        ]
        return "".join(lines).encode()

    async def _results(self, tenant: Tenant, job_id: str) -> AsyncIterator[ItemResult]:
        offset = 0
        while True:
            page = await self._jobs.results(tenant.name, job_id, offset=offset, limit=RESULTS_PAGE)
            for result in page:
                yield result
            offset += len(page)
            if len(page) < RESULTS_PAGE:
                return

    # -- batches -------------------------------------------------------------------------

    async def create(self, tenant: Tenant, request: BatchCreateRequest) -> dict[str, Any]:
        items, model = self._items(tenant, request, await self._files.content(tenant.name, request.input_file_id))
        limits = job_limits(self._config, tenant.name)
        job_id = await self._jobs.begin_job(
            tenant.name, model=model, description="openai batch", callback_url="", limits=limits
        )
        try:
            # Linked before it is sealed: a sealed job is never without its OpenAI fields.
            await self._files.link_batch(
                tenant.name,
                BatchLink(job_id, request.input_file_id, request.endpoint, request.completion_window, request.metadata or {}),
            )
            for start in range(0, len(items), _ITEMS_PER_WRITE):
                await self._jobs.add_items(job_id, items[start : start + _ITEMS_PER_WRITE], limits=limits)
            job = await self._jobs.seal_job(job_id)
        except BaseException:
            await self._jobs.discard_job(job_id)
            await self._files.unlink_batch(job_id)
            raise
        self._runner.notify()
        return self._batch_json(job, await self._files.batch_link(tenant.name, job_id))

    def _items(self, tenant: Tenant, request: BatchCreateRequest, content: bytes) -> tuple[list[NewItem], str]:
        """The input file's lines (`content`) as job items, and the model when they all name one."""
        items: list[NewItem] = []
        models: set[str] = set()
        for number, raw in enumerate(content.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                line = wire.parse(_Line, wire.loads(raw, "the line"))
                if line.url != request.endpoint:
                    raise errors.InvalidArgument(f"url {line.url!r} differs from the batch endpoint {request.endpoint!r}")
                item = _batch_item(line)
                items.append(
                    new_item(len(items), item, batch_pb2.BatchHeader(), tenant, self._directory.require_model)
                )
            except (errors.InvalidArgument, errors.PermissionDenied) as e:
                raise type(e)(f"input file line {number}: {e.message}") from None
            models.add(item.embed.model if item.HasField("embed") else item.generate.model)
        if not items:
            raise errors.InvalidArgument("the input file has no requests")
        return items, models.pop() if len(models) == 1 else ""

    async def get(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        link = await self._files.batch_link(tenant.name, batch_id)
        return self._batch_json(await self._jobs.get_job(tenant.name, batch_id), link)

    async def list_batches(self, tenant: Tenant, *, limit: int, after: str | None) -> dict[str, Any]:
        # One more than asked tells whether another page exists.
        links = await self._files.batch_links(tenant.name, limit=limit + 1, after_id=after)
        data = []
        for link in links[:limit]:
            try:
                data.append(self._batch_json(await self._jobs.get_job(tenant.name, link.job_id), link))
            except errors.NotFound:
                continue  # past its retention: the job store dropped it
        return _page(data, has_more=len(links) > limit)

    async def cancel(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        link = await self._files.batch_link(tenant.name, batch_id)
        return self._batch_json(await self._runner.cancel(tenant.name, batch_id), link)

    @staticmethod
    def _batch_json(job: Job, link: BatchLink) -> dict[str, Any]:
        c = job.counts
        finished = job.status.finished
        return {
            "id": job.id,
            "object": "batch",
            "endpoint": link.endpoint,
            "errors": None,
            "input_file_id": link.input_file_id,
            "completion_window": link.completion_window,
            "status": _STATUS[job.status],
            "output_file_id": f"file-{job.id}{_OUTPUT}" if finished and c.succeeded else None,
            "error_file_id": f"file-{job.id}{_ERRORS}" if finished and c.failed else None,
            "created_at": int(job.created_at),
            "in_progress_at": _seconds(job.started_at),
            "completed_at": _seconds(job.finished_at) if job.status is JobStatus.COMPLETED else None,
            "cancelled_at": _seconds(job.finished_at) if job.status is JobStatus.CANCELLED else None,
            "request_counts": {"total": c.total, "completed": c.succeeded, "failed": c.failed},
            "metadata": link.metadata,
        }


def _batch_item(line: _Line) -> batch_pb2.BatchItem:
    if line.url == "/v1/embeddings":
        embed = wire.parse(wire.EmbeddingRequest, line.body)
        if embed.encoding_format != "float" or embed.dimensions is not None:
            raise errors.InvalidArgument("batch embeddings support encoding_format 'float' only")
        return batch_pb2.BatchItem(custom_id=line.custom_id, embed=embed.embed_request())
    body: wire.ChatCompletionRequest | wire.CompletionRequest
    if line.url == "/v1/chat/completions":
        body = wire.parse(wire.ChatCompletionRequest, line.body)
    elif line.url == "/v1/completions":
        body = wire.parse(wire.CompletionRequest, line.body)
    else:
        raise errors.InvalidArgument(f"url must be one of {', '.join(ENDPOINTS)}")
    if body.stream:
        raise errors.InvalidArgument("stream is not allowed in a batch")
    return batch_pb2.BatchItem(custom_id=line.custom_id, generate=body.generate_request())


def _result_line(endpoint: str, model: str, result: ItemResult) -> dict[str, Any]:
    request_id = f"batch_req_{result.offset}"
    if result.error is not None:
        row = _ROW_BY_ERROR.get(result.error.kind, error_table.INTERNAL)
        http = HTTP_BY_REASON[row.reason]
        error = {"message": result.error.message, "type": http.type, "param": None, "code": row.reason}
        response = {"status_code": http.status, "request_id": request_id, "body": {"error": error}}
    else:
        response = {"status_code": 200, "request_id": request_id, "body": _body(endpoint, model, result)}
    return {"id": request_id, "custom_id": result.custom_id, "response": response, "error": None}


def _body(endpoint: str, model: str, result: ItemResult) -> dict[str, Any]:
    created = int(result.completed_at)
    if result.kind is ItemKind.EMBED:
        return wire.embeddings_of_response(model, embedding_pb2.EmbedResponse.FromString(result.payload or b""))
    response = generation_pb2.GenerateResponse.FromString(result.payload or b"")
    chat = endpoint == "/v1/chat/completions"
    return wire.completion_of_response(chat, f"batch-{result.offset}", model, created, response)


def _output_of(file_id: str) -> tuple[str | None, str]:
    """(job id, suffix) of an output or error file id; (None, "") for an uploaded file."""
    for suffix in (_OUTPUT, _ERRORS):
        if file_id.startswith("file-batch_") and file_id.endswith(suffix):
            return file_id[len("file-") : -len(suffix)], suffix
    return None, ""


def _page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A page of a cursor-paged list, as the OpenAI API answers one."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _file_json(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": int(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
    }


def _seconds(value: float | None) -> int | None:
    return None if value is None else int(value)
