"""overhead: what one hop costs. perf_analyzer on the identity model at several
concurrencies, straight at Triton, through nginx grpc_pass, through qosgate's relay alone
(no policy: the floor of its data path, bench/relay_alone.py) and through qosgate (its
relay serves ModelInfer); then `--streaming` (ModelStreamInfer, one stream per perf_analyzer
context) at concurrency 16 on each path. At concurrency 16 also through a second qosgate
whose quota store is a Redis (`quota_store: redis`, which also shares fair share between
gateways), measured in the same rounds as the one with the in-memory store.

The hops' CPU per request comes from /proc (utime+stime of the hop's process group over
the measurement) divided by the requests Triton counted in the same interval.

The full run measures every point in `ROUNDS` rounds, each with the hops started afresh,
and reports each figure's median over them (the table shows the range): one process of
the same code can run steadily cheaper or dearer than its twin for as long as it lives
(bench/ab.py), and on a shared 2-core machine one point can meet a burst of someone
else's work.

The model is model_repository/identity as shipped: priority levels and queue bounds, with
two instances, which is what keeps Triton 2.51's batcher from stalling ~500 ms on a
missed wake-up (see docs/local-stack.md, "Known issue").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pathlib
import statistics
import time
from collections.abc import Callable

import tritonclient.grpc as grpcclient

from bench import perf, plots, profile
from bench.report import RESULTS_DIR, Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import GroupProcess, Stack, checked, gateway_available

log = logging.getLogger(__name__)

MODEL = "identity"
SHAPE = ("INPUT0:16",)
API_KEY = "bench-overhead-key"
# The concurrency of the CPU aim (issue 15), in both modes, and where `--streaming` runs: at
# 32, tritonserver 2.51 itself crashed (SIGSEGV in TRITONSERVER_InferenceRequestDelete) in
# 2 of 5 `--streaming` runs straight at it with 20,000 requests; at 16 it ran 20 of 20.
BUSY = 16
# A point runs for seconds; perf_analyzer's own hang after the last response (bench/perf.py)
# costs this long before the point runs again.
PERF_TIMEOUT_S = 120.0
# The gateways have their defaults: no per-model setting (the `auto` dispatch window).
TENANTS = [{"name": "bench", "api_keys": [{"key": API_KEY}]}]
# The gateway of the same config with `quota_store: redis` (measured at BUSY, unary).
REDIS_GATEWAY = "qosgate redis"
ROUNDS = 3  # in the full run


@dataclasses.dataclass(slots=True)
class Sample:
    """One target at one concurrency: perf_analyzer's figures plus the hop's CPU cost."""

    target: str
    point: perf.PerfPoint
    cpu_us_per_request: float | None
    streaming: bool = False


def successes(triton_url: str) -> int:
    client = grpcclient.InferenceServerClient(url=triton_url)
    try:
        stats = client.get_inference_statistics(MODEL, as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


def measure_target(stack: Stack, target: str, url: str, hop: GroupProcess | None,
                   concurrency: int, settings: perf.PerfSettings, *, notes: list[str],
                   streaming: bool = False) -> Sample:
    """One point; measured once more after a Triton that died under it (tritonserver 2.51
    crashes now and then under `--streaming`, docs/dev/performance-history.md) was started again, said in `notes`."""
    try:
        return _measure_target(stack, target, url, hop, concurrency, settings, streaming=streaming)
    except perf.PerfAnalyzerFailed:
        died = stack.restart_dead_tritons()
        if not died:
            raise
    what = f"{target} at concurrency {concurrency}{' streaming' if streaming else ''}"
    log.warning("%s while measuring %s: restarted it, measuring again", "; ".join(died), what)
    notes.append(f"{'; '.join(died)} while {what} was measured: restarted, and the point measured again.")
    wait_served(url, target)
    return _measure_target(stack, target, url, hop, concurrency, settings, streaming=streaming)


def caller_headers(target: str) -> dict[str, str]:
    return {"authorization": f"Bearer {API_KEY}"} if target in ("qosgate", REDIS_GATEWAY) else {}


def perf_headers(target: str) -> tuple[str, ...]:
    """`caller_headers` as perf_analyzer's -H takes them."""
    return tuple(f"{name}:{value}" for name, value in caller_headers(target).items())


def wait_served(url: str, target: str, timeout: float = 30.0) -> None:
    """Wait until `target` at `url` serves the model again: a hop reconnects to a restarted
    Triton by itself, but not in the instant Triton says it is ready."""
    deadline = time.monotonic() + timeout
    client = grpcclient.InferenceServerClient(url=url)
    try:
        while True:
            try:
                client.get_model_metadata(MODEL, headers=caller_headers(target))
                return
            except grpcclient.InferenceServerException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        client.close()


def _measure_target(stack: Stack, target: str, url: str, hop: GroupProcess | None,
                    concurrency: int, settings: perf.PerfSettings, *, streaming: bool) -> Sample:
    headers = perf_headers(target)
    before_count = successes(stack.triton_url)
    before_cpu = hop.cpu_seconds() if hop else 0.0
    point = perf.measure(url=url, model=MODEL, concurrency=concurrency, settings=settings,
                         shape=SHAPE, headers=headers, extra=("--streaming",) if streaming else (),
                         timeout=PERF_TIMEOUT_S, watch=stack.triton_failure)
    cpu_us = None
    if hop is not None:
        requests = successes(stack.triton_url) - before_count
        cpu_us = (hop.cpu_seconds() - before_cpu) * 1e6 / max(requests, 1)
    log.info("%s c=%d%s: %.0f infer/s p50 %.0f us p99 %.0f us cpu/req %s us", target, concurrency,
             " streaming" if streaming else "", point.throughput, point.p50_us, point.p99_us,
             f"{cpu_us:.0f}" if cpu_us else "-")
    return Sample(target, point, cpu_us, streaming)


def profile_gateway(stack: Stack, url: str, concurrency: int, rate: float, seconds: float
                    ) -> profile.Profile:
    """py-spy on the gateway while perf_analyzer keeps it as busy as in the measured run
    (a separate run: sampling perturbs the figures a little)."""
    settings = perf.PerfSettings(requests=int(rate * (seconds + 3)))
    assert stack.gateway is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(perf.measure, url=url, model=MODEL, concurrency=concurrency, settings=settings,
                           shape=SHAPE, headers=perf_headers("qosgate"), watch=stack.triton_failure)
        time.sleep(1.0)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        found = profile.record(stack.gateway.pgid, seconds, RESULTS_DIR / "overhead-gateway.pyspy.txt")
        busy.result()
    return found


def run(ctx: RunContext) -> ScenarioResult:
    levels: list[int] = ctx.pick([1, 4, 16], [1, 2, 4, 8, 16, 32])
    rounds: int = ctx.pick(1, ROUNDS)
    settings = perf.PerfSettings(requests=ctx.pick(5000, 8000))
    notes = [f"identity model (FP32[16]) as shipped, the gateways with their defaults (no per-model setting), "
             f"perf_analyzer 2.51.0 closed loop, "
             f"{settings.requests} requests per point and round; nginx 1 worker with grpc_pass and upstream keepalive."]
    if rounds > 1:
        notes.append(f"{rounds} rounds, each with nginx, the relay alone, both gateways and Redis started afresh; "
                     "every figure is the median of its rounds, the table shows their range.")
    runs: list[tuple[int, Sample]] = []
    found: profile.Profile | None = None
    with_gateway = gateway_available()
    if not with_gateway:
        notes.append("qosgate serve is not available in this checkout: gateway half not measured.")
    with checked(Stack(models=[MODEL])) as stack:
        for _ in range(rounds):
            targets = start_hops(stack, with_gateway)
            for concurrency in levels:
                # Targets interleave at each level so machine drift hits them alike.
                for name, url, hop in targets:
                    if name == REDIS_GATEWAY and concurrency != BUSY:
                        continue
                    runs.append((concurrency, measure_target(stack, name, url, hop, concurrency, settings,
                                                             notes=notes)))
            for name, url, hop in targets:
                if name == REDIS_GATEWAY:
                    continue
                runs.append((BUSY, measure_target(stack, name, url, hop, BUSY, settings, notes=notes,
                                                  streaming=True)))
        points = by_point(runs)
        samples = [(c, median(c, group)) for (c, _, _), group in points.items()]
        if stack.gateway is not None and profile.py_spy() is not None:
            measured = next(s for c, s in samples if c == BUSY and s.target == "qosgate" and not s.streaming)
            found = profile_gateway(stack, stack.gateway_url, BUSY, measured.point.throughput, ctx.pick(5.0, 15.0))
            notes.append(f"gateway profile: py-spy, {found.samples} samples at concurrency {BUSY} "
                         "(native frames, so the compiled modules show; samples waiting for I/O excluded); "
                         "raw stacks in overhead-gateway.pyspy.txt.")
    figures, tables = summarise(samples, levels, {key: spread(group) for key, group in points.items()}
                                if rounds > 1 else None)
    if found is not None:
        tables.update(found.tables())
    return ctx.result(figures, tables, notes=notes, plot=lambda path: draw(samples, path))


def start_hops(stack: Stack, with_gateway: bool) -> list[tuple[str, str, GroupProcess | None]]:
    """A round's targets, each hop a fresh process: (name, gRPC target, its process)."""
    targets: list[tuple[str, str, GroupProcess | None]] = [
        ("direct", stack.triton_url, None), ("nginx", stack.start_nginx(), stack.nginx)]
    if with_gateway:
        targets.append(("relay alone", stack.start_relay_alone(), stack.relay_alone))
        url = stack.start_gateway(tenants=TENANTS)
        targets.append(("qosgate", url, stack.gateway))
        stack.start_redis()
        url = stack.start_second_gateway(tenants=TENANTS, redis=True)
        targets.append((REDIS_GATEWAY, url, stack.second_gateway))
    return targets


Point = tuple[int, str, bool]  # concurrency, target, streaming


def by_point(runs: list[tuple[int, Sample]]) -> dict[Point, list[Sample]]:
    """The rounds' samples of each point, the points in the order first measured."""
    grouped: dict[Point, list[Sample]] = {}
    for c, s in runs:
        grouped.setdefault((c, s.target, s.streaming), []).append(s)
    return grouped


def median(concurrency: int, rounds: list[Sample]) -> Sample:
    """One point's rounds as one sample, each figure the median of its rounds."""
    cpu = [s.cpu_us_per_request for s in rounds if s.cpu_us_per_request is not None]
    point = perf.PerfPoint(concurrency, *(statistics.median(getattr(s.point, name) for s in rounds)
                                          for name in ("throughput", "p50_us", "p90_us", "p99_us")))
    return Sample(rounds[0].target, point, statistics.median(cpu) if cpu else None, rounds[0].streaming)


def spread(rounds: list[Sample]) -> dict[str, str]:
    """One point's range over the rounds, as table cells: throughput and hop CPU."""
    rates = [s.point.throughput for s in rounds]
    cpu = [s.cpu_us_per_request for s in rounds if s.cpu_us_per_request is not None]
    return {"infer/s range": f"{min(rates):,.0f}-{max(rates):,.0f}",
            "hop CPU range": f"{min(cpu):.0f}-{max(cpu):.0f} us" if cpu else ""}


def summarise(samples: list[tuple[int, Sample]], levels: list[int],
              ranges: dict[Point, dict[str, str]] | None = None
              ) -> tuple[list[Figure], dict[str, list[dict[str, object]]]]:
    by = {(c, s.target): s for c, s in samples if not s.streaming}
    streams = {s.target: s for _, s in samples if s.streaming}
    rows: list[dict[str, object]] = [
        {"concurrency": c, "target": s.target, "mode": "streaming" if s.streaming else "unary",
         "infer/s": round(s.point.throughput, 1),
         "p50 ms": s.point.p50_us / 1e3, "p99 ms": s.point.p99_us / 1e3,
         "hop CPU us/req": "" if s.cpu_us_per_request is None else round(s.cpu_us_per_request, 1),
         **(ranges[(c, s.target, s.streaming)] if ranges is not None else {})}
        for c, s in samples
    ]
    figures: list[Figure] = []
    low = levels[0]
    nginx_added = (by[(low, "nginx")].point.p50_us - by[(low, "direct")].point.p50_us) / 1e3
    if (low, "qosgate") not in by:
        figures.append(Figure("qosgate throughput / nginx", None, "%", Aim(">=", 80.0)))
        return figures, {"perf_analyzer": rows}

    def alone(c: int, what: Callable[[Sample], str]) -> str:
        """The relay-alone figure at concurrency `c`, as a reference's tail ("" if not run)."""
        sample = by.get((c, "relay alone"))
        return "" if sample is None else f", relay alone {what(sample)}"

    def throughput(s: Sample) -> str:
        return f"{s.point.throughput:,.0f}"

    def cpu(s: Sample) -> str:
        return f"{s.cpu_us_per_request or 0:.0f} us"

    direct_p50 = by[(low, "direct")].point.p50_us

    def p50_added(s: Sample) -> str:
        return f"adds {(s.point.p50_us - direct_p50) / 1e3:.3f} ms"

    for c in levels:
        q, n, d = by[(c, "qosgate")], by[(c, "nginx")], by[(c, "direct")]
        figures.append(Figure(
            f"qosgate throughput / nginx, concurrency {c}", 100 * q.point.throughput / n.point.throughput, "%",
            Aim(">=", 80.0),
            reference=f"qosgate {throughput(q)}, nginx {throughput(n)}, direct {throughput(d)}"
                      f"{alone(c, throughput)} infer/s"))
    gw_cpu = by[(BUSY, "qosgate")].cpu_us_per_request or 0.0
    figures.append(Figure(
        f"qosgate CPU per request, concurrency {BUSY}", gw_cpu, "us", Aim("<=", 100.0),
        reference=f"nginx {cpu(by[(BUSY, 'nginx')])}{alone(BUSY, cpu)}"))
    redis = by.get((BUSY, REDIS_GATEWAY))
    if redis is not None:
        redis_cpu = redis.cpu_us_per_request or 0.0
        figures.append(Figure(
            f"qosgate CPU per request at concurrency {BUSY}, redis / in-memory store", redis_cpu / gw_cpu, "x",
            Aim("<=", 1.2), reference=f"redis store {redis_cpu:.0f} us, in-memory store {gw_cpu:.0f} us; "
                                      f"redis store {throughput(redis)} infer/s"))
    added = (by[(low, "qosgate")].point.p50_us - direct_p50) / 1e3
    figures.append(Figure(
        f"qosgate p50 added latency, concurrency {low}", added, "ms", Aim("<=", 0.3),
        reference=f"nginx adds {nginx_added:.3f} ms{alone(low, p50_added)}"))
    if {"qosgate", "nginx", "direct"} <= streams.keys():
        q, n, d = streams["qosgate"], streams["nginx"], streams["direct"]
        figures.append(Figure(
            f"qosgate streaming throughput / nginx, concurrency {BUSY}",
            100 * q.point.throughput / n.point.throughput, "%", Aim(">=", 80.0),
            reference=f"qosgate {q.point.throughput:,.0f}, nginx {n.point.throughput:,.0f}, "
                      f"direct {d.point.throughput:,.0f} infer/s"))
        figures.append(Figure(
            f"qosgate streaming CPU per request, concurrency {BUSY}", q.cpu_us_per_request or 0.0, "us",
            Aim("<=", 100.0), reference=f"nginx {n.cpu_us_per_request or 0:.0f} us"))
    return figures, {"perf_analyzer": rows}


def draw(samples: list[tuple[int, Sample]], path: pathlib.Path) -> None:
    fig, (thr, lat, cpu) = plots.panels(3)
    targets = sorted({s.target for _, s in samples},
                     key=["direct", "nginx", "relay alone", "qosgate", REDIS_GATEWAY].index)
    metric: dict[str, Callable[[Sample], float | None]] = {
        "p50": lambda s: s.point.p50_us / 1e3, "p99": lambda s: s.point.p99_us / 1e3}
    for target in targets:
        mine = [(c, s) for c, s in samples if s.target == target and not s.streaming]
        xs = [c for c, _ in mine]
        color = plots.COLORS[target]
        thr.plot(xs, [s.point.throughput for _, s in mine], marker="o", color=color, label=target)
        for name, get in metric.items():
            lat.plot(xs, [get(s) for _, s in mine], marker="o", linestyle="-" if name == "p50" else "--",
                     color=color, label=f"{target} {name}")
        if target != "direct":
            cpu.plot(xs, [s.cpu_us_per_request for _, s in mine], marker="o", color=color, label=target)
        for c, s in samples:
            if s.target == target and s.streaming:
                thr.plot([c], [s.point.throughput], "s", color=color, label=f"{target} streaming")
                if s.cpu_us_per_request is not None:
                    cpu.plot([c], [s.cpu_us_per_request], "s", color=color, label=f"{target} streaming")
    cpu.axhline(100, color="grey", linestyle=":", label="aim (qosgate)")
    plots.label([(thr, "throughput", "infer/s"), (lat, "latency", "ms"), (cpu, "hop CPU per request", "us")],
                prefix="identity", xlabel="concurrency", log2_x=True)
    plots.save(fig, path)
