"""fairness: three tenants with weights 1:2:4 in one class saturate minilm through qosgate;
their achieved shares against the weights, Jain's index on weight-normalised shares, and
whether the heaviest tenant regains its share after it stops and restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib

from bench import load, plots
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, gateway_available
from bench.stats import jain_index

log = logging.getLogger(__name__)

MODEL = "minilm"
WEIGHTS = {"light": 1.0, "medium": 2.0, "heavy": 4.0}
DEPTH = 16  # requests each tenant keeps outstanding: far more than the dispatch window
TENANTS = [
    {"name": name, "api_keys": [{"key": f"bench-{name}-key"}], "weight": weight,
     "default_class": "standard", "max_class": "standard"}
    for name, weight in WEIGHTS.items()
]
CALLERS = {name: load.Caller(name, api_key=f"bench-{name}-key") for name in WEIGHTS}


@dataclasses.dataclass(slots=True)
class Window:
    """Completions per tenant over one phase of the run."""

    phase: str
    active: list[str]
    counts: dict[str, int]

    def shares(self) -> dict[str, float]:
        total = sum(self.counts[n] for n in self.active) or 1
        return {n: self.counts[n] / total for n in self.active}

    def expected(self) -> dict[str, float]:
        total = sum(WEIGHTS[n] for n in self.active)
        return {n: WEIGHTS[n] / total for n in self.active}

    def worst_deviation_pct(self) -> float:
        """Largest relative distance of a tenant's share from its weight's share."""
        shares, expected = self.shares(), self.expected()
        return max(abs(shares[n] - expected[n]) / expected[n] for n in self.active) * 100

    def jain(self) -> float:
        shares, expected = self.shares(), self.expected()
        return jain_index([shares[n] / expected[n] for n in self.active])

    def row(self) -> dict[str, object]:
        shares, expected = self.shares(), self.expected()
        return {"phase": self.phase, **{
            n: f"{shares[n]:.3f} (aim {expected[n]:.3f}, {self.counts[n]} ok)" if n in shares else "stopped"
            for n in WEIGHTS}, "Jain": round(self.jain(), 4)}


async def drive(url: str, seconds: float) -> list[Window]:
    """Phase 1 all three; phase 2 `heavy` stops; phase 3 it is back."""
    target = load.Target(url)
    request = load.embedding_request(MODEL, "Fair share means each tenant gets its weight.")
    outcomes: dict[str, list[load.Outcome]] = {n: [] for n in WEIGHTS}

    async def tenant(name: str, start: float, end: float) -> None:
        await asyncio.sleep(max(0.0, start - target.now()))
        send = lambda: target.infer(CALLERS[name], request, 30.0)  # noqa: E731
        outcomes[name] += await load.closed_loop(send, DEPTH, end, target.now)

    # A warm-up lets queues fill before anything is counted.
    t0 = target.now() + 2.0
    bounds = [t0, t0 + seconds, t0 + 2 * seconds, t0 + 3 * seconds]
    try:
        await asyncio.gather(
            tenant("light", 0, bounds[3]), tenant("medium", 0, bounds[3]),
            tenant("heavy", 0, bounds[1]), tenant("heavy", bounds[2], bounds[3]),
        )
    finally:
        await target.close()
    phases = [("all three", list(WEIGHTS), bounds[0], bounds[1]),
              ("heavy stopped", ["light", "medium"], bounds[1], bounds[2]),
              # The restarted tenant needs a moment to refill its backlog; count after it.
              ("heavy restarted", list(WEIGHTS), bounds[2] + 1.0, bounds[3])]
    return [Window(name, active, {n: len(load.ok_between(outcomes[n], lo, hi)) for n in WEIGHTS})
            for name, active, lo, hi in phases]


def run(ctx: RunContext) -> ScenarioResult:
    seconds = ctx.pick(12.0, 40.0)
    notes = [f"minilm through qosgate, class standard, {DEPTH} outstanding requests per tenant "
             f"(closed loop), {seconds:.0f} s per phase; shares = completions in the phase."]
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("worst share deviation from weight", None, "%", Aim("<=", 5.0))], {}, notes)
    with checked(Stack(models=[MODEL])) as stack:
        url = stack.start_gateway(tenants=TENANTS)
        windows = asyncio.run(drive(url, seconds))
    for w in windows:
        log.info("%s", w.row())
    first, _, last = windows
    figures = [
        Figure("worst share deviation from weight (all three)", first.worst_deviation_pct(), "%",
               Aim("<=", 5.0), reference=", ".join(f"{n} {s:.3f}" for n, s in first.shares().items())),
        Figure("Jain's index, weight-normalised (all three)", first.jain(), "", Aim(">=", 0.98)),
        Figure("worst share deviation after heavy restarts", last.worst_deviation_pct(), "%",
               Aim("<=", 5.0), reference=f"heavy {last.shares()['heavy']:.3f} of aim {last.expected()['heavy']:.3f}"),
    ]
    return ctx.result(figures, {"shares": [w.row() for w in windows]}, notes,
                      plot=lambda path: draw(windows, path))


def draw(windows: list[Window], path: pathlib.Path) -> None:
    fig, (ax,) = plots.panels(1, width=7)
    width = 0.25
    for i, name in enumerate(WEIGHTS):
        xs = [j + (i - 1) * width for j in range(len(windows))]
        ax.bar(xs, [w.shares().get(name, 0.0) for w in windows], width, label=f"{name} (w={WEIGHTS[name]:g})")
        ax.scatter(xs, [w.expected().get(name, 0.0) for w in windows], marker="_", s=300, color="black")
    ax.set_xticks(range(len(windows)), [w.phase for w in windows])
    ax.set_ylabel("share of completions (bars) vs weight share (marks)")
    ax.set_title("minilm through qosgate: weighted fair share")
    ax.legend(fontsize=8)
    plots.save(fig, path)
