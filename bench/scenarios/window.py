"""window: `dispatch_window: auto` against fixed windows too small and too large, on
smollm2 in one run: output tokens/s of one class at concurrency 64, and a critical
stream's time to first token alone and under a batch flood of 4 x 64 streams, with the
window the gateway chose over time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import threading
import time
import urllib.request

from tritonclient.grpc import service_pb2

from bench import load, plots
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, gateway_available
from bench.stats import percentile

log = logging.getLogger(__name__)

MODEL = "smollm2"
MAX_TOKENS = 32
CRITICAL_TOKENS = 16
CRITICAL_STREAMS = 2
CONCURRENCY = 64  # smollm2's max_num_seqs: the engine's own batch limit
FLOOD = 4 * CONCURRENCY
THROUGHPUT_PASSES = 4
PROMPT = "Explain what a load balancer does, in detail."
STANDARD = load.Caller("standard", api_key="bench-standard-key", klass="standard")
CRITICAL = load.Caller("critical", api_key="bench-critical-key", klass="critical")
BATCH = load.Caller("batch", api_key="bench-batch-key", klass="batch")
TENANTS = [
    {"name": f"{c.label}-app", "api_keys": [{"key": c.api_key}], "default_class": c.klass, "max_class": c.klass}
    for c in (STANDARD, CRITICAL, BATCH)
]


@dataclasses.dataclass(slots=True)
class Run:
    """One gateway configuration through the three phases."""

    name: str
    policy: dict[str, object]
    # One per pass: the passes go through the windows in alternating orders.
    tokens_per_s_passes: list[float] = dataclasses.field(default_factory=list)
    unloaded_ttft_ms: list[float] = dataclasses.field(default_factory=list)
    flood_ttft_ms: list[float] = dataclasses.field(default_factory=list)
    windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (s, window)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens_per_s_passes) / len(self.tokens_per_s_passes)

    def ttft_ratio(self) -> float:
        return percentile(self.flood_ttft_ms, 99) / percentile(self.unloaded_ttft_ms, 99)

    def row(self) -> dict[str, object]:
        sizes = [w for _, w in self.windows]
        return {"window": self.name, "tokens/s (64 streams)": round(self.tokens_per_s, 1),
                "tokens/s per pass": " / ".join(f"{t:.1f}" for t in self.tokens_per_s_passes),
                "critical TTFT p99 unloaded ms": round(percentile(self.unloaded_ttft_ms, 99)),
                "critical TTFT p99 under flood ms": round(percentile(self.flood_ttft_ms, 99)),
                "flood / unloaded": round(self.ttft_ratio(), 2),
                "critical streams under flood": len(self.flood_ttft_ms),
                "window min..max seen": f"{min(sizes):.0f}..{max(sizes):.0f}" if sizes else "-"}


class WindowSampler:
    """Reads the gateway's qosgate_dispatch_window every half second, in a thread."""

    def __init__(self, url: str, epoch: float) -> None:
        self._url, self._epoch = url, epoch
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WindowSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with urllib.request.urlopen(self._url, timeout=2) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(f'qosgate_dispatch_window{{model="{MODEL}"}}'):
                    self.samples.append((time.monotonic() - self._epoch, float(line.split()[-1])))


def _ttft_ms(outcomes: list[load.Outcome], lo: float, hi: float) -> list[float]:
    return [o.ttft * 1e3 for o in outcomes if o.ok and o.ttft is not None and lo <= o.start < hi]


def _streams_until(target: load.Target, caller: load.Caller, req: service_pb2.ModelInferRequest,
                   until: float) -> load.Send:
    # The phase's end is every stream's deadline: what is still queued then is dropped by
    # the gateway, not served into the next phase. At least a second: a deadline that
    # ends the call between its write and its close fails the client's close.
    return lambda: target.stream(caller, req, max(1.0, until - target.now()))


async def warm_engine(url: str, seconds: float) -> None:
    """64 streams, not counted: a fresh engine's first batches are slow (its kernels warm
    up), and without this the first window measured pays for them."""
    target = load.Target(url)
    try:
        until = target.now() + seconds
        send = _streams_until(target, STANDARD, load.generation_request(MODEL, PROMPT, MAX_TOKENS), until)
        await load.closed_loop(send, CONCURRENCY, until, target.now)
    finally:
        await target.close()


async def throughput(url: str, run: Run, warmup: float, seconds: float) -> None:
    """Output tokens/s of one class at 64 streams, counted after `warmup`."""
    target = load.Target(url)
    request = load.generation_request(MODEL, PROMPT, MAX_TOKENS)
    try:
        begin = target.now()
        until = begin + warmup + seconds
        outcomes = await load.closed_loop(_streams_until(target, STANDARD, request, until), CONCURRENCY, until, target.now)
        run.tokens_per_s_passes.append(sum(begin + warmup <= t < until for o in outcomes for t in o.token_times) / seconds)
    finally:
        await target.close()


async def phases(url: str, run: Run, warmup: float, settle: float, seconds: float) -> None:
    """Throughput of one class at 64 streams; critical streams alone; the same under a
    batch flood of 4 x 64, measured once the flood has settled in (the requests the window
    admitted before it moved have drained)."""
    await throughput(url, run, warmup, seconds)
    target = load.Target(url)
    request = load.generation_request(MODEL, PROMPT, MAX_TOKENS)
    critical_request = load.generation_request(MODEL, PROMPT, CRITICAL_TOKENS)

    try:
        begin = target.now()
        until = begin + seconds
        alone = await load.closed_loop(_streams_until(target, CRITICAL, critical_request, until), CRITICAL_STREAMS, until,
                                       target.now)
        run.unloaded_ttft_ms = _ttft_ms(alone, begin, until)

        begin = target.now()
        until = begin + settle + seconds
        flood = asyncio.ensure_future(load.closed_loop(_streams_until(target, BATCH, request, until), FLOOD, until, target.now))
        critical = await load.closed_loop(_streams_until(target, CRITICAL, critical_request, until), CRITICAL_STREAMS, until,
                                          target.now)
        await flood
        run.flood_ttft_ms = _ttft_ms(critical, begin + settle, until)
    finally:
        await target.close()


def run(ctx: RunContext) -> ScenarioResult:
    warmup, settle, seconds = ctx.pick((6.0, 20.0, 15.0), (15.0, 20.0, 45.0))
    notes = [f"smollm2, {MAX_TOKENS}-token streams (ignore_eos, greedy) over KServe ModelStreamInfer. Per "
             f"window: {CONCURRENCY} `standard` streams ({warmup:.0f} s warm-up, {seconds:.0f} s counted); "
             f"then {CRITICAL_STREAMS} `critical` streams of {CRITICAL_TOKENS} tokens alone ({seconds:.0f} s); "
             f"then the same next to {FLOOD} `batch` streams ({settle:.0f} s for the flood to settle in, "
             f"{seconds:.0f} s counted). Every window in one run, one gateway after the other on the same "
             f"Triton, after {settle:.0f} s of engine warm-up at 64 streams; then {THROUGHPUT_PASSES - 1} more "
             "throughput passes, each through the windows in the opposite order of the one before (tokens/s is "
             "the mean of all); closed loops, each phase's end is its streams' deadline."]
    runs = [Run("auto", {}), Run("fixed 4 (too small)", {"dispatch_window": 4}),
            Run("fixed 64 (too large)", {"dispatch_window": CONCURRENCY})]
    if not ctx.quick:
        runs.insert(2, Run("fixed 16 (hand-tuned)", {"dispatch_window": 16}))
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("auto tokens/s / best fixed", None, "%", Aim(">=", 95.0))], {}, notes)
    epoch = time.monotonic()
    with checked(Stack(models=[MODEL])) as stack:
        asyncio.run(warm_engine(stack.start_gateway(tenants=TENANTS, models={MODEL: {"dispatch_window": CONCURRENCY}}),
                                settle))
        for r in runs:
            stack.wait_idle(MODEL)
            url = stack.start_gateway(tenants=TENANTS, models={MODEL: r.policy})
            with WindowSampler(stack.gateway_metrics_url, epoch) as sampler:
                asyncio.run(phases(url, r, warmup, settle, seconds))
            r.windows = sampler.samples
        # More throughput passes, each in the opposite order of the one before: drift on a
        # shared machine (15 % between two passes of one window) favours no window.
        for n in range(1, THROUGHPUT_PASSES):
            for r in reversed(runs) if n % 2 else runs:
                stack.wait_idle(MODEL)
                asyncio.run(throughput(stack.start_gateway(tenants=TENANTS, models={MODEL: r.policy}), r, warmup, seconds))
        for r in runs:
            log.info("%s", r.row())
    auto, fixed = runs[0], runs[1:]
    best = max(fixed, key=lambda r: r.tokens_per_s)
    figures = [
        Figure("auto tokens/s at concurrency 64 / best fixed window", 100 * auto.tokens_per_s / best.tokens_per_s,
               "%", Aim(">=", 95.0), reference=f"auto {auto.tokens_per_s:.1f}, best fixed ({best.name}) "
               f"{best.tokens_per_s:.1f} tokens/s"),
        Figure("auto: critical TTFT p99 under a 4x batch flood / unloaded", auto.ttft_ratio(), "x", Aim("<=", 2.0),
               reference=", ".join(f"{r.name} {r.ttft_ratio():.2f}x" for r in fixed)),
    ]
    return ctx.result(figures, {"windows": [r.row() for r in runs]}, notes, plot=lambda path: draw(runs, path))


def draw(runs: list[Run], path: pathlib.Path) -> None:
    fig, (over_time, tps, ttft) = plots.panels(3)
    for r in runs:
        if r.windows:
            start = r.windows[0][0]
            over_time.plot([t - start for t, _ in r.windows], [w for _, w in r.windows], label=r.name)
    names = [r.name.split(" (")[0] for r in runs]
    tps.bar(names, [r.tokens_per_s for r in runs], color="tab:green")
    xs = range(len(runs))
    ttft.bar([x - 0.2 for x in xs], [percentile(r.unloaded_ttft_ms, 99) for r in runs], 0.4, label="alone")
    ttft.bar([x + 0.2 for x in xs], [percentile(r.flood_ttft_ms, 99) for r in runs], 0.4, label="4x batch flood")
    ttft.set_xticks(list(xs), names)
    over_time.set_xlabel("seconds since the gateway started (throughput, alone, flood)")
    over_time.set_ylabel("dispatch window")
    over_time.set_title("smollm2: qosgate_dispatch_window over the run")
    over_time.legend(fontsize=7)
    tps.set_ylabel("tokens/s")
    tps.set_title(f"output tokens/s, {CONCURRENCY} standard streams")
    ttft.set_ylabel("ms")
    ttft.set_title("critical time to first token, p99")
    ttft.legend(fontsize=7)
    plots.save(fig, path)
