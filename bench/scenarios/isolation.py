"""isolation: a `batch`-class flood at 2x and 4x capacity next to a steady `critical`
stream, on minilm (request latency) and smollm2 (time to first token); through qosgate
and, as the reference, the same load straight at Triton with Triton's own priority
levels set per request (the best Triton alone can do). The gateway runs with the
per-model settings config/demo.yaml ships for the two models, nothing else. Next to each
latency ratio, the batch goodput through qosgate against Triton direct's at the same
flood. The gateway's CPU per phase, and a py-spy profile of it during an extra phase at
the top flood, show where its time goes.

The frontier: at the top flood, one more qosgate phase per critical latency objective in
`FRONTIER_OBJECTIVES` (`scheduler.latency_objective`; none is the default), each with a
gateway started afresh that first sees the critical stream alone for a while (its
unloaded baseline); each gives the critical p99 over the unloaded one and the batch
goodput as a fraction of Triton direct's, the trade-off a latency objective buys.

On minilm one more phase runs through qosgate: instead of the flood, a tenant far over
its request quota retries in tight loops (`REFUSAL_LOOPS` callers, no pause), so the
gateway answers thousands of refusals a second next to the critical stream. Its reference
sends the same loops to a second gateway process in front of the same Triton: the machine
does the same work, the gateway under test none of it, which splits what the loops cost
the critical stream into the CPU they take from the machine and what sharing the
gateway's process adds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import pathlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tritonclient.grpc import service_pb2

from bench import flood as flood_process
from bench import load, plots, profile
from bench.report import RESULTS_DIR, Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, demo_model_policies, gateway_available
from bench.stats import percentile

log = logging.getLogger(__name__)

CRITICAL = load.Caller("critical", api_key="bench-critical-key", klass="critical")
BATCH = load.Caller("batch", api_key="bench-batch-key", klass="batch")
RETRY = load.Caller("retry", api_key="bench-retry-key", klass="batch")
DIRECT_CRITICAL = load.Caller("critical", triton_priority=1)
DIRECT_BATCH = load.Caller("batch", triton_priority=4)
TENANTS = [
    {"name": "critical-app", "api_keys": [{"key": CRITICAL.api_key}],
     "default_class": "critical", "max_class": "critical"},
    {"name": "batch-app", "api_keys": [{"key": BATCH.api_key}], "default_class": "batch", "max_class": "batch"},
    {"name": "retry-app", "api_keys": [{"key": RETRY.api_key}], "default_class": "batch", "max_class": "batch",
     "limits": {"requests_per_second": 1, "burst": 1}},
]
REFUSAL_LOOPS = 96
REFUSALS_TARGET = "qosgate, refusal loops"
# The same, with the loops' client at the bench's own CPU priority (bench/flood.py).
REFUSALS_AT_PRIORITY = "qosgate, refusal loops at normal priority"
# The loops at a second gateway process, the critical stream through the first.
REFUSALS_ELSEWHERE = "qosgate, refusal loops at a second gateway"
LOADS = (0, 2, 4)  # flood as a multiple of measured capacity; 0 = unloaded
TOP = LOADS[-1]
CAPACITY_DEPTH = 64  # minilm batches up to 32
# The critical class's latency objectives of the frontier phases (None: no objective).
FRONTIER_OBJECTIVES: tuple[float | None, ...] = (None, 4.0, 2.0, 1.5)


def objective_target(objective: float | None) -> str:
    """The name of a frontier phase's target."""
    return "qosgate, no latency objective" if objective is None else f"qosgate, critical objective {objective:g}x"


@dataclasses.dataclass(frozen=True, slots=True)
class Timing:
    """How long each kind of phase runs, in seconds."""

    phase: float  # the main phases
    capacity: float  # the capacity probe before them
    frontier: float  # each latency-objective phase at the top flood
    lead_in: float  # the critical stream alone before it: the fresh gateway's unloaded baseline


@dataclasses.dataclass(slots=True)
class Phase:
    """One target at one flood level: what the critical and batch callers saw."""

    model: str
    target: str
    load: int
    window: tuple[float, float]
    critical: list[load.Outcome]
    batch: list[load.Outcome]
    gateway_cpu: float | None = None  # the gateway's CPU seconds per second of the phase

    def refusals_per_s(self) -> float:
        """Batch-side calls refused inside the phase, per second."""
        lo, hi = self.window
        return sum(1 for o in self.batch if not o.ok and lo <= o.start < hi) / (hi - lo)

    def batch_goodput(self) -> float:
        """Batch requests completed OK inside the phase, per second (later ones are backlog)."""
        lo, hi = self.window
        return len(load.ok_between(self.batch, lo, hi)) / (hi - lo)

    def critical_latency(self) -> list[float]:
        """Seconds to the first token for streams, to the reply otherwise."""
        return [(o.ttft if o.token_times else o.latency) or 0.0 for o in self.critical if o.ok]

    def critical_p99(self) -> float:
        return percentile(self.critical_latency(), 99)

    def row(self) -> dict[str, object]:
        lat = self.critical_latency()
        refused = collections.Counter(o.code for o in self.critical + self.batch if not o.ok)
        return {
            "model": self.model, "target": self.target, "flood": f"{self.load}x",
            "critical p50 ms": percentile(lat, 50) * 1e3, "critical p99 ms": percentile(lat, 99) * 1e3,
            "critical ok": len(lat), "critical refused": sum(not o.ok for o in self.critical),
            "batch goodput/s": round(self.batch_goodput(), 2),
            "batch refusals/s": round(self.refusals_per_s()),
            "refusals by code": ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "none",
            "gateway CPU % of a core": "" if self.gateway_cpu is None else round(100 * self.gateway_cpu),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """How one model is loaded: request builders and the critical stream's rate."""

    model: str
    make: Callable[[int], service_pb2.ModelInferRequest]  # Triton priority -> request (0 = none)
    streaming: bool
    critical_rate: float
    timeout: float
    # The flood gives up sooner; its cancels reach Triton, which bounds the backlog a phase
    # leaves behind (and so the run's length).
    batch_timeout: float
    refusal_loops: bool = False  # also the phase of an over-quota tenant's tight retry loops


def embedding(priority: int) -> service_pb2.ModelInferRequest:
    return load.embedding_request("minilm", "How does a gateway keep critical traffic fast?", priority)


def generation(priority: int) -> service_pb2.ModelInferRequest:
    return load.generation_request("smollm2", "Write a short note about batch inference.", 16, priority)


async def capacity(target: load.Target, work: Workload, caller: load.Caller, seconds: float) -> float:
    """Completed requests per second with a closed loop deep enough to fill batches twice."""
    request = work.make(caller.triton_priority)
    send = _sender(target, caller, request, work.streaming, work.timeout)
    begin = target.now()
    done = await load.closed_loop(send, CAPACITY_DEPTH, begin + seconds, target.now)
    return sum(o.ok for o in done) / max(target.now() - begin, 1e-9)


def _sender(target: load.Target, caller: load.Caller, request: object, streaming: bool,
            timeout: float) -> load.Send:
    call = target.stream if streaming else target.infer
    return lambda: call(caller, request, timeout)  # type: ignore[arg-type]


async def _beside(target: load.Target, name: str, work: Workload, flood: flood_process.Flood | None,
                  seconds: float, critical: load.Caller, level: int) -> Phase:
    """The critical stream for `seconds`, beside `flood` (from its own process; see
    bench/flood.py) if there is one."""
    crit_send = _sender(target, critical, work.make(critical.triton_priority), work.streaming, work.timeout)

    def critical_loop(until: float) -> Awaitable[list[load.Outcome]]:
        return load.open_loop(crit_send, work.critical_rate, until, target.now, seed=1)

    if flood is None:
        start = target.now()
        return Phase(work.model, name, level, (start, start + seconds), await critical_loop(start + seconds), [])
    async with flood_process.started(flood) as flood_until:
        start = target.now()
        until = start + seconds
        crit, batch = await asyncio.gather(critical_loop(until), flood_until(until))
    return Phase(work.model, name, level, (start, until), crit, batch)


def _flood(target: load.Target, work: Workload, caller: load.Caller, **how: Any) -> flood_process.Flood:
    request = work.make(caller.triton_priority)
    return flood_process.Flood(url=target.url, epoch=target.epoch, caller=caller,
                               request=request.SerializeToString(),
                               streaming=work.streaming, timeout=work.batch_timeout, **how)


async def run_phase(target: load.Target, name: str, work: Workload, flood: int, cap: float,
                    seconds: float, critical: load.Caller, batch: load.Caller) -> Phase:
    """The critical stream beside a Poisson flood at `flood` x `cap` per second (none at 0)."""
    batch_flood = _flood(target, work, batch, rate=flood * cap) if flood else None
    return await _beside(target, name, work, batch_flood, seconds, critical, flood)


async def refusal_phase(target: load.Target, work: Workload, seconds: float, nice: int,
                        loops_at: load.Target | None = None) -> Phase:
    """The critical stream next to `REFUSAL_LOOPS` over-quota callers retrying at once,
    at the same gateway or at `loops_at`."""
    loops = _flood(loops_at or target, work, RETRY, concurrency=REFUSAL_LOOPS, retry_pause=0.0, nice=nice)
    name = REFUSALS_ELSEWHERE if loops_at else REFUSALS_TARGET if nice else REFUSALS_AT_PRIORITY
    return await _beside(target, name, work, loops, seconds, CRITICAL, 0)


async def measure_model(stack: Stack, work: Workload, policies: dict[str, dict[str, Any]], timing: Timing
                        ) -> tuple[float, list[Phase], profile.Profile | None]:
    targets = [("direct", stack.triton_url, DIRECT_CRITICAL, DIRECT_BATCH)]
    if stack.gateway_url:
        targets.append(("qosgate", stack.gateway_url, CRITICAL, BATCH))
    phases = []
    direct = load.Target(stack.triton_url)
    try:
        cap = await capacity(direct, work, DIRECT_BATCH, timing.capacity)
    finally:
        await direct.close()
    log.info("%s capacity %.1f req/s", work.model, cap)
    seconds = timing.phase
    found = None
    for name, url, critical, batch in targets:
        target = load.Target(url)
        try:
            for flood in LOADS:
                await asyncio.to_thread(stack.wait_idle, work.model)
                gateway = stack.gateway if name == "qosgate" else None
                cpu_before = gateway.cpu_seconds() if gateway else 0.0
                phase = await run_phase(target, name, work, flood, cap, seconds, critical, batch)
                if gateway:
                    phase.gateway_cpu = (gateway.cpu_seconds() - cpu_before) / seconds
                log.info("%s", phase.row())
                phases.append(phase)
            if name == "qosgate" and work.refusal_loops:
                elsewhere = load.Target(stack.start_second_gateway(tenants=TENANTS, models=policies),
                                        target.epoch)
                try:
                    for nice, loops_at in ((flood_process.NICE, None), (0, None), (flood_process.NICE, elsewhere)):
                        await asyncio.to_thread(stack.wait_idle, work.model)
                        assert stack.gateway is not None
                        cpu_before = stack.gateway.cpu_seconds()
                        phase = await refusal_phase(target, work, seconds, nice, loops_at)
                        phase.gateway_cpu = (stack.gateway.cpu_seconds() - cpu_before) / seconds
                        log.info("%s", phase.row())
                        phases.append(phase)
                finally:
                    await elsewhere.close()
                    assert stack.second_gateway is not None
                    stack.second_gateway.stop()  # idle, but not through the phases after these
            if name == "qosgate" and profile.py_spy() is not None:
                found = await profiled_phase(stack, target, work, cap, seconds)
        finally:
            await target.close()
    if stack.gateway_url:
        phases += await frontier_phases(stack, work, policies, cap, timing)
    return cap, phases, found


async def profiled_phase(stack: Stack, target: load.Target, work: Workload, cap: float,
                         seconds: float) -> profile.Profile:
    """py-spy on the gateway during an extra phase at the top flood (not in the figures:
    sampling perturbs a little)."""
    assert stack.gateway is not None
    await asyncio.to_thread(stack.wait_idle, work.model)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"isolation-{work.model}-gateway.pyspy.txt"
    recording = asyncio.to_thread(profile.record, stack.gateway.pgid, seconds, out)
    phase, found = await asyncio.gather(
        run_phase(target, "qosgate (profiled)", work, TOP, cap, seconds, CRITICAL, BATCH), recording)
    log.info("%s", phase.row())
    return found


async def frontier_phases(stack: Stack, work: Workload, policies: dict[str, dict[str, Any]], cap: float,
                          timing: Timing) -> list[Phase]:
    """Per objective of FRONTIER_OBJECTIVES a gateway started afresh: the critical stream
    alone for the lead-in (not counted), then beside the top flood."""
    phases = []
    for objective in FRONTIER_OBJECTIVES:
        await asyncio.to_thread(stack.wait_idle, work.model)
        scheduler = None if objective is None else {"latency_objective": {"critical": objective}}
        target = load.Target(stack.start_gateway(tenants=TENANTS, models=policies, scheduler=scheduler))
        try:
            await run_phase(target, "lead-in", work, 0, cap, timing.lead_in, CRITICAL, BATCH)
            phase = await run_phase(target, objective_target(objective), work, TOP, cap, timing.frontier,
                                    CRITICAL, BATCH)
        finally:
            await target.close()
        log.info("%s", phase.row())
        phases.append(phase)
    return phases


def run(ctx: RunContext) -> ScenarioResult:
    # A full run's phases last a minute: the critical stream's p99 is then about its sixth-
    # slowest of some 600 calls, not its third of 300 (four full runs of 30 s phases put
    # the 4x flood's p99 at 1.84-2.69x the unloaded one, on the same code).
    timing = Timing(phase=ctx.pick(6.0, 60.0), capacity=ctx.pick(5.0, 15.0), frontier=ctx.pick(6.0, 30.0),
                    lead_in=ctx.pick(3.0, 10.0))
    works = [
        Workload("minilm", embedding, streaming=False, critical_rate=10.0, timeout=10.0, batch_timeout=10.0,
                 refusal_loops=True),
        Workload("smollm2", generation, streaming=True, critical_rate=2.0, timeout=60.0, batch_timeout=15.0),
    ]
    policies = demo_model_policies([w.model for w in works])
    phases: list[Phase] = []
    capacities: dict[str, float] = {}
    tables: dict[str, list[dict[str, object]]] = {}
    notes = [f"{timing.phase:.0f} s per phase; floods are Poisson open loops at the multiple of the capacity "
             f"measured first (closed loop, {CAPACITY_DEPTH} deep, straight at Triton); critical: Poisson "
             + ", ".join(f"{w.critical_rate}/s on {w.model}" for w in works)
             + "; smollm2 streams of 16 tokens (ignore_eos); deadlines critical/batch "
             + ", ".join(f"{w.model} {w.timeout:g}/{w.batch_timeout:g} s" for w in works)
             + "; direct = Triton priority 1 (critical) / 4 (batch); "
             "qosgate's per-model settings, as config/demo.yaml ships them: "
             + "; ".join(f"{m} {p}" for m, p in policies.items())
             + f"; refusal loops: {REFUSAL_LOOPS} callers of a tenant limited to 1 request/s retrying "
             "without pause (minilm, through qosgate)"
             + f"; floods and refusal loops are sent from a process of their own at nice {flood_process.NICE} "
             "(bench/flood.py: their client's CPU is not the system under test's), the critical stream from "
             "the bench's at normal priority; one more refusal-loop phase runs with the loops at normal priority, "
             "and one with the loops (at nice 19) at a second gateway process in front of the same Triton, the "
             "critical stream still through the first"
             + ". Triton's batcher with priority levels (minilm) stalls some requests ~500 ms even "
             "unloaded, which inflates the direct baseline; the reference shows the absolute p99s.",
             f"Frontier: at the {TOP}x flood, a gateway started afresh per critical latency objective ("
             + ", ".join("none" if x is None else f"{x:g}x" for x in FRONTIER_OBJECTIVES)
             + f"), {timing.lead_in:.0f} s of the critical stream alone, then {timing.frontier:.0f} s measured; "
             "its critical p99 over the main qosgate phases' unloaded p99, its batch goodput over Triton "
             f"direct's at {TOP}x."]
    for work in works:
        with checked(Stack(models=[work.model])) as stack:
            if gateway_available():
                stack.start_gateway(tenants=TENANTS, models=policies)
            cap, model_phases, found = asyncio.run(measure_model(stack, work, policies, timing))
        capacities[work.model] = cap
        phases += model_phases
        if found is not None:
            tables.update({f"{work.model}: {name}": rows for name, rows in found.tables().items()})
            notes.append(f"{work.model} gateway profile: py-spy, {found.samples} samples during an extra "
                         f"{TOP}x phase; raw stacks in isolation-{work.model}-gateway.pyspy.txt.")
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: gateway half not measured.")
    notes.append("capacity: " + ", ".join(f"{m} {c:.1f} req/s" for m, c in capacities.items()))
    frontier_rows = [{"model": model, "run": point.label, "critical p99 / unloaded": round(point.latency_ratio, 2),
                      "batch goodput % of Triton direct's": round(point.goodput_pct, 1)}
                     for model in capacities for point in frontier(phases, model)]
    return ctx.result(figures(phases), {"phases": [p.row() for p in phases], "frontier": frontier_rows, **tables},
                      notes, plot=lambda path: draw(phases, path))


@dataclasses.dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One way of serving the top flood: what it left the critical class's p99 and the
    batch class's goodput."""

    label: str
    latency_ratio: float  # critical p99 at the flood over the same target's unloaded p99
    goodput_pct: float  # batch goodput, % of Triton direct's at the same flood


def frontier(phases: Sequence[Phase], model: str) -> list[FrontierPoint]:
    """Triton direct's point, then one per latency objective measured, in the order of
    FRONTIER_OBJECTIVES; none without the reference phases."""
    by = {(p.model, p.target, p.load): p for p in phases}
    direct_base, direct_top = by.get((model, "direct", 0)), by.get((model, "direct", TOP))
    gateway_base = by.get((model, "qosgate", 0))
    if direct_base is None or direct_top is None or gateway_base is None:
        return []
    direct_goodput = max(direct_top.batch_goodput(), 1e-9)

    def point(label: str, phase: Phase, base: Phase) -> FrontierPoint:
        return FrontierPoint(label, phase.critical_p99() / base.critical_p99(),
                             100 * phase.batch_goodput() / direct_goodput)

    points = [point("Triton direct", direct_top, direct_base)]
    for objective in FRONTIER_OBJECTIVES:
        phase = by.get((model, objective_target(objective), TOP))
        if phase is not None:
            points.append(point(objective_target(objective), phase, gateway_base))
    return points


def figures(phases: list[Phase]) -> list[Figure]:
    by = {(p.model, p.target, p.load): p for p in phases}
    out = []
    for model in dict.fromkeys(p.model for p in phases):
        metric = "TTFT" if model == "smollm2" else "latency"
        top, direct_top = by.get((model, "qosgate", TOP)), by.get((model, "direct", TOP))
        ratios, spans = {}, {}
        for target in ("direct", "qosgate"):
            base, loaded = by.get((model, target, 0)), by.get((model, target, TOP))
            if base and loaded:
                lo, hi = base.critical_p99(), loaded.critical_p99()
                ratios[target] = hi / lo
                spans[target] = f"p99 {lo * 1e3:,.0f} -> {hi * 1e3:,.0f} ms"
        refs = [f"qosgate {spans['qosgate']}" if "qosgate" in spans else "",
                f"Triton alone {ratios['direct']:.2f}x ({spans['direct']})" if "direct" in spans else ""]
        out.append(Figure(f"{model}: critical p99 {metric} at {TOP}x flood / unloaded",
                          ratios.get("qosgate"), "x", Aim("<=", 2.0), reference="; ".join(r for r in refs if r)))
        goodput, reference = None, ""
        if top and direct_top:
            goodput = 100 * top.batch_goodput() / max(direct_top.batch_goodput(), 1e-9)
            reference = f"qosgate {top.batch_goodput():.1f}, Triton direct {direct_top.batch_goodput():.1f} ok req/s"
        out.append(Figure(f"{model}: batch goodput at {TOP}x flood, qosgate / Triton direct", goodput, "%",
                          Aim(">=", 80.0), reference=reference))
        base, loops = by.get((model, "qosgate", 0)), by.get((model, REFUSALS_TARGET, 0))
        if base and loops:
            lo, hi = base.critical_p99(), loops.critical_p99()
            reference = f"qosgate p99 {lo * 1e3:,.0f} -> {hi * 1e3:,.0f} ms"
            at_priority = by.get((model, REFUSALS_AT_PRIORITY, 0))
            if at_priority:
                p99 = at_priority.critical_p99()
                reference += (f"; loops' client at normal priority {p99 * 1e3:,.0f} ms ({p99 / lo:.2f}x, "
                              f"{at_priority.refusals_per_s():,.0f} refusals/s)")
            elsewhere = by.get((model, REFUSALS_ELSEWHERE, 0))
            if elsewhere:
                p99 = elsewhere.critical_p99()
                reference += (f"; loops at a second gateway process {p99 * 1e3:,.0f} ms ({p99 / lo:.2f}x, "
                              f"{elsewhere.refusals_per_s():,.0f} refusals/s)")
            out.append(Figure(
                f"{model}: critical p99 {metric} with {REFUSAL_LOOPS} refusal loops / unloaded", hi / lo, "x",
                Aim("<=", 2.0), reference=reference))
            out.append(Figure(f"{model}: refusals answered per second (refusal loops)", loops.refusals_per_s(),
                              "/s", Aim(">=", 2000.0), reference=f"{REFUSAL_LOOPS} over-quota callers"))
        out.append(Figure(
            f"{model}: critical refusals at {TOP}x flood",
            None if top is None else float(sum(not o.ok for o in top.critical)), "", Aim("<=", 0.0),
            reference="" if direct_top is None else
            f"Triton alone {sum(not o.ok for o in direct_top.critical)}"))
    return out


def draw(phases: list[Phase], path: pathlib.Path) -> None:
    models = list(dict.fromkeys(p.model for p in phases))
    fig, axes = plots.panels(3 * len(models), rows=len(models))
    for i, model in enumerate(models):
        lat_ax, good_ax, frontier_ax = axes[3 * i: 3 * i + 3]
        for target in ("direct", "qosgate"):
            mine = [p for p in phases if p.model == model and p.target == target]
            if not mine:
                continue
            xs = [p.load for p in mine]
            color = plots.COLORS[target]
            for q, style in ((50, "-"), (99, "--")):
                lat_ax.plot(xs, [percentile(p.critical_latency(), q) * 1e3 for p in mine], style,
                            marker="o", color=color, label=f"{target} critical p{q}")
            good_ax.plot(xs, [p.batch_goodput() for p in mine], marker="o", color=color,
                         label=f"{target} batch goodput")
        markers = {REFUSALS_TARGET: ("*", ""), REFUSALS_AT_PRIORITY: ("P", ", their client at normal priority"),
                   REFUSALS_ELSEWHERE: ("X", " at a second gateway process")}
        for loops in (p for p in phases if p.model == model and p.target in markers):
            marker, where = markers[loops.target]
            lat_ax.plot([0], [loops.critical_p99() * 1e3], marker,
                        markersize=12, color=plots.COLORS["qosgate"],
                        label=f"qosgate critical p99, {REFUSAL_LOOPS} refusal loops{where} "
                              f"({loops.refusals_per_s():,.0f}/s)")
        metric = "TTFT" if model == "smollm2" else "latency"
        lat_ax.set_title(f"{model}: critical {metric}")
        lat_ax.set_ylabel("ms")
        lat_ax.set_yscale("log")
        good_ax.set_title(f"{model}: batch goodput")
        good_ax.set_ylabel("ok req/s")
        for ax in (lat_ax, good_ax):
            ax.set_xlabel("batch flood (x capacity)")
            ax.legend(fontsize=7)
        draw_frontier(frontier_ax, frontier(phases, model), f"{model}: at the {TOP}x flood, critical p99 {metric}")
    plots.save(fig, path)


def draw_frontier(ax: Any, points: list[FrontierPoint], title: str) -> None:
    """qosgate's points by latency objective, joined, and Triton direct's on its own."""
    ax.set_title(title)
    if not points:
        return
    direct, *gateway = points
    ax.plot([p.goodput_pct for p in gateway], [p.latency_ratio for p in gateway], marker="o",
            color=plots.COLORS["qosgate"], label="qosgate, by critical latency objective")
    for p in gateway:
        ax.annotate(p.label.removeprefix("qosgate, "), (p.goodput_pct, p.latency_ratio), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.plot([direct.goodput_pct], [direct.latency_ratio], "s", color=plots.COLORS["direct"],
            label="Triton direct (its priority levels)")
    ax.set_xlabel("batch goodput, % of Triton direct's")
    ax.set_ylabel("critical p99 / unloaded")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
