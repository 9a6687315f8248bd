"""The scenarios of issue 6, by name; each is `run(ctx) -> ScenarioResult`."""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import time
from collections.abc import Callable
from typing import Any

from bench.report import RESULTS_DIR, SCENARIO_ORDER, Figure, ScenarioResult


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
            figures=figures, tables=tables, notes=notes, plot=name,
        )


def _lazy(module: str) -> Callable[[RunContext], ScenarioResult]:
    # Scenarios import matplotlib, tritonclient and friends; load only the one that runs.
    def run(ctx: RunContext) -> ScenarioResult:
        return importlib.import_module(f"bench.scenarios.{module}").run(ctx)

    return run


SCENARIOS: dict[str, Callable[[RunContext], ScenarioResult]] = {
    name: _lazy(name) for name in SCENARIO_ORDER
}
