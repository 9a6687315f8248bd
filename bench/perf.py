"""Run perf_analyzer (closed loop, fixed concurrency) and compute figures from its
per-request profile export (timestamps of each request and of each of its responses)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from bench.stats import percentile
from bench.tools import perf_analyzer


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


def measure(
    *, url: str, model: str, concurrency: int, settings: PerfSettings,
    shape: Sequence[str] = (), headers: Sequence[str] = (), extra: Sequence[str] = (),
    timeout: float = 300.0,
) -> PerfPoint:
    """One concurrency level against a gRPC target; `headers` go out as gRPC metadata."""
    with tempfile.TemporaryDirectory(prefix="perf-") as tmp:
        export = pathlib.Path(tmp) / "profile.json"
        cmd = [
            str(perf_analyzer()), "-m", model, "-u", url, "-i", "grpc",
            "--concurrency-range", str(concurrency), *settings.args(),
            "--profile-export-file", str(export),
            *(f"--shape={s}" for s in shape), *(a for h in headers for a in ("-H", h)), *extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0 or not export.exists():
            raise PerfAnalyzerFailed(
                f"perf_analyzer exited {out.returncode} for {model} at {url}:\n"
                f"{(out.stdout + out.stderr)[-2000:]}"
            )
        experiment = json.loads(export.read_text())["experiments"][0]
    return summarise(concurrency, experiment)


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
