"""quota: tenants with request-rate and token limits send far above them through qosgate;
the admitted rate against the configured one.

Request rate: a Poisson open loop at OVERDRIVE times each limit on the identity model
(cheap, so Triton never is the bottleneck). Each bucket holds one second of requests (the
default burst): a bucket of 1 would lose the refill that lands between arrivals (with
Poisson arrivals at 4x, about a fifth of the rate), which measures the client, not the
limiter. The full bucket the run starts with is taken off the count: admitted rate =
(OK - burst) / T.

Token rate: qosgate.v1 Generate on smollm2 for a tenant with tokens_per_minute, Poisson
arrivals at OVERDRIVE times the limit (counted in reserved tokens: prompt estimate +
max_tokens). Admission reserves the estimate and settles with the engine's counts, so the
figure is what the tenant was really charged: admitted = (tokens of OK replies - the one
minute of tokens the bucket starts with) / T.
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
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.v1 import generation_pb2

log = logging.getLogger(__name__)

MODEL = "identity"
LIMITS = {"rps5": 5.0, "rps20": 20.0, "rps50": 50.0}
OVERDRIVE = 4.0
LLM = "smollm2"
TOKENS_PER_MINUTE = 3000
TPM_TENANT = "tpm3000"
PROMPT = "The numbers from one to one hundred: 1, 2, 3, 4,"
MAX_TOKENS = 24
TENANTS = [
    {"name": name, "api_keys": [{"key": f"bench-{name}-key"}],
     "limits": {"requests_per_second": rate, "burst": int(rate)}}
    for name, rate in LIMITS.items()
] + [{"name": TPM_TENANT, "api_keys": [{"key": f"bench-{TPM_TENANT}-key"}],
      "limits": {"tokens_per_minute": TOKENS_PER_MINUTE}}]


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


def reserved_per_request() -> int:
    """What admission reserves for one request: the gateway's prompt estimate + max_tokens."""
    return estimate_prompt_tokens(PROMPT) + MAX_TOKENS


async def drive_tokens(url: str, seconds: float) -> list[load.Outcome]:
    target = load.Target(url)
    caller = load.Caller(TPM_TENANT, api_key=f"bench-{TPM_TENANT}-key")
    request = generation_pb2.GenerateRequest(
        model=LLM, prompt=PROMPT,
        sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    rate = OVERDRIVE * TOKENS_PER_MINUTE / 60.0 / reserved_per_request()
    try:
        return await load.open_loop(lambda: target.generate(caller, request, 120.0),
                                    rate, target.now() + seconds, target.now, seed=7)
    finally:
        await target.close()


def run(ctx: RunContext) -> ScenarioResult:
    seconds = ctx.pick(15.0, 60.0)
    token_seconds = ctx.pick(30.0, 60.0)
    notes = [f"identity through qosgate, Poisson arrivals at {OVERDRIVE:g}x each tenant's "
             f"requests_per_second (burst = 1 s of it) for {seconds:.0f} s; "
             "admitted rate = (replies OK - burst) / duration.",
             f"{LLM} through qosgate.v1 Generate ({MAX_TOKENS} max tokens, greedy, "
             f"{reserved_per_request()} tokens reserved per request), Poisson arrivals at "
             f"{OVERDRIVE:g}x tokens_per_minute {TOKENS_PER_MINUTE} in reserved tokens for "
             f"{token_seconds:.0f} s; admitted = (tokens charged to OK replies - the bucket's "
             "initial minute) / duration."]
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("admitted rate error", None, "%", Aim("<=", 2.0))], {}, notes)
    with checked(Stack(models=[MODEL, LLM])) as stack:
        url = stack.start_gateway(tenants=TENANTS)
        outcomes = asyncio.run(drive(url, seconds))
        token_outcomes = asyncio.run(drive_tokens(url, token_seconds))
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
    token_row = tokens_row(token_outcomes, token_seconds)
    figures.append(Figure(f"{TPM_TENANT}: admitted tokens/min off the limit", token_row["error %"], "%",
                          Aim("<=", 2.0),
                          reference=f"admitted {token_row['admitted tokens/min']} of {TOKENS_PER_MINUTE} tokens/min"))
    log.info("%s", token_row)
    notes.append("the daily token budget is not benchmarked: it needs a day; tests cover its arithmetic.")
    return ctx.result(figures, {"tenants": rows, "tokens": [token_row]}, notes,
                      plot=lambda path: draw(rows, token_row, path))


def tokens_row(outcomes: list[load.Outcome], seconds: float) -> dict[str, object]:
    charged = sum(o.tokens for o in outcomes if o.ok)
    admitted = (charged - TOKENS_PER_MINUTE) / seconds * 60.0
    codes = collections.Counter(o.code for o in outcomes)
    return {"tenant": TPM_TENANT, "limit tokens/min": TOKENS_PER_MINUTE,
            "offered tokens/min (reserved)": round(len(outcomes) * reserved_per_request() / seconds * 60.0),
            "admitted tokens/min": round(admitted), "error %": round(abs(admitted / TOKENS_PER_MINUTE - 1) * 100, 2),
            "tokens per OK reply": round(charged / max(1, codes["OK"]), 1),
            "codes": ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))}


def draw(rows: list[dict[str, object]], token_row: dict[str, object], path: pathlib.Path) -> None:
    fig, (ax, tokens) = plots.panels(2, width=6)
    names = [str(r["tenant"]) for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [float(r["limit req/s"]) for r in rows], 0.4, label="limit")  # type: ignore[arg-type]
    ax.bar([x + 0.2 for x in xs], [float(r["admitted req/s"]) for r in rows], 0.4, label="admitted")  # type: ignore[arg-type]
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("req/s")
    ax.set_title(f"identity through qosgate at {OVERDRIVE:g}x the limit")
    ax.legend(fontsize=8)
    tokens.bar([-0.2], [float(token_row["limit tokens/min"])], 0.4, label="limit")  # type: ignore[arg-type]
    tokens.bar([0.2], [float(token_row["admitted tokens/min"])], 0.4, label="admitted")  # type: ignore[arg-type]
    tokens.set_xticks([0], [TPM_TENANT])
    tokens.set_ylabel("tokens/min")
    tokens.set_title(f"{LLM} (qosgate.v1) at {OVERDRIVE:g}x tokens_per_minute")
    tokens.legend(fontsize=8)
    plots.save(fig, path)
