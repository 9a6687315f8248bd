"""The usage ledger: one SQLite row per finished LLM request, per-day totals per tenant.

It is what the daily token budget counts against, so it must survive a gateway restart
and a kill -9. Durability choice: WAL journal with synchronous=NORMAL. In WAL mode a
commit is appended to the -wal file before `commit()` returns, so a killed process loses
nothing it committed (the OS still holds the write); only an OS crash or power loss can
drop the last commits, which then count like requests that were in flight. FULL would
add an fsync per request (milliseconds on the hot path of every generation) to cover
that case as well, which a usage meter does not need.

Totals per (tenant, UTC day) are kept in memory, loaded from the rows of the current
day when first asked, so budget checks cost no query.

`UsageMeter` is what the rest of the gateway records to and asks: the ledger alone, or,
with several gateways on one Redis quota store, the ledger plus day totals kept in Redis,
so that a daily budget and GetUsage's `today` count every gateway's requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from qosgate.auth import Tenant
from qosgate.clock import utc_day
from qosgate.database import open_database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    day TEXT NOT NULL,               -- UTC day of finished_at, YYYY-MM-DD
    finished_at REAL NOT NULL,       -- Unix seconds
    model TEXT NOT NULL,
    request_id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_by_tenant_day ON usage (tenant, day);
CREATE INDEX IF NOT EXISTS usage_by_tenant_time ON usage (tenant, finished_at);
"""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """The usage of one finished (completed, stopped or cancelled) request."""

    tenant: str
    model: str
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True, slots=True)
class UsageSummary:
    """Requests and tokens of one tenant over a period."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, record: UsageRecord) -> UsageSummary:
        return UsageSummary(
            self.requests + 1,
            self.prompt_tokens + record.prompt_tokens,
            self.completion_tokens + record.completion_tokens,
        )


@dataclass(frozen=True, slots=True)
class UsageReport:
    """A tenant's usage today and in the last minute, against its token limits."""

    tenant: str
    day: str
    today: UsageSummary
    this_minute: UsageSummary
    daily_token_budget: int | None
    remaining_daily_tokens: int | None
    tokens_per_minute: int | None


class UsageLedger:
    """Persistent per-request usage in one SQLite file; safe to share between threads."""

    def __init__(self, path: Path | str, *, wall_time: Callable[[], float]) -> None:
        """Open (creating if needed) the ledger at `path`; `wall_time` gives Unix seconds."""
        self._wall_time = wall_time
        # One connection behind a lock: writes are tiny and serialized anyway, and the
        # batch runner may record from another thread.
        self._db = open_database(path, _SCHEMA)
        self._lock = threading.Lock()
        self._day_totals: dict[tuple[str, str], UsageSummary] = {}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def record(self, record: UsageRecord) -> None:
        """Persist one request's usage (committed when this returns)."""
        now = self._wall_time()
        day = utc_day(now)
        with self._lock:
            self._db.execute(
                "INSERT INTO usage (tenant, day, finished_at, model, request_id, prompt_tokens,"
                " completion_tokens, finish_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.tenant,
                    day,
                    now,
                    record.model,
                    record.request_id,
                    record.prompt_tokens,
                    record.completion_tokens,
                    record.finish_reason,
                ),
            )
            key = (record.tenant, day)
            if key in self._day_totals:
                self._day_totals[key] = self._day_totals[key].plus(record)

    def day_summary(self, tenant: str, day: str) -> UsageSummary:
        """What `tenant` used on the UTC `day` (YYYY-MM-DD)."""
        key = (tenant, day)
        with self._lock:
            summary = self._day_totals.get(key)
            if summary is None:
                summary = self._summary("tenant = ? AND day = ?", (tenant, day))
                # Only the current day keeps changing; older days are read on demand.
                if day == utc_day(self._wall_time()):
                    self._day_totals = {k: v for k, v in self._day_totals.items() if k[1] == day}
                    self._day_totals[key] = summary
            return summary

    def recent_summary(self, tenant: str, seconds: float) -> UsageSummary:
        """What `tenant` used in the last `seconds` (by finish time)."""
        since = self._wall_time() - seconds
        with self._lock:
            return self._summary("tenant = ? AND finished_at >= ?", (tenant, since))

    def _summary(self, where: str, args: tuple[object, ...]) -> UsageSummary:
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0)"
            f" FROM usage WHERE {where}",
            args,
        ).fetchone()
        return UsageSummary(int(row[0]), int(row[1]), int(row[2]))


class SharedDayUsage(Protocol):
    """Per-day usage that every gateway adds to and reads (the Redis quota store)."""

    async def record_day_usage(self, tenant: str, day: str, record: UsageRecord) -> None: ...

    async def day_usage(self, tenant: str, day: str) -> UsageSummary | None:
        """None when the shared store cannot answer and the local count should stand in."""
        ...


class UsageMeter:
    """Where finished requests are recorded and the day's usage is read.

    Every request goes to this gateway's ledger. With `shared`, it is also added to the
    day totals all gateways share, and those are the ones budgets and reports count.
    """

    def __init__(
        self, ledger: UsageLedger, *, wall_time: Callable[[], float], shared: SharedDayUsage | None = None
    ) -> None:
        self._ledger = ledger
        self._wall_time = wall_time
        self._shared = shared

    async def record(self, record: UsageRecord) -> None:
        """Count one finished request (in the ledger first: it is what survives a crash)."""
        self._ledger.record(record)
        if self._shared is not None:
            await self._shared.record_day_usage(record.tenant, utc_day(self._wall_time()), record)

    async def day_summary(self, tenant: str, day: str) -> UsageSummary:
        """What `tenant` used on the UTC `day`: on every gateway when shared."""
        own = self._ledger.day_summary(tenant, day)
        if self._shared is not None:
            summary = await self._shared.day_usage(tenant, day)
            # Every gateway together cannot have used less than this one alone: a smaller
            # shared count means the store lost the day (a Redis restart without its file).
            if summary is not None and summary.total_tokens >= own.total_tokens:
                return summary
        return own

    async def tokens_used(self, tenant: str, day: str) -> int:
        """Prompt + completion tokens of `tenant` on `day` (the daily budget's count)."""
        return (await self.day_summary(tenant, day)).total_tokens

    async def report(self, tenant: Tenant) -> UsageReport:
        """What `tenant` used today (UTC) and in the last 60 s, and what its budget has left.

        The last minute is this gateway's own count: tokens_per_minute is enforced by the
        quota store, this figure only shows the recent traffic.
        """
        day = utc_day(self._wall_time())
        today = await self.day_summary(tenant.name, day)
        budget = tenant.limits.daily_token_budget
        return UsageReport(
            tenant=tenant.name,
            day=day,
            today=today,
            this_minute=self._ledger.recent_summary(tenant.name, 60.0),
            daily_token_budget=budget,
            remaining_daily_tokens=None if budget is None else max(0, budget - today.total_tokens),
            tokens_per_minute=tenant.limits.tokens_per_minute,
        )
