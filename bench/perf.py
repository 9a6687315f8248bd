"""Run perf_analyzer (closed loop, fixed concurrency) and read its CSV report."""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import subprocess
import tempfile
from collections.abc import Sequence

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
    """How long perf_analyzer measures: window length, windows, allowed variation."""

    window_ms: int
    max_trials: int
    stability_pct: int = 1000

    def args(self) -> list[str]:
        # On a shared 2-core machine windows often differ by more than 2x (other jobs run);
        # a very wide tolerance keeps runs bounded; the spread shows in the repeated points.
        return ["-p", str(self.window_ms), "-r", str(self.max_trials), "-s", str(self.stability_pct)]


class PerfAnalyzerFailed(RuntimeError):
    """perf_analyzer exited non-zero; the message carries its output tail."""


def measure(
    *, url: str, model: str, concurrency: int, settings: PerfSettings,
    shape: Sequence[str] = (), headers: Sequence[str] = (), extra: Sequence[str] = (),
    timeout: float = 300.0,
) -> PerfPoint:
    """One concurrency level against a gRPC target; `headers` go out as gRPC metadata."""
    with tempfile.TemporaryDirectory(prefix="perf-") as tmp:
        report = pathlib.Path(tmp) / "report.csv"
        cmd = [
            str(perf_analyzer()), "-m", model, "-u", url, "-i", "grpc",
            "--concurrency-range", str(concurrency), *settings.args(), "-f", str(report),
            *(f"--shape={s}" for s in shape), *(a for h in headers for a in ("-H", h)), *extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0 or not report.exists():
            raise PerfAnalyzerFailed(
                f"perf_analyzer exited {out.returncode} for {model} at {url}:\n"
                f"{(out.stdout + out.stderr)[-2000:]}"
            )
        with open(report, newline="") as f:
            row = next(csv.DictReader(f))
    return PerfPoint(
        concurrency=int(row["Concurrency"]),
        throughput=float(row["Inferences/Second"]),
        p50_us=float(row["p50 latency"]),
        p90_us=float(row["p90 latency"]),
        p99_us=float(row["p99 latency"]),
    )
