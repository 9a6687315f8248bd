"""The values batch jobs are made of, free of protos and SQL."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class JobStatus(enum.Enum):
    """Lifecycle of a job; UPLOADING jobs are still being streamed in and are invisible."""

    UPLOADING = "uploading"
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.CANCELLED)


class ItemKind(enum.Enum):
    """Which API an item's payload is a request of."""

    GENERATE = "generate"
    EMBED = "embed"


@dataclass(frozen=True, slots=True)
class NewItem:
    """An item as submitted: `payload` is the serialized request, defaults already applied."""

    custom_id: str
    kind: ItemKind
    payload: bytes


@dataclass(frozen=True, slots=True)
class JobCounts:
    """Items of a job by state; pending + running + the rest = total."""

    total: int = 0
    pending: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0


@dataclass(frozen=True, slots=True)
class Job:
    """A job as stored; times are Unix seconds (they must survive restarts)."""

    id: str
    tenant: str
    status: JobStatus
    model: str
    description: str
    callback_url: str
    counts: JobCounts
    created_at: float
    started_at: float | None
    finished_at: float | None
    expires_at: float | None  # set when the job finishes: finished_at + retention


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item the runner took for dispatch; `attempt` counts this dispatch (1 = first);
    `lease_token` names this claim (only its holder may record the item's result);
    `job_created_at` starts its job's completion window."""

    job_id: str
    seq: int
    tenant: str
    custom_id: str
    kind: ItemKind
    payload: bytes
    attempt: int
    lease_token: str
    job_created_at: float


@dataclass(frozen=True, slots=True)
class ItemError:
    """Why an item failed for good: the domain error's class name and its public message."""

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One stored result; `offset` is its position in the job's completion order."""

    offset: int
    custom_id: str
    kind: ItemKind
    payload: bytes | None
    error: ItemError | None
    attempts: int
    completed_at: float


@dataclass(frozen=True, slots=True)
class JobLimits:
    """A tenant's batch limits: items it may have waiting, how long jobs are kept."""

    max_queued_items: int
    retention_s: float
