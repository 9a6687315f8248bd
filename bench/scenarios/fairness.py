"""fairness: weighted fair share with the gateway's defaults, and what it costs in throughput.

- minilm: three tenants with weights 1:2:4 in one class, each keeping 32 KServe calls in
  flight, through qosgate with no `models:` entry (the `auto` dispatch window), and the
  same load with each fixed window of `MINILM_WINDOWS`; auto runs first and again last,
  so the machine's drift spreads over every configuration, and its figures are the mean
  of the two; an uncounted run through the largest fixed window warms the engine first.
  Per configuration: served calls per second, the shares, the worst relative deviation
  from the weights and Jain's index on weight-normalised shares. The last auto run goes
  on with the heaviest tenant stopped, then back.
- smollm2: the same in tokens: 32 GenerateStream calls per tenant, shares counted in
  token service (prompt + 2 x completion tokens), throughput in generated tokens per
  second, against the fixed windows of `SMOLLM2_WINDOWS`.
- The LLM pair: two equal-weight tenants saturate smollm2, one with max_tokens 128 and
  one with 8, with the defaults (fair share counted in tokens) and, as the reference,
  with fair share counted in requests: their token service, its ratio, Jain's index on
  it, and VTC's measure, the largest difference in service the two got over any interval.
- Two gateways in front of one Triton, sharing a Redis: tenant x sends all its calls to
  the first, tenant y splits the same number evenly over both (a load balancer's skew);
  with equal weights their service ratio, with weights 1:4 the worst share deviation;
  the reference is the same skewed load at two gateways that do not share Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qosgate.v1 import generation_pb2

from bench import load, plots
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, gateway_available
from bench.stats import jain_index

log = logging.getLogger(__name__)

MODEL = "minilm"
WEIGHTS = {"light": 1.0, "medium": 2.0, "heavy": 4.0}
DEPTH = 32  # calls or streams each tenant keeps in flight (closed loop)
MINILM_WINDOWS = (8, 16, 32, 64, 128)
EMBEDDING_TEXT = "Fair share means each tenant gets its weight."

LLM = "smollm2"
SMOLLM2_WINDOWS = (16, 32, 64, 96)
SWEEP_MAX_TOKENS = 64
OUTPUT_WEIGHT = 2.0  # the token service counted: prompt + 2 x completion (VTC's w)
# Greedy SmolLM2 counts on to max_tokens from this prompt: every request runs its length.
COUNTING_PROMPT = "The numbers from one to one thousand: 1, 2, 3, 4,"
PAIR = {"long": 128, "short": 8}  # max_tokens per tenant, equal weights
PAIR_STREAMS = 24  # per tenant, closed loop

# Two gateways: x's calls all at the first, y's as many, half at each.
SKEW_LOOPS = 32
EQUAL = {"x": 1.0, "y": 1.0}
SKEWED_WEIGHTS = {"x": 1.0, "y": 4.0}
SHARED_EQUAL = "sharing Redis, weights 1:1"
UNSHARED_EQUAL = "not sharing Redis, weights 1:1"
SHARED_WEIGHTED = "sharing Redis, weights 1:4"


def tenant_configs(weights: Mapping[str, float]) -> list[dict[str, Any]]:
    """One tenant per name, all in class standard, key `bench-<name>-key`."""
    return [{"name": name, "api_keys": [{"key": f"bench-{name}-key"}], "weight": weight,
             "default_class": "standard", "max_class": "standard"} for name, weight in weights.items()]


def caller(name: str) -> load.Caller:
    return load.Caller(name, api_key=f"bench-{name}-key")


@dataclasses.dataclass(slots=True)
class Served:
    """What each tenant was served over one measured window, against its weight."""

    label: str
    weights: dict[str, float]  # the tenants counted, and their weights
    service: dict[str, float]  # per tenant: calls, or weighted tokens
    seconds: float
    work: float  # what the throughput counts: calls served, or tokens generated
    unit: str = "calls"
    failed: int = 0  # calls that ended in an error inside the window

    def rate(self) -> float:
        return self.work / self.seconds

    def shares(self) -> dict[str, float]:
        total = sum(self.service[n] for n in self.weights) or 1.0
        return {n: self.service[n] / total for n in self.weights}

    def expected(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {n: w / total for n, w in self.weights.items()}

    def worst_deviation_pct(self) -> float:
        """Largest relative distance of a tenant's share from its weight's share."""
        shares, expected = self.shares(), self.expected()
        return max(abs(shares[n] - expected[n]) / expected[n] for n in self.weights) * 100

    def jain(self) -> float:
        """Jain's index on weight-normalised shares: 1 when each got its weight's share."""
        shares, expected = self.shares(), self.expected()
        return jain_index([shares[n] / expected[n] for n in self.weights])

    def imbalance(self) -> float:
        """The largest service per unit of weight over the smallest (1 is exact)."""
        per_weight = [self.service[n] / w for n, w in self.weights.items()]
        return max(per_weight) / max(min(per_weight), 1e-9)

    def row(self) -> dict[str, object]:
        shares, expected = self.shares(), self.expected()
        return {"run": self.label, **{
            n: f"{shares[n]:.3f} (aim {expected[n]:.3f}, {self.service[n]:,.0f})" for n in self.weights},
            f"{self.unit}/s": round(self.rate(), 1), "worst deviation %": round(self.worst_deviation_pct(), 1),
            "Jain": round(self.jain(), 4), "failed": self.failed}


def served_calls(label: str, weights: Mapping[str, float], outcomes: Mapping[str, Sequence[load.Outcome]],
                 lo: float, hi: float) -> Served:
    """Calls each tenant completed in [lo, hi), and the calls that failed there."""
    service = {n: float(len(load.ok_between(outcomes[n], lo, hi))) for n in weights}
    failed = sum(1 for n in weights for o in outcomes[n] if not o.ok and lo <= o.end < hi)
    return Served(label, dict(weights), service, hi - lo, sum(service.values()), failed=failed)


@dataclasses.dataclass(slots=True)
class Sweep:
    """One model's load through the `auto` window (first and last run) and each fixed
    window, in the same stack; `phases`: the last auto run's heavy-stopped and restarted
    windows, where measured."""

    model: str
    auto: list[Served]
    fixed: dict[int, Served]
    phases: list[Served] = dataclasses.field(default_factory=list)

    def runs(self) -> list[Served]:
        """In the order they ran."""
        return [self.auto[0], *self.fixed.values(), *self.auto[1:]]

    def best_fixed(self) -> tuple[int, Served]:
        return max(self.fixed.items(), key=lambda item: item[1].rate())

    def figures(self) -> list[Figure]:
        unit = self.auto[0].unit
        deviation = [s.worst_deviation_pct() for s in self.auto]
        jain = [s.jain() for s in self.auto]
        rates = [s.rate() for s in self.auto]
        shares = {n: statistics.fmean(s.shares()[n] for s in self.auto) for n in self.auto[0].weights}
        expected = self.auto[0].expected()
        window, best = self.best_fixed()

        def each(values: Sequence[str]) -> str:
            return f"mean of the first and last auto run ({', '.join(values)})"

        return [
            Figure(f"{self.model}: worst share deviation from weight, auto window", statistics.fmean(deviation),
                   "%", Aim("<=", 5.0),
                   reference=each([f"{d:.1f}%" for d in deviation]) + "; shares " + ", ".join(
                       f"{n} {shares[n]:.3f} (aim {expected[n]:.3f})" for n in shares)),
            Figure(f"{self.model}: Jain's index, weight-normalised, auto window", statistics.fmean(jain), "",
                   Aim(">=", 0.99), reference=each([f"{j:.4f}" for j in jain])),
            Figure(f"{self.model}: auto window's {unit}/s / best fixed window's",
                   100 * statistics.fmean(rates) / best.rate(), "%", Aim(">=", 90.0),
                   reference=f"auto {statistics.fmean(rates):,.1f} {unit}/s ("
                             + ", ".join(f"{r:,.1f}" for r in rates)
                             + f"); best fixed window {window}: {best.rate():,.1f} {unit}/s"),
        ]


def sweep(stack: Stack, model: str, windows: Sequence[int],
          measure: Callable[[str, str, bool], list[Served]]) -> Sweep:
    """A gateway per configuration, in the order auto, each of `windows`, auto again;
    `measure(url, label, last)` drives one and returns its measured window first.

    Before them the same load runs, not counted, through the largest fixed window: an
    engine just started is slower for a while (a CPU model builds its kernels per batch
    shape as it first meets it), and the first run would pay for that."""
    stack.wait_idle(model)
    measure(stack.start_gateway(tenants=tenant_configs(WEIGHTS), models={model: {"dispatch_window": max(windows)}}),
            "engine warm-up", False)
    configurations: list[int | None] = [None, *windows, None]
    auto: list[Served] = []
    fixed: dict[int, Served] = {}
    phases: list[Served] = []
    for i, window in enumerate(configurations):
        stack.wait_idle(model)
        last = i == len(configurations) - 1
        models = None if window is None else {model: {"dispatch_window": window}}
        url = stack.start_gateway(tenants=tenant_configs(WEIGHTS), models=models)
        label = f"window {window}" if window is not None else "auto, last run" if last else "auto, first run"
        measured, *after = measure(url, label, last)
        for served in (measured, *after):
            log.info("%s: %s", model, served.row())
        if window is None:
            auto.append(measured)
        else:
            fixed[window] = measured
        phases += after
    return Sweep(model, auto, fixed, phases)


async def drive_calls(url: str, label: str, warmup: float, seconds: float, heavy_pause: bool) -> list[Served]:
    """The three tenants for `warmup` + `seconds`; with `heavy_pause`, then `heavy` stops
    for `seconds` and is back for `seconds` more."""
    target = load.Target(url)
    request = load.embedding_request(MODEL, EMBEDDING_TEXT)
    outcomes: dict[str, list[load.Outcome]] = {n: [] for n in WEIGHTS}

    async def tenant(name: str, start: float, end: float) -> None:
        await asyncio.sleep(max(0.0, start - target.now()))
        send = lambda: target.infer(caller(name), request, 30.0)  # noqa: E731
        outcomes[name] += await load.closed_loop(send, DEPTH, end, target.now)

    t0 = target.now() + warmup
    bounds = [t0 + i * seconds for i in range(4 if heavy_pause else 2)]
    heavy = [(0.0, bounds[1]), (bounds[2], bounds[3])] if heavy_pause else [(0.0, bounds[1])]
    try:
        await asyncio.gather(tenant("light", 0.0, bounds[-1]), tenant("medium", 0.0, bounds[-1]),
                             *(tenant("heavy", start, end) for start, end in heavy))
    finally:
        await target.close()
    windows = [(label, WEIGHTS, bounds[0], bounds[1])]
    if heavy_pause:
        windows += [(f"{label}, heavy stopped", {n: WEIGHTS[n] for n in ("light", "medium")}, bounds[1], bounds[2]),
                    # The restarted tenant needs a moment to refill its backlog; count after it.
                    (f"{label}, heavy restarted", WEIGHTS, bounds[2] + 1.0, bounds[3])]
    return [served_calls(name, weights, outcomes, lo, hi) for name, weights, lo, hi in windows]


def service_events(outcome: load.Outcome) -> list[tuple[float, float]]:
    """A token per text chunk as it arrived; the prompt, and what the chunks undercounted,
    when the final usage says so."""
    events = [(t, OUTPUT_WEIGHT) for t in outcome.token_times]
    if outcome.tokens:
        completion = outcome.tokens - outcome.prompt_tokens
        missed = max(0, completion - len(outcome.token_times))
        events.append((outcome.end, outcome.prompt_tokens + OUTPUT_WEIGHT * missed))
    return events


@dataclasses.dataclass(slots=True)
class TokenRun:
    """The tenants' token service as events in time over one run of streams, the tokens
    generated, and the measured window."""

    label: str
    window: tuple[float, float]
    events: dict[str, list[tuple[float, float]]]  # tenant -> (time, weighted tokens)
    token_times: list[float]  # every generated token's arrival, all tenants

    def served(self, weights: Mapping[str, float]) -> Served:
        lo, hi = self.window
        service = {n: sum(w for t, w in self.events[n] if lo <= t < hi) for n in weights}
        tokens = sum(1 for t in self.token_times if lo <= t < hi)
        return Served(self.label, dict(weights), service, hi - lo, tokens, unit="tokens")

    def cumulative(self, name: str) -> tuple[list[float], list[float]]:
        lo, hi = self.window
        xs, ys, total = [0.0], [0.0], 0.0
        for t, w in sorted(e for e in self.events[name] if lo <= e[0] < hi):
            total += w
            xs.append(t - lo)
            ys.append(total)
        return xs, ys

    def max_gap(self, first: str, second: str) -> float:
        """VTC's measure: the largest |service(first) - service(second)| over any interval
        [t1, t2] of the window, i.e. the range of the running difference."""
        lo, hi = self.window
        merged = sorted([(t, w) for t, w in self.events[first] if lo <= t < hi]
                        + [(t, -w) for t, w in self.events[second] if lo <= t < hi])
        difference = low = high = 0.0
        for _, delta in merged:
            difference += delta
            low, high = min(low, difference), max(high, difference)
        return high - low


async def drive_streams(url: str, label: str, max_tokens: Mapping[str, int], streams: int,
                        warmup: float, seconds: float) -> TokenRun:
    """`streams` GenerateStream calls per tenant in closed loops, each tenant's with its
    `max_tokens`, for `warmup` + `seconds`."""
    target = load.Target(url)
    begin = target.now()
    until = begin + warmup + seconds
    events: dict[str, list[tuple[float, float]]] = {n: [] for n in max_tokens}
    token_times: list[float] = []

    async def tenant(name: str) -> None:
        request = generation_pb2.GenerateStreamRequest(
            model=LLM, prompt=COUNTING_PROMPT,
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens[name], temperature=0.0))
        # The deadline is the end of the run: a long generation is cut there, not awaited.
        send = lambda: target.generate_stream(caller(name), request, max(1.0, until - target.now()))  # noqa: E731
        for outcome in await load.closed_loop(send, streams, until, target.now):
            events[name] += service_events(outcome)
            token_times.extend(outcome.token_times)

    try:
        await asyncio.gather(*(tenant(n) for n in max_tokens))
    finally:
        await target.close()
    return TokenRun(label, (begin + warmup, until), events, token_times)


async def drive_skewed(urls: tuple[str, str], label: str, weights: Mapping[str, float],
                       warmup: float, seconds: float) -> Served:
    """x's SKEW_LOOPS closed loops all at the first gateway, y's split evenly over both."""
    first = load.Target(urls[0])
    second = load.Target(urls[1], first.epoch)
    request = load.embedding_request(MODEL, EMBEDDING_TEXT)
    until = first.now() + warmup + seconds
    outcomes: dict[str, list[load.Outcome]] = {n: [] for n in weights}

    async def loops(target: load.Target, name: str, count: int) -> None:
        send = lambda: target.infer(caller(name), request, 30.0)  # noqa: E731
        outcomes[name] += await load.closed_loop(send, count, until, target.now)

    try:
        await asyncio.gather(loops(first, "x", SKEW_LOOPS), loops(first, "y", SKEW_LOOPS // 2),
                             loops(second, "y", SKEW_LOOPS // 2))
    finally:
        await first.close()
        await second.close()
    return served_calls(label, weights, outcomes, until - seconds, until)


def sweep_times(ctx: RunContext) -> tuple[float, float]:
    """Each sweep run's warm-up and measured seconds."""
    return ctx.pick((3.0, 10.0), (5.0, 20.0))


def run_minilm(ctx: RunContext) -> tuple[Sweep, list[Served]]:
    """The window sweep, then the two-gateway runs, on one Triton."""
    warmup, seconds = sweep_times(ctx)
    skew_seconds = ctx.pick(10.0, 20.0)
    with checked(Stack(models=[MODEL])) as stack:
        calls = sweep(stack, MODEL, MINILM_WINDOWS, lambda url, label, last: asyncio.run(
            drive_calls(url, label, warmup, seconds, heavy_pause=last)))
        gateways = []
        for label, weights, shared in ((SHARED_EQUAL, EQUAL, True), (UNSHARED_EQUAL, EQUAL, False),
                                       (SHARED_WEIGHTED, SKEWED_WEIGHTS, True)):
            stack.wait_idle(MODEL)
            if shared:
                stack.start_redis()  # a fresh one: nothing counted by an earlier run
            tenants = tenant_configs(weights)
            urls = (stack.start_gateway(tenants=tenants, redis=shared),
                    stack.start_second_gateway(tenants=tenants, redis=shared))
            gateways.append(asyncio.run(drive_skewed(urls, label, weights, 5.0, skew_seconds)))
            log.info("two gateways: %s", gateways[-1].row())
    return calls, gateways


def run_smollm2(ctx: RunContext) -> tuple[Sweep, list[TokenRun]]:
    """The window sweep in tokens, then the LLM pair, on one Triton."""
    warmup, seconds = sweep_times(ctx)
    pair_warmup, pair_seconds = ctx.pick((5.0, 20.0), (10.0, 60.0))
    with checked(Stack(models=[LLM])) as stack:
        tokens = sweep(stack, LLM, SMOLLM2_WINDOWS, lambda url, label, _: [asyncio.run(drive_streams(
            url, label, {n: SWEEP_MAX_TOKENS for n in WEIGHTS}, DEPTH, warmup, seconds)).served(WEIGHTS)])
        pairs = []
        for fair_share in ("cost", "requests"):
            stack.wait_idle(LLM)
            url = stack.start_gateway(tenants=tenant_configs({n: 1.0 for n in PAIR}),
                                      scheduler={"fair_share": fair_share})
            pairs.append(asyncio.run(drive_streams(url, f"fair_share {fair_share}", PAIR, PAIR_STREAMS,
                                                   pair_warmup, pair_seconds)))
            log.info("LLM pair: %s", pair_row(pairs[-1]))
    return tokens, pairs


def pair_row(pair: TokenRun) -> dict[str, object]:
    served = pair.served({n: 1.0 for n in PAIR})
    return {"fair_share": pair.label.removeprefix("fair_share "),
            **{f"{n} token service": round(v) for n, v in served.service.items()},
            "ratio": round(served.imbalance(), 2), "Jain": round(served.jain(), 4),
            "max service gap": round(pair.max_gap(*PAIR))}


def pair_figures(tokens: TokenRun, requests: TokenRun) -> list[Figure]:
    equal = {n: 1.0 for n in PAIR}
    by_cost, by_requests = tokens.served(equal), requests.served(equal)
    return [
        Figure(f"LLM pair: token service ratio, max_tokens {PAIR['long']} vs {PAIR['short']}",
               by_cost.imbalance(), "x", Aim("<=", 1.2),
               reference=f"per-request fair share {by_requests.imbalance():.2f}x"),
        Figure("LLM pair: Jain's index on token service", by_cost.jain(), "", Aim(">=", 0.99),
               reference=f"per-request fair share {by_requests.jain():.3f}"),
        Figure("LLM pair: max service gap over any interval", tokens.max_gap(*PAIR), "weighted tokens",
               reference=f"per-request fair share {requests.max_gap(*PAIR):.0f}"),
    ]


def y_over_x(served: Served) -> float:
    """y's service over x's, each per unit of its weight."""
    x, y = (served.service[n] / served.weights[n] for n in ("x", "y"))
    return y / max(x, 1e-9)


def gateway_figures(shared: Served, unshared: Served, weighted: Served) -> list[Figure]:
    """Equal weights: y's service over x's, two-sided (the larger over the smaller, so one
    aim bounds both ways); weights 1:4: the worst share deviation."""

    def ratio(served: Served) -> str:
        return (f"y/x {y_over_x(served):.2f} "
                f"(x {served.service['x']:,.0f}, y {served.service['y']:,.0f} calls, {served.failed} failed)")

    shares, expected = weighted.shares(), weighted.expected()
    return [
        Figure("two gateways sharing Redis, skewed ingress: service y/x (larger over smaller)",
               shared.imbalance(), "x", Aim("<=", 1.2),
               reference=f"{ratio(shared)}, {shared.rate():,.1f} calls/s; gateways not sharing Redis: "
                         f"{ratio(unshared)}, {unshared.rate():,.1f} calls/s"),
        Figure("two gateways sharing Redis, skewed ingress, weights x:y 1:4: worst share deviation",
               weighted.worst_deviation_pct(), "%", Aim("<=", 10.0),
               reference=", ".join(f"{n} {shares[n]:.3f} (aim {expected[n]:.3f})" for n in shares)
               + f"; {weighted.failed} failed"),
    ]


def run(ctx: RunContext) -> ScenarioResult:
    if not gateway_available():
        notes = ["qosgate serve is not available in this checkout: nothing measured."]
        return ctx.result([Figure("minilm: worst share deviation from weight, auto window", None, "%",
                                  Aim("<=", 5.0))], {}, notes)
    calls, gateways = run_minilm(ctx)
    tokens, pairs = run_smollm2(ctx)
    warmup, seconds = sweep_times(ctx)
    pair_seconds = pairs[0].window[1] - pairs[0].window[0]
    notes = [
        f"Window sweeps: tenants light, medium, heavy with weights 1:2:4 in class standard, {DEPTH} calls in "
        f"flight each (closed loop), after an uncounted run through the largest fixed window that warms the "
        f"engine: a gateway with no `models:` entry (auto), then one per fixed window, then "
        f"auto again; each run {warmup:g} s of warm-up then {seconds:g} s measured. minilm: KServe ModelInfer, "
        f"shares of calls completed, fixed windows {', '.join(map(str, MINILM_WINDOWS))}; after the last auto "
        f"run heavy stops for {seconds:g} s and is back for {seconds:g} s (counted from 1 s after its return). "
        f"smollm2: GenerateStream, max_tokens {SWEEP_MAX_TOKENS} from a prompt greedy SmolLM2 continues to "
        f"max_tokens, shares of token service (prompt + {OUTPUT_WEIGHT:g} x completion tokens, counted as they "
        f"streamed), throughput in generated tokens/s, fixed windows {', '.join(map(str, SMOLLM2_WINDOWS))}.",
        f"LLM pair: smollm2 with the defaults, class standard, equal weights, {PAIR_STREAMS} GenerateStream "
        f"streams per tenant (closed loop), max_tokens {PAIR['long']} against {PAIR['short']}, token service "
        f"counted over {pair_seconds:.0f} s after a warm-up; once with fair_share cost (default), once with "
        "fair_share requests.",
        f"Two gateways: qosgate serve twice in front of one Triton, minilm, defaults; tenant x keeps "
        f"{SKEW_LOOPS} calls in flight at the first gateway, y {SKEW_LOOPS // 2} at each; 5 s of warm-up then "
        f"{gateways[0].seconds:.0f} s measured; {SHARED_EQUAL}, {UNSHARED_EQUAL} (the reference), "
        f"{SHARED_WEIGHTED}, each with both gateways (and Redis) started afresh.",
    ]
    figures = [
        *calls.figures(),
        Figure("minilm: worst share deviation after heavy restarts, auto window",
               calls.phases[-1].worst_deviation_pct(), "%", Aim("<=", 5.0),
               reference=f"heavy {calls.phases[-1].shares()['heavy']:.3f} of aim "
                         f"{calls.phases[-1].expected()['heavy']:.3f}"),
        *tokens.figures(),
        *pair_figures(*pairs),
        *gateway_figures(*gateways),
    ]
    tables = {
        "minilm: window sweep": [s.row() for s in (*calls.runs(), *calls.phases)],
        "smollm2: window sweep": [s.row() for s in tokens.runs()],
        "LLM pair: token service": [pair_row(p) for p in pairs],
        "two gateways, skewed ingress": [s.row() for s in gateways],
    }
    return ctx.result(figures, tables, notes, plot=lambda path: draw(calls, tokens, pairs, gateways, path))


def draw(calls: Sweep, tokens: Sweep, pairs: list[TokenRun], gateways: list[Served], path: pathlib.Path) -> None:
    fig, (call_shares, call_rates, pair, token_shares, token_rates, skew) = plots.panels(6, width=6.0, rows=2)
    draw_shares(call_shares, [*calls.runs(), *calls.phases], "minilm: shares of calls served")
    draw_rates(call_rates, calls, "minilm: calls served per second")
    draw_shares(token_shares, tokens.runs(), "smollm2: shares of token service")
    draw_rates(token_rates, tokens, "smollm2: tokens generated per second")
    draw_shares(skew, gateways, "two gateways, x all at the first, y split")
    for x, served in enumerate(gateways):
        skew.annotate(f"y/x per unit of weight {y_over_x(served):.2f}", (x, 0.95), ha="center", fontsize=7)
    for run, style in zip(pairs, ("-", ":")):
        for name in PAIR:
            xs, ys = run.cumulative(name)
            pair.plot(xs, ys, style, label=f"{name} (max_tokens {PAIR[name]}), {run.label}")
    pair.set_xlabel("seconds")
    pair.set_ylabel("token service (prompt + 2 x completion)")
    pair.set_title("smollm2 LLM pair: cumulative token service, equal weights")
    pair.legend(fontsize=7)
    plots.save(fig, path)


def draw_shares(ax: Any, runs: Sequence[Served], title: str) -> None:
    """A bar per tenant and run, the weight's share marked on each."""
    tenants = list(dict.fromkeys(n for s in runs for n in s.weights))
    width = 0.8 / len(tenants)
    for i, name in enumerate(tenants):
        xs = [j + (i - (len(tenants) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [s.shares().get(name, 0.0) for s in runs], width, label=name)
        ax.scatter(xs, [s.expected().get(name, 0.0) for s in runs], marker="_", s=200, color="black")
    ax.set_xticks(range(len(runs)), [s.label for s in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share (bars) vs weight's share (marks)")
    ax.set_title(title)
    ax.legend(fontsize=7)


def draw_rates(ax: Any, runs: Sweep, title: str) -> None:
    """The throughput of each run, auto's in the gateway's colour."""
    ordered = runs.runs()
    colors = [plots.COLORS["qosgate"], *["tab:gray"] * len(runs.fixed), *[plots.COLORS["qosgate"]] * len(runs.auto[1:])]
    ax.bar(range(len(ordered)), [s.rate() for s in ordered], color=colors)
    ax.set_xticks(range(len(ordered)), [s.label for s in ordered], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"{ordered[0].unit}/s")
    ax.set_title(title)
