"""quota: tenants with request-rate limits send far above them through qosgate; the
admitted rate against the configured one.

The load is a Poisson open loop at OVERDRIVE times each limit on the identity model (cheap,
so Triton never is the bottleneck). Each bucket holds one second of requests (the default
burst): a bucket of 1 would lose the refill that lands between arrivals (with Poisson
arrivals at 4x, about a fifth of the rate), which measures the client, not the limiter.
The full bucket the run starts with is taken off the count: admitted rate = (OK - burst) / T.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pathlib

from bench import load, plots
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, gateway_available

log = logging.getLogger(__name__)

MODEL = "identity"
LIMITS = {"rps5": 5.0, "rps20": 20.0, "rps50": 50.0}
OVERDRIVE = 4.0
TENANTS = [
    {"name": name, "api_keys": [{"key": f"bench-{name}-key"}],
     "limits": {"requests_per_second": rate, "burst": int(rate)}}
    for name, rate in LIMITS.items()
]


async def drive(url: str, seconds: float) -> dict[str, list[load.Outcome]]:
    target = load.Target(url)
    request = load.identity_request(MODEL)
    until = target.now() + seconds

    async def tenant(name: str, rate: float, seed: int) -> list[load.Outcome]:
        caller = load.Caller(name, api_key=f"bench-{name}-key")
        return await load.open_loop(lambda: target.infer(caller, request, 10.0),
                                    rate * OVERDRIVE, until, target.now, seed=seed)

    try:
        results = await asyncio.gather(*(tenant(n, r, i) for i, (n, r) in enumerate(LIMITS.items())))
    finally:
        await target.close()
    return dict(zip(LIMITS, results))


def run(ctx: RunContext) -> ScenarioResult:
    seconds = ctx.pick(15.0, 60.0)
    notes = [f"identity through qosgate, Poisson arrivals at {OVERDRIVE:g}x each tenant's "
             f"requests_per_second (burst = 1 s of it) for {seconds:.0f} s; "
             "admitted rate = (replies OK - burst) / duration."]
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("admitted rate error", None, "%", Aim("<=", 2.0))], {}, notes)
    with checked(Stack(models=[MODEL])) as stack:
        url = stack.start_gateway(tenants=TENANTS)
        outcomes = asyncio.run(drive(url, seconds))
    rows, figures = [], []
    for name, limit in LIMITS.items():
        mine = outcomes[name]
        admitted = (sum(o.ok for o in mine) - int(limit)) / seconds
        codes = collections.Counter(o.code for o in mine)
        error = abs(admitted / limit - 1) * 100
        rows.append({"tenant": name, "limit req/s": limit, "offered req/s": round(len(mine) / seconds, 1),
                     "admitted req/s": round(admitted, 2), "error %": round(error, 2),
                     "codes": ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))})
        figures.append(Figure(f"{name}: admitted rate off the limit", error, "%", Aim("<=", 2.0),
                              reference=f"admitted {admitted:.2f} of {limit:g} req/s"))
        log.info("%s", rows[-1])
    notes.append("token limits (tokens_per_minute, daily budget) are not measured by this scenario yet.")
    return ctx.result(figures, {"tenants": rows}, notes, plot=lambda path: draw(rows, path))


def draw(rows: list[dict[str, object]], path: pathlib.Path) -> None:
    fig, (ax,) = plots.panels(1, width=6)
    names = [str(r["tenant"]) for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [float(r["limit req/s"]) for r in rows], 0.4, label="limit")  # type: ignore[arg-type]
    ax.bar([x + 0.2 for x in xs], [float(r["admitted req/s"]) for r in rows], 0.4, label="admitted")  # type: ignore[arg-type]
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("req/s")
    ax.set_title(f"identity through qosgate at {OVERDRIVE:g}x the limit")
    ax.legend(fontsize=8)
    plots.save(fig, path)
