"""Run perf_analyzer (closed loop, fixed concurrency) and compute figures from its
per-request profile export (timestamps of each request and of each of its responses)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.stats import percentile
from bench.tools import perf_analyzer

log = logging.getLogger(__name__)
# perf_analyzer 2.51 with --request-count now and then never exits: every request is
# answered and its worker threads are gone, but its main thread keeps waiting
# in InferenceProfiler::Measure (gdb). Seen straight at Triton as well as through the gateway,
# about once in 20-40 runs of 20,000 calls at concurrency 64. A run that gives no result
# in time is run once more; a second one fails the point.
ATTEMPTS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class PerfPoint:
    """One perf_analyzer measurement: throughput and client-side latency (microseconds)."""

    concurrency: int
    throughput: float
    p50_us: float
    p90_us: float
    p99_us: float


@dataclasses.dataclass(frozen=True, slots=True)
class PerfSettings:
    """How much perf_analyzer measures: a fixed number of requests per point."""

    requests: int

    def args(self) -> list[str]:
        # A fixed request count instead of perf_analyzer's stability windows: on a shared
        # 2-core machine windows often never agree, and the run would fail instead of
        # reporting the spread. Its own summary of such a run rounds the duration to
        # whole seconds, hence the export.
        return ["--request-count", str(self.requests)]


class PerfAnalyzerFailed(RuntimeError):
    """perf_analyzer exited non-zero; the message carries its output tail."""


class PerfAnalyzerTimedOut(PerfAnalyzerFailed):
    """perf_analyzer gave no result within the time allowed."""


def measure(
    *, url: str, model: str, concurrency: int, settings: PerfSettings,
    shape: Sequence[str] = (), headers: Sequence[str] = (), extra: Sequence[str] = (),
    timeout: float = 300.0, watch: Callable[[], str | None] | None = None,
) -> PerfPoint:
    """One concurrency level against a gRPC target; `headers` go out as gRPC metadata.

    `watch` is asked twice a second while perf_analyzer runs: what it returns (say, "Triton
    exited") stops the run with that reason. perf_analyzer itself waits forever for the
    responses of a server that died under it. A run with no result after `timeout` seconds
    (and no objection from `watch`) is run again, once (see ATTEMPTS).
    """
    run = functools.partial(_measure_once, url=url, model=model, concurrency=concurrency, settings=settings,
                            shape=shape, headers=headers, extra=extra, timeout=timeout, watch=watch)
    for _ in range(ATTEMPTS - 1):
        try:
            return run()
        except PerfAnalyzerTimedOut as e:
            log.warning("%s; running it again", str(e).splitlines()[0])
    return run()


def _measure_once(
    *, url: str, model: str, concurrency: int, settings: PerfSettings, shape: Sequence[str],
    headers: Sequence[str], extra: Sequence[str], timeout: float, watch: Callable[[], str | None] | None,
) -> PerfPoint:
    with tempfile.TemporaryDirectory(prefix="perf-") as tmp:
        export = pathlib.Path(tmp) / "profile.json"
        cmd = [
            str(perf_analyzer()), "-m", model, "-u", url, "-i", "grpc",
            "--concurrency-range", str(concurrency), *settings.args(),
            "--profile-export-file", str(export),
            *(f"--shape={s}" for s in shape), *(a for h in headers for a in ("-H", h)), *extra,
        ]
        output = pathlib.Path(tmp) / "output.txt"
        with output.open("wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
            reason, timed_out = _wait(proc, timeout, watch)
        tail = output.read_text(errors="replace")[-2000:]
        if reason is not None:
            error = PerfAnalyzerTimedOut if timed_out else PerfAnalyzerFailed
            raise error(f"perf_analyzer stopped for {model} at {url}: {reason}\n{tail}")
        if proc.returncode != 0 or not export.exists():
            raise PerfAnalyzerFailed(f"perf_analyzer exited {proc.returncode} for {model} at {url}:\n{tail}")
        experiment = json.loads(export.read_text())["experiments"][0]
    return summarise(concurrency, experiment)


def _wait(
    proc: subprocess.Popen[bytes], timeout: float, watch: Callable[[], str | None] | None
) -> tuple[str | None, bool]:
    """Wait for `proc`; kill it and say why if `timeout` passes or `watch` objects first
    (the reason, and whether it was the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=0.5)
            return None, False
        except subprocess.TimeoutExpired:
            pass
        reason = watch() if watch is not None else None
        timed_out = reason is None and time.monotonic() > deadline
        if timed_out:
            reason = f"no result after {timeout:.0f}s"
        if reason is not None:
            proc.kill()
            proc.wait()
            return reason, timed_out


def summarise(concurrency: int, experiment: dict[str, Any]) -> PerfPoint:
    requests = experiment["requests"]
    latencies = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e3 for r in requests]
    # The export's window boundaries are whole-second marks; the requests' own timestamps
    # bound the measured interval exactly.
    start = min(r["timestamp"] for r in requests)
    end = max(r["response_timestamps"][-1] for r in requests)
    return PerfPoint(
        concurrency=concurrency,
        throughput=len(requests) / ((end - start) / 1e9),
        p50_us=percentile(latencies, 50),
        p90_us=percentile(latencies, 90),
        p99_us=percentile(latencies, 99),
    )
