"""llm: streaming generation on smollm2 at several concurrencies, straight at Triton and
through each of qosgate's ways in, side by side: KServe ModelStreamInfer (the same client
as straight at Triton), qosgate.v1 GenerateStream, and the OpenAI-compatible HTTP API
(streamed /v1/completions). Output tokens/s, time to first token and inter-token latency;
at the top concurrency each way's tokens/s and TTFT p50 against direct's, and the same
load through nginx grpc_pass: what one bare proxy hop costs on this machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import pathlib
import statistics

from bench import load, plots, profile
from bench.report import RESULTS_DIR, Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, demo_model_policies, gateway_available
from bench.stats import percentile
from qosgate.v1 import generation_pb2

log = logging.getLogger(__name__)

MODEL = "smollm2"
MAX_TOKENS = 32
API_KEY = "bench-llm-key"
PROMPT = "Explain what a load balancer does, in detail."
KSERVE = "qosgate"
V1 = "qosgate v1"
HTTP = "qosgate HTTP"
WAYS = (KSERVE, V1, HTTP)
HOP = "nginx"
TENANTS = [{"name": "llm", "api_keys": [{"key": API_KEY}]}]
# Each point's first seconds are not counted. Its streams start spread over the first
# STAGGER_S of them: streams of one length that start together end together, and their
# successors arrive together, for as long as the point runs. Started at once, a point's
# time to first token was that of waves of prefills whose sizes each run drew apart
# (TTFT p50 of four direct runs at concurrency 32: 194-297 ms).
WARMUP_S = 3.0
STAGGER_S = 2.0


@dataclasses.dataclass(slots=True)
class Point:
    """One target at one concurrency."""

    target: str
    concurrency: int
    seconds: float
    outcomes: list[load.Outcome]
    window: tuple[float, float]
    gateway_cpu_s: float | None = None  # the gateway's CPU over the whole point (warm-up too)

    def gateway_us_per_token(self) -> float | None:
        tokens = sum(len(o.token_times) for o in self.outcomes)
        return None if self.gateway_cpu_s is None or not tokens else 1e6 * self.gateway_cpu_s / tokens

    def tokens_per_s(self) -> float:
        lo, hi = self.window
        return sum(lo <= t < hi for o in self.outcomes for t in o.token_times) / self.seconds

    def streams_per_s(self) -> float:
        lo, hi = self.window
        return sum(o.ok and lo <= o.end < hi for o in self.outcomes) / self.seconds

    def measured(self) -> list[load.Outcome]:
        """The streams that started inside the window (not those of the warm-up)."""
        lo, hi = self.window
        return [o for o in self.outcomes if o.ok and lo <= o.start < hi]

    def ttft_ms(self) -> list[float]:
        return [o.ttft * 1e3 for o in self.measured() if o.ttft is not None]

    def itl_ms(self) -> list[float]:
        return [gap * 1e3 for o in self.measured() for gap in o.inter_token()]

    def row(self) -> dict[str, object]:
        ttft, itl = self.ttft_ms(), self.itl_ms()
        return {"target": self.target, "concurrency": self.concurrency,
                "tokens/s": round(self.tokens_per_s(), 1),
                "TTFT p50 ms": percentile(ttft, 50), "TTFT p99 ms": percentile(ttft, 99),
                "ITL p50 ms": percentile(itl, 50), "ITL p99 ms": percentile(itl, 99),
                "streams ok": sum(o.ok for o in self.outcomes),
                "failed": sum(not o.ok for o in self.outcomes),
                "gateway CPU us/token": None if (cpu := self.gateway_us_per_token()) is None else round(cpu, 1)}


async def _closed_loop(target: load.Target | load.OpenAITarget, send: load.Send, name: str,
                       concurrency: int, seconds: float) -> Point:
    try:
        begin = target.now() + WARMUP_S
        outcomes = await load.closed_loop(send, concurrency, begin + seconds, target.now, stagger=STAGGER_S)
    finally:
        await target.close()
    point = Point(name, concurrency, seconds, outcomes, (begin, begin + seconds))
    log.info("%s", point.row())
    return point


async def measure(url: str, name: str, caller: load.Caller, concurrency: int, seconds: float) -> Point:
    target = load.Target(url)
    request = load.generation_request(MODEL, PROMPT, MAX_TOKENS)
    return await _closed_loop(target, lambda: target.stream(caller, request, 120.0), name, concurrency, seconds)


async def measure_v1(url: str, name: str, caller: load.Caller, concurrency: int, seconds: float) -> Point:
    """The same load through qosgate.v1 GenerateStream (greedy; no ignore_eos there
    either: see measure_http)."""
    target = load.Target(url)
    request = generation_pb2.GenerateStreamRequest(
        model=MODEL, prompt=PROMPT, sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    return await _closed_loop(target, lambda: target.generate_stream(caller, request, 120.0), name, concurrency, seconds)


async def measure_http(base_url: str, name: str, caller: load.Caller, concurrency: int, seconds: float) -> Point:
    """The same load through the OpenAI API. It has no ignore_eos: a stream may end before
    MAX_TOKENS, which the token counts show (this prompt runs long under greedy decoding)."""
    target = load.OpenAITarget(base_url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return await _closed_loop(target, lambda: target.completion_stream(caller, body, 120.0), name, concurrency, seconds)


def profile_gateway(stack: Stack, caller: load.Caller, concurrency: int, seconds: float) -> profile.Profile:
    """py-spy on the gateway during an extra run at `concurrency` (sampling perturbs a little)."""
    assert stack.gateway is not None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        found = pool.submit(profile.record, stack.gateway.pgid, seconds, RESULTS_DIR / "llm-gateway.pyspy.txt")
        asyncio.run(measure(stack.gateway_url, "qosgate (profiled)", caller, concurrency, seconds))
        return found.result()


def run(ctx: RunContext) -> ScenarioResult:
    levels: list[int] = ctx.pick([1, 8, 32], [1, 2, 4, 8, 16, 32])
    seconds = ctx.pick(10.0, 30.0)
    notes = [f"{MAX_TOKENS}-token streams (ignore_eos, greedy), closed loop (the streams start spread over "
             f"{STAGGER_S:g} s), {WARMUP_S:g} s of warm-up then "
             f"{seconds:.0f} s measured per point; tokens/s counts tokens received inside the measured window, "
             "TTFT and ITL the streams started inside it; qosgate: smollm2 as config/demo.yaml "
             "ships it (the auto window).",
             f"{V1}: the same prompt as qosgate.v1 GenerateStream; {HTTP}: as streamed /v1/completions "
             "through the OpenAI API (no ignore_eos in either: a stream may end early, which its "
             "tokens/s would show).",
             f"{HOP}: the KServe load through nginx grpc_pass (1 worker, upstream keepalive) at the top "
             "concurrency, the client straight at Triton's: what one bare proxy hop costs here."]
    points: list[Point] = []
    found: profile.Profile | None = None
    with checked(Stack(models=[MODEL])) as stack:
        targets = [("direct", stack.triton_url, load.Caller("direct"))]
        if gateway_available():
            url = stack.start_gateway(tenants=TENANTS, models=demo_model_policies([MODEL]))
            targets.append((KSERVE, url, load.Caller(KSERVE, api_key=API_KEY)))
            targets.append((V1, url, load.Caller(V1, api_key=API_KEY)))
            targets.append((HTTP, stack.gateway_openai_url, load.Caller(HTTP, api_key=API_KEY)))
        else:
            notes.append("qosgate serve is not available in this checkout: gateway half not measured.")
        # A bare hop (C, no policy) with the direct client, at the top concurrency only.
        hop = (HOP, stack.start_nginx(), load.Caller(HOP))
        top_targets = [targets[0], hop, *targets[1:]]
        # The aim's level runs in forward and reverse order (A B B A), so a drift of the
        # shared machine during the pair does not favour either target; the quick run's
        # shorter points run two such pairs (one 10 s point of a target reads 10% apart
        # from the next on this machine).
        pairs = ctx.pick(2, 1)
        rounds = [(c, targets) for c in levels[:-1]]
        rounds += [(levels[-1], top_targets), (levels[-1], top_targets[::-1])] * pairs
        for concurrency, ordered in rounds:
            for name, url, caller in ordered:
                stack.wait_idle(MODEL)
                run_point = {HTTP: measure_http, V1: measure_v1}.get(name, measure)
                gateway = stack.gateway if name in WAYS else None
                before = gateway.cpu_seconds() if gateway else 0.0
                point = asyncio.run(run_point(url, name, caller, concurrency, seconds))
                if gateway:
                    point.gateway_cpu_s = gateway.cpu_seconds() - before
                points.append(point)
        if stack.gateway is not None and profile.py_spy() is not None:
            found = profile_gateway(stack, targets[1][2], levels[-1], ctx.pick(8.0, 15.0))
            notes.append(f"gateway profile: py-spy, {found.samples} samples during an extra run at "
                         f"concurrency {levels[-1]}; raw stacks in llm-gateway.pyspy.txt.")
    top = levels[-1]
    direct = [p for p in points if p.target == "direct" and p.concurrency == top]
    direct_tps = statistics.fmean(p.tokens_per_s() for p in direct)
    direct_ttft = percentile([t for p in direct for t in p.ttft_ms()], 50)
    hops = [p for p in points if p.target == HOP]
    hop_tps = statistics.fmean(p.tokens_per_s() for p in hops)
    hop_ttft = percentile([t for p in hops for t in p.ttft_ms()], 50)
    bare = f"through {HOP} grpc_pass (a bare hop) / direct, concurrency {top}"
    figures: list[Figure] = [
        Figure(f"tokens/s {bare}", 100 * hop_tps / direct_tps, "%",
               reference=f"direct {direct_tps:.1f} tokens/s, {HOP} {hop_tps:.1f}"),
        Figure(f"TTFT p50 {bare}", 100 * hop_ttft / direct_ttft, "%",
               reference=f"direct {direct_ttft:.0f} ms, {HOP} {hop_ttft:.0f} ms"),
    ]
    # Streams of one length (ignore_eos) through KServe: the streams/s that config/demo.yaml's
    # settings let through, against Triton's own.
    kserve = [p for p in points if p.target == KSERVE and p.concurrency == top]
    direct_sps = statistics.fmean(p.streams_per_s() for p in direct)
    sps = statistics.fmean(p.streams_per_s() for p in kserve) if kserve else None
    figures.append(Figure(f"streams/s through {KSERVE} / direct, concurrency {top}",
                          None if sps is None else 100 * sps / direct_sps, "%", Aim(">=", 95.0),
                          reference=f"direct {direct_sps:.2f} streams/s" + ("" if sps is None else f", {KSERVE} {sps:.2f}")))
    for way in WAYS:
        runs = [p for p in points if p.target == way and p.concurrency == top]
        tps = statistics.fmean(p.tokens_per_s() for p in runs) if runs else None
        ttft = percentile([t for p in runs for t in p.ttft_ms()], 50) if runs else None
        figures.append(Figure(f"tokens/s through {way} / direct, concurrency {top}",
                              None if tps is None else 100 * tps / direct_tps, "%", Aim(">=", 97.0),
                              reference=f"direct {direct_tps:.1f} tokens/s" + (
                                  "" if tps is None else f", {way} {tps:.1f} (mean of {len(runs)} interleaved runs each)")))
        figures.append(Figure(f"TTFT p50 through {way} / direct, concurrency {top}",
                              None if ttft is None else 100 * ttft / direct_ttft, "%", Aim("<=", 105.0),
                              reference=f"direct {direct_ttft:.0f} ms, {HOP} {hop_ttft:.0f} ms" + (
                                  "" if ttft is None else f", {way} {ttft:.0f} ms")))
        # On this machine the engine and the gateway share two cores: what the gateway
        # spends per token is taken from the engine, and reads steadier than tokens/s.
        cpu = [c for p in runs if (c := p.gateway_us_per_token()) is not None]
        figures.append(Figure(f"gateway CPU per token through {way}, concurrency {top}",
                              statistics.fmean(cpu) if cpu else None, "us",
                              reference=", ".join(f"{c:.0f}" for c in cpu) + " us in its runs"))
    tables: dict[str, list[dict[str, object]]] = {"streams": [p.row() for p in points]}
    if found is not None:
        tables.update(found.tables())
    return ctx.result(figures, tables, notes,
                      plot=lambda path: draw(points, path))


def draw(points: list[Point], path: pathlib.Path) -> None:
    fig, (tps, ttft, itl) = plots.panels(3)
    for target in ("direct", HOP, *WAYS):
        firsts = {p.concurrency: p for p in reversed(points) if p.target == target}
        mine = [firsts[c] for c in sorted(firsts)]
        if not mine:
            continue
        xs = [p.concurrency for p in mine]
        color = plots.COLORS[target]
        tps.plot(xs, [p.tokens_per_s() for p in mine], marker="o", color=color, label=target)
        for q, style in ((50, "-"), (99, "--")):
            for ax, get in ((ttft, Point.ttft_ms), (itl, Point.itl_ms)):
                ax.plot(xs, [percentile(get(p), q) for p in mine], style, marker="o", color=color,
                        label=f"{target} p{q}")
    plots.label([(tps, "output tokens/s", "tokens/s"), (ttft, "time to first token", "ms"),
                 (itl, "inter-token latency", "ms")], prefix="smollm2", xlabel="concurrent streams", log2_x=True)
    plots.save(fig, path)
