"""fairness: three tenants with weights 1:2:4 in one class saturate minilm through qosgate;
their achieved shares against the weights, Jain's index on weight-normalised shares, and
whether the heaviest tenant regains its share after it stops and restarts.

Then the LLM pair: two equal-weight tenants saturate smollm2 through GenerateStream, one
with max_tokens 128 and one with max_tokens 8, once with the fair share counted in tokens
(the default) and once in requests: their token service (prompt + 2 x completion), its
ratio, Jain's index on it, and VTC's measure, the largest difference in service the two
got over any interval of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib

from qosgate.v1 import generation_pb2

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

LLM = "smollm2"
PAIR = {"long": 128, "short": 8}  # max_tokens per tenant
PAIR_STREAMS = 16  # per tenant, closed loop: together well above the dispatch window
PAIR_WINDOW = 16
OUTPUT_WEIGHT = 2.0  # the token service counted: prompt + 2 x completion (VTC's w)
# Greedy SmolLM2 counts on to max_tokens from this prompt: every request runs its length.
COUNTING_PROMPT = "The numbers from one to one thousand: 1, 2, 3, 4,"
PAIR_TENANTS = [
    {"name": name, "api_keys": [{"key": f"bench-{name}-key"}], "default_class": "standard", "max_class": "standard"}
    for name in PAIR
]


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


@dataclasses.dataclass(slots=True)
class TokenPair:
    """The long and the short tenant's token service over one run, as events in time."""

    fair_share: str
    window: tuple[float, float]
    events: dict[str, list[tuple[float, float]]]  # tenant -> (time, weighted tokens)

    def service(self) -> dict[str, float]:
        lo, hi = self.window
        return {n: sum(w for t, w in ev if lo <= t < hi) for n, ev in self.events.items()}

    def ratio(self) -> float:
        service = self.service()
        return max(service.values()) / max(1e-9, min(service.values()))

    def jain(self) -> float:
        return jain_index(list(self.service().values()))

    def cumulative(self, name: str) -> tuple[list[float], list[float]]:
        lo, hi = self.window
        xs, ys, total = [0.0], [0.0], 0.0
        for t, w in sorted(e for e in self.events[name] if lo <= e[0] < hi):
            total += w
            xs.append(t - lo)
            ys.append(total)
        return xs, ys

    def max_gap(self) -> float:
        """VTC's measure: the largest |service(long) - service(short)| over any interval
        [t1, t2] of the run, i.e. the range of the running difference."""
        lo, hi = self.window
        sign = {"long": 1.0, "short": -1.0}
        merged = sorted((t, sign[n] * w) for n, ev in self.events.items() for t, w in ev if lo <= t < hi)
        difference = low = high = 0.0
        for _, delta in merged:
            difference += delta
            low, high = min(low, difference), max(high, difference)
        return high - low

    def row(self) -> dict[str, object]:
        service = self.service()
        return {"fair_share": self.fair_share, **{f"{n} token service": round(v) for n, v in service.items()},
                "ratio": round(self.ratio(), 2), "Jain": round(self.jain(), 4),
                "max service gap": round(self.max_gap())}


def _service_events(outcome: load.Outcome) -> list[tuple[float, float]]:
    """A token per text chunk as it arrived; the prompt, and what the chunks undercounted,
    when the final usage says so."""
    events = [(t, OUTPUT_WEIGHT) for t in outcome.token_times]
    if outcome.tokens:
        completion = outcome.tokens - outcome.prompt_tokens
        missed = max(0, completion - len(outcome.token_times))
        events.append((outcome.end, outcome.prompt_tokens + OUTPUT_WEIGHT * missed))
    return events


async def drive_pair(url: str, fair_share: str, warmup: float, seconds: float) -> TokenPair:
    target = load.Target(url)
    begin = target.now()
    until = begin + warmup + seconds
    events: dict[str, list[tuple[float, float]]] = {n: [] for n in PAIR}

    async def tenant(name: str) -> None:
        caller = load.Caller(name, api_key=f"bench-{name}-key")
        request = generation_pb2.GenerateStreamRequest(
            model=LLM, prompt=COUNTING_PROMPT,
            sampling=generation_pb2.SamplingParams(max_tokens=PAIR[name], temperature=0.0))
        # The deadline is the end of the run: a long generation is cut there, not awaited.
        send = lambda: target.generate_stream(caller, request, max(1.0, until - target.now()))  # noqa: E731
        for outcome in await load.closed_loop(send, PAIR_STREAMS, until, target.now):
            events[name] += _service_events(outcome)

    try:
        await asyncio.gather(*(tenant(n) for n in PAIR))
    finally:
        await target.close()
    return TokenPair(fair_share, (begin + warmup, until), events)


def run_pair(ctx: RunContext) -> list[TokenPair]:
    warmup, seconds = ctx.pick((5.0, 20.0), (10.0, 90.0))
    pairs = []
    with checked(Stack(models=[LLM])) as stack:
        for fair_share in ("cost", "requests"):
            stack.wait_idle(LLM)
            url = stack.start_gateway(tenants=PAIR_TENANTS, models={LLM: {"dispatch_window": PAIR_WINDOW}},
                                      scheduler={"fair_share": fair_share})
            pairs.append(asyncio.run(drive_pair(url, fair_share, warmup, seconds)))
            log.info("%s", pairs[-1].row())
    return pairs


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
    pairs = run_pair(ctx)
    tokens, requests = pairs
    notes.append(f"LLM pair: smollm2 (dispatch window {PAIR_WINDOW}), class standard, equal weights, "
                 f"{PAIR_STREAMS} GenerateStream streams per tenant (closed loop), max_tokens "
                 f"{PAIR['long']} against {PAIR['short']} from a prompt greedy SmolLM2 continues to "
                 f"max_tokens; token service = prompt + {OUTPUT_WEIGHT:g} x completion tokens, counted "
                 f"as they streamed over {tokens.window[1] - tokens.window[0]:.0f} s after a warm-up; "
                 "once with fair_share cost (default), once with fair_share requests.")
    first, _, last = windows
    figures = [
        Figure("worst share deviation from weight (all three)", first.worst_deviation_pct(), "%",
               Aim("<=", 5.0), reference=", ".join(f"{n} {s:.3f}" for n, s in first.shares().items())),
        Figure("Jain's index, weight-normalised (all three)", first.jain(), "", Aim(">=", 0.98)),
        Figure("worst share deviation after heavy restarts", last.worst_deviation_pct(), "%",
               Aim("<=", 5.0), reference=f"heavy {last.shares()['heavy']:.3f} of aim {last.expected()['heavy']:.3f}"),
        Figure("LLM pair: token service ratio, max_tokens 128 vs 8", tokens.ratio(), "x", Aim("<=", 1.5),
               reference=f"per-request fair share {requests.ratio():.2f}x"),
        Figure("LLM pair: Jain's index on token service", tokens.jain(), "", Aim(">=", 0.96),
               reference=f"per-request fair share {requests.jain():.3f}"),
        Figure("LLM pair: max service gap over any interval", tokens.max_gap(), "weighted tokens",
               reference=f"per-request fair share {requests.max_gap():.0f}"),
    ]
    return ctx.result(figures, {"shares": [w.row() for w in windows], "token service": [p.row() for p in pairs]},
                      notes, plot=lambda path: draw(windows, pairs, path))


def draw(windows: list[Window], pairs: list[TokenPair], path: pathlib.Path) -> None:
    fig, (ax, service) = plots.panels(2, width=7)
    for pair, style in zip(pairs, ("-", ":")):
        for name in PAIR:
            xs, ys = pair.cumulative(name)
            service.plot(xs, ys, style, label=f"{name} (max_tokens {PAIR[name]}), fair_share {pair.fair_share}")
    service.set_xlabel("seconds")
    service.set_ylabel("token service (prompt + 2 x completion)")
    service.set_title("smollm2: cumulative token service, equal weights")
    service.legend(fontsize=7)
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
