"""The usage ledger (persistence across reopen and kill -9, per-day and recent totals) and
the usage meter in front of it (local, or with day totals shared by all gateways)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qosgate.quota.tokens import utc_day
from qosgate.usage import UsageLedger, UsageMeter, UsageRecord, UsageSummary

from tests.fakes import FakeWall, make_tenant

DAY0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC



def record(tenant: str = "acme", prompt: int = 10, completion: int = 5, request_id: str = "r") -> UsageRecord:
    return UsageRecord(tenant, "smollm2", request_id, prompt, completion, "stop")


def test_day_totals_survive_reopen(tmp_path: Path) -> None:
    wall = FakeWall(DAY0 + 3600)
    ledger = UsageLedger(tmp_path / "usage.sqlite3", wall_time=wall)
    for i in range(3):
        ledger.record(record(prompt=10 + i, completion=i, request_id=f"r{i}"))
    ledger.record(record(tenant="globex"))
    summary = ledger.day_summary("acme", "2026-01-01")
    assert (summary.requests, summary.prompt_tokens, summary.completion_tokens) == (3, 33, 3)
    ledger.close()
    reopened = UsageLedger(tmp_path / "usage.sqlite3", wall_time=wall)
    assert reopened.day_summary("acme", "2026-01-01").total_tokens == 36
    assert reopened.day_summary("globex", "2026-01-01").total_tokens == 15
    reopened.close()


def test_cached_total_follows_new_records(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.db", wall_time=FakeWall(DAY0 + 60))
    assert ledger.day_summary("acme", "2026-01-01").total_tokens == 0  # loads (and caches) the day
    ledger.record(record())
    ledger.record(record())
    assert ledger.day_summary("acme", "2026-01-01").total_tokens == 30


def test_days_are_utc_days(tmp_path: Path) -> None:
    wall = FakeWall(DAY0 - 1)  # 2025-12-31 23:59:59 UTC
    ledger = UsageLedger(tmp_path / "u.db", wall_time=wall)
    ledger.record(record())
    wall.now = DAY0 + 1
    ledger.record(record(prompt=1, completion=1))
    assert ledger.day_summary("acme", "2025-12-31").total_tokens == 15
    assert ledger.day_summary("acme", utc_day(wall.now)).total_tokens == 2


def test_recent_summary_is_a_sliding_window(tmp_path: Path) -> None:
    wall = FakeWall(DAY0 + 1000)
    ledger = UsageLedger(tmp_path / "u.db", wall_time=wall)
    ledger.record(record(prompt=100, completion=0))
    wall.now += 30
    ledger.record(record(prompt=1, completion=2))
    wall.now += 45  # the first record is 75 s old now
    recent = ledger.recent_summary("acme", 60)
    assert (recent.requests, recent.total_tokens) == (1, 3)


def test_durability_settings(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.db", wall_time=FakeWall(DAY0))
    probe = sqlite3.connect(tmp_path / "u.db")
    assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    probe.close()
    ledger.close()


_WRITER = textwrap.dedent(
    """
    import sys, time
    from qosgate.usage import UsageLedger, UsageRecord
    ledger = UsageLedger(sys.argv[1], wall_time=time.time)
    i = 0
    while True:
        ledger.record(UsageRecord("acme", "m", f"r{i}", 7, 3, "stop"))
        i += 1
        print(i, flush=True)  # acknowledged: record() returned
    """
)


@pytest.mark.timeout(60)
def test_acknowledged_records_survive_kill_9(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite3"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    acknowledged = 0
    for line in writer.stdout:
        acknowledged = int(line)
        if acknowledged >= 200:
            break
    os.kill(writer.pid, signal.SIGKILL)  # mid-write, no chance to checkpoint or close
    writer.wait()
    ledger = UsageLedger(db, wall_time=time.time)
    summary = ledger.day_summary("acme", utc_day(time.time()))
    # Every acknowledged record is there; at most the one being written after the last
    # acknowledgement (plus whatever was in the pipe buffer) may be too.
    assert summary.requests >= acknowledged
    assert summary.total_tokens == summary.requests * 10


class FakeSharedDays:
    """Day totals shared by gateways, as a dict; `reachable=False` answers like an outage
    with on_error allow (None)."""

    def __init__(self) -> None:
        self.days: dict[tuple[str, str], UsageSummary] = {}
        self.reachable = True

    async def record_day_usage(self, tenant: str, day: str, record: UsageRecord) -> None:
        self.days[(tenant, day)] = self.days.get((tenant, day), UsageSummary()).plus(record)

    async def day_usage(self, tenant: str, day: str) -> UsageSummary | None:
        return self.days.get((tenant, day), UsageSummary()) if self.reachable else None


async def test_a_local_meter_counts_the_ledger(tmp_path: Path) -> None:
    wall = FakeWall(DAY0 + 3600)
    ledger = UsageLedger(tmp_path / "u.db", wall_time=wall)
    meter = UsageMeter(ledger, wall_time=wall)
    await meter.record(record(prompt=10, completion=5))
    assert await meter.tokens_used("acme", "2026-01-01") == 15
    report = await meter.report(make_tenant("acme", limits={"daily_token_budget": 100}))
    assert (report.day, report.today.total_tokens, report.remaining_daily_tokens) == ("2026-01-01", 15, 85)


async def test_a_shared_meter_counts_every_gateway_and_falls_back_to_its_ledger(tmp_path: Path) -> None:
    wall, shared = FakeWall(DAY0 + 3600), FakeSharedDays()
    ours = UsageMeter(UsageLedger(tmp_path / "a.db", wall_time=wall), wall_time=wall, shared=shared)
    theirs = UsageMeter(UsageLedger(tmp_path / "b.db", wall_time=wall), wall_time=wall, shared=shared)
    await ours.record(record(prompt=10, completion=5))
    await theirs.record(record(prompt=100, completion=20))
    # Both gateways see the day's 135 tokens; each ledger keeps its own requests.
    assert await ours.tokens_used("acme", "2026-01-01") == 135
    report = await theirs.report(make_tenant("acme", limits={"daily_token_budget": 200}))
    assert (report.today.requests, report.remaining_daily_tokens) == (2, 65)
    assert (report.this_minute.requests, report.this_minute.total_tokens) == (1, 120)
    # While the shared store cannot answer, a gateway counts what it knows.
    shared.reachable = False
    assert await ours.tokens_used("acme", "2026-01-01") == 15
    # A store that lost the day (restarted without persistence) cannot undercut a gateway's own count.
    shared.reachable, shared.days = True, {}
    assert await theirs.tokens_used("acme", "2026-01-01") == 120
    await ours.record(record(prompt=1, completion=1))
    assert await ours.tokens_used("acme", "2026-01-01") == 17
