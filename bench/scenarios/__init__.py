"""The scenarios of issue 6, by name; each is `run(ctx) -> ScenarioResult`."""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

from bench.report import RESULTS_DIR, SCENARIO_ORDER, Figure, ScenarioResult


def describe_machine(cpuinfo: str, cores: int) -> str:
    """The CPU a run had, as the README's Runs line names it: model, cores, widest vector
    extension. No commas: the Runs line separates its entries with them."""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())}
    model = " ".join(fields.get("model name", "unknown CPU").replace(",", " ").split())
    flags = set(fields.get("flags", "").split())
    vectors = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model} with {cores} cores and {vectors}"


def this_machine() -> str:
    """`describe_machine` of the machine this runs on."""
    return describe_machine(pathlib.Path("/proc/cpuinfo").read_text(), len(os.sched_getaffinity(0)))


@dataclasses.dataclass(slots=True)
class RunContext:
    """One scenario run: its name, mode, and when it began (for the result)."""

    scenario: str
    quick: bool
    started: float = dataclasses.field(default_factory=time.monotonic)
    started_utc: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    )

    @property
    def command(self) -> str:
        return f"python -m bench {self.scenario}" + (" --quick" if self.quick else "")

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def result(self, figures: list[Figure], tables: dict[str, list[dict[str, Any]]],
               notes: list[str], plot: Callable[[Any], None] | None = None) -> ScenarioResult:
        """Assemble the result; `plot(path)` draws the scenario's PNG next to its JSON."""
        name = ""
        if plot is not None:
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            name = f"{self.scenario}.png"
            plot(RESULTS_DIR / name)
        return ScenarioResult(
            scenario=self.scenario, command=self.command, quick=self.quick,
            started_utc=self.started_utc, duration_s=time.monotonic() - self.started,
            figures=figures, tables=tables, notes=notes, plot=name, machine=this_machine(),
        )


def _lazy(module: str) -> Callable[[RunContext], ScenarioResult]:
    # Scenarios import matplotlib, tritonclient and friends; load only the one that runs.
    def run(ctx: RunContext) -> ScenarioResult:
        return importlib.import_module(f"bench.scenarios.{module}").run(ctx)

    return run


SCENARIOS: dict[str, Callable[[RunContext], ScenarioResult]] = {
    name: _lazy(name) for name in SCENARIO_ORDER
}
