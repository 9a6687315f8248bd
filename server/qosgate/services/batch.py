"""`qosgate.v1.BatchService`: jobs of many generation or embedding requests.

The servicer parses and checks items, applies the header's defaults and hands the domain
(`qosgate.jobs`) serialized requests; it reads results back as the serialized responses
the runner stored. Uploads stream into the store chunk by chunk and become visible only
when the client's stream ends cleanly, so a bad item anywhere queues nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import timestamp_pb2

from qosgate import error_table, errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.config import BatchConfig
from qosgate.jobs.callbacks import CallbackPolicy
from qosgate.jobs.model import ItemKind, ItemResult, Job, JobLimits, JobStatus, NewItem
from qosgate.jobs.runner import JobRunner
from qosgate.jobs.store import JobStore
from qosgate.v1 import batch_pb2, embedding_pb2, generation_pb2
from qosgate.v1_converters import to_call

DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
# Results sent per store read, and how often a follower looks for new ones.
RESULTS_PAGE = 200
FOLLOW_POLL_S = 0.25
# Offsets are stored as signed 64-bit integers; the proto's uint64 allows more.
MAX_OFFSET = 2**63 - 1

_STATUS = {
    JobStatus.QUEUED: batch_pb2.BATCH_STATUS_QUEUED,
    JobStatus.RUNNING: batch_pb2.BATCH_STATUS_RUNNING,
    JobStatus.COMPLETED: batch_pb2.BATCH_STATUS_COMPLETED,
    JobStatus.CANCELLING: batch_pb2.BATCH_STATUS_CANCELLING,
    JobStatus.CANCELLED: batch_pb2.BATCH_STATUS_CANCELLED,
}
# The runner records a failed item's domain error by class name; the one error table
# gives its gRPC code.
_CODE_BY_ERROR = {klass.__name__: row.code for klass, row in error_table.TABLE.items()}


def job_limits(config: BatchConfig, tenant: str) -> JobLimits:
    """The batch limits of `tenant`: its overrides, else the defaults."""
    override = config.tenants.get(tenant)
    queued = override.max_queued_items if override and override.max_queued_items else None
    hours = override.retention_hours if override and override.retention_hours else None
    return JobLimits(
        max_queued_items=queued or config.max_queued_items,
        retention_s=(hours or config.retention_hours) * 3600.0,
    )


def _timestamp(seconds: float | None) -> timestamp_pb2.Timestamp | None:
    if seconds is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def batch_message(job: Job) -> batch_pb2.Batch:
    """The wire form of a job."""
    c = job.counts
    return batch_pb2.Batch(
        id=job.id,
        status=_STATUS[job.status],
        counts=batch_pb2.BatchCounts(
            total=c.total, succeeded=c.succeeded, failed=c.failed, cancelled=c.cancelled
        ),
        model=job.model,
        description=job.description,
        callback_url=job.callback_url,
        created_at=_timestamp(job.created_at),
        started_at=_timestamp(job.started_at),
        finished_at=_timestamp(job.finished_at),
        expires_at=_timestamp(job.expires_at),
    )


def _with_defaults(
    request: generation_pb2.GenerateRequest, header: batch_pb2.BatchHeader
) -> generation_pb2.GenerateRequest:
    merged = generation_pb2.GenerateRequest()
    merged.CopyFrom(request)
    if not merged.model:
        merged.model = header.model
    defaults = header.sampling
    for field, value in defaults.ListFields():
        if field.name == "stop":
            if not merged.sampling.stop:
                merged.sampling.stop.extend(value)
        elif not merged.sampling.HasField(field.name):
            setattr(merged.sampling, field.name, value)
    # Items always run at the batch class: whatever a line asks for is dropped.
    merged.priority_class = ""
    return merged


def new_item(
    index: int,
    item: batch_pb2.BatchItem,
    header: batch_pb2.BatchHeader,
    tenant: Tenant,
    require_model: Callable[[Tenant, str], None],
) -> NewItem:
    """Check one submitted item and turn it into what the store keeps; errors name the
    item by position and custom_id."""
    where = f"item {index} (custom_id {item.custom_id!r})"
    kind = item.WhichOneof("request")
    try:
        if not item.custom_id:
            raise errors.InvalidArgument("custom_id is empty")
        if kind == "generate":
            request = _with_defaults(item.generate, header)
            if not request.model:
                raise errors.InvalidArgument("model is empty and the header names none")
            # Checked as the call will be when it runs: the job is all or nothing.
            to_call(request, stream=False).check()
            require_model(tenant, request.model)
            return NewItem(item.custom_id, ItemKind.GENERATE, request.SerializeToString())
        if kind == "embed":
            embed = embedding_pb2.EmbedRequest()
            embed.CopyFrom(item.embed)
            embed.model = embed.model or header.model
            embed.priority_class = ""
            if not embed.model:
                raise errors.InvalidArgument("model is empty and the header names none")
            if not embed.inputs:
                raise errors.InvalidArgument("embed.inputs is empty")
            require_model(tenant, embed.model)
            return NewItem(item.custom_id, ItemKind.EMBED, embed.SerializeToString())
        raise errors.InvalidArgument("set either generate or embed")
    except errors.InvalidArgument as e:
        raise errors.InvalidArgument(f"{where}: {e.message}") from None
    except errors.PermissionDenied as e:
        raise errors.PermissionDenied(f"{where}: {e.message}") from None


def result_message(result: ItemResult) -> batch_pb2.StreamBatchResultsResponse:
    """The wire form of a stored result."""
    reply = batch_pb2.StreamBatchResultsResponse(
        offset=result.offset,
        custom_id=result.custom_id,
        attempts=result.attempts,
        completed_at=_timestamp(result.completed_at),
    )
    if result.error is not None:
        reply.error.code = _CODE_BY_ERROR.get(result.error.kind, "INTERNAL")
        reply.error.message = result.error.message
    elif result.kind is ItemKind.GENERATE:
        reply.generation.ParseFromString(result.payload or b"")
    else:
        reply.embedding.ParseFromString(result.payload or b"")
    return reply


class BatchService:
    """Thin edge over JobStore and JobRunner; every RPC acts as the calling tenant (served
    through `edge`, which identifies it)."""

    def __init__(
        self,
        *,
        directory: TenantDirectory,
        store: JobStore,
        runner: JobRunner,
        config: BatchConfig,
    ) -> None:
        self._directory = directory
        self._store = store
        self._runner = runner
        self._config = config
        self._callbacks = CallbackPolicy(config.callback_allowlist)

    async def CreateBatch(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        chunks: AsyncIterator[batch_pb2.CreateBatchRequest],
        context: grpc.aio.ServicerContext,
    ) -> batch_pb2.CreateBatchResponse:
        job = await self._create(tenant, chunks)
        self._runner.notify()
        return batch_pb2.CreateBatchResponse(batch=batch_message(job))

    async def _create(
        self, tenant: Tenant, chunks: AsyncIterator[batch_pb2.CreateBatchRequest]
    ) -> Job:
        first = await anext(aiter(chunks), None)
        if first is None or first.WhichOneof("chunk") != "header":
            raise errors.InvalidArgument("the first CreateBatch message must carry the header")
        header = first.header
        if header.callback_url:
            self._callbacks.check(header.callback_url)
        limits = job_limits(self._config, tenant.name)
        job_id = await self._store.begin_job(
            tenant.name,
            model=header.model,
            description=header.description,
            callback_url=header.callback_url,
            limits=limits,
        )
        try:
            index = 0
            async for chunk in chunks:
                if chunk.WhichOneof("chunk") != "items":
                    raise errors.InvalidArgument(
                        "only the first CreateBatch message may carry a header"
                    )
                items = []
                for item in chunk.items.items:
                    items.append(
                        new_item(index, item, header, tenant, self._directory.require_model)
                    )
                    index += 1
                await self._store.add_items(job_id, items, limits=limits)
            return await self._store.seal_job(job_id)
        except BaseException:
            # Including the caller going away mid-upload: nothing of it is queued.
            await self._store.discard_job(job_id)
            raise

    async def GetBatch(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: batch_pb2.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.GetBatchResponse:
        job = await self._store.get_job(tenant.name, request.batch_id)
        return batch_pb2.GetBatchResponse(batch=batch_message(job))

    async def ListBatches(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: batch_pb2.ListBatchesRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.ListBatchesResponse:
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        # One more than asked tells whether another page exists.
        jobs = await self._store.list_jobs(tenant.name, limit=size + 1, after_id=request.page_token or None)
        page = jobs[:size]
        return batch_pb2.ListBatchesResponse(
            batches=[batch_message(j) for j in page],
            next_page_token=page[-1].id if len(jobs) > size else "",
        )

    async def CancelBatch(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: batch_pb2.CancelBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.CancelBatchResponse:
        job = await self._runner.cancel(tenant.name, request.batch_id)
        return batch_pb2.CancelBatchResponse(batch=batch_message(job))

    async def StreamBatchResults(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: batch_pb2.StreamBatchResultsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[batch_pb2.StreamBatchResultsResponse]:
        if request.offset > MAX_OFFSET:
            raise errors.InvalidArgument(f"offset must be at most {MAX_OFFSET}")
        offset = request.offset
        while True:
            # Read the status first: results recorded before a job finished are all
            # visible once it reads as finished, so the last read misses none.
            finished = (await self._store.get_job(tenant.name, request.batch_id)).status.finished
            results = await self._store.results(tenant.name, request.batch_id, offset=offset, limit=RESULTS_PAGE)
            for result in results:
                yield result_message(result)
            offset += len(results)
            if len(results) == RESULTS_PAGE:
                continue
            if finished or not request.follow:
                return
            await asyncio.sleep(FOLLOW_POLL_S)
