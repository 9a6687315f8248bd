"""routing: `least_loaded` against `prefix_affinity` on two smollm2 Triton replicas, in one
run: many tenants, each with its own long system prompt, chat calls through the gateway's
GenerateStream; time to first token (p50, p99) and output tokens/s per policy.

The engines' prefix caches are kept small on purpose (`num_gpu_blocks_override` in a
copy of smollm2's model.json): every tenant's prefix fits in the two caches together
but not in either one alone, as on a real fleet with more tenants than one replica's
cache holds. Under least_loaded each replica sees every tenant and keeps only some of
their prefixes; under prefix_affinity each replica keeps its own share. The engines'
prefix cache hits, their queue and prefill times, and the router's choices are read
for each phase, so a result says why it came out as it did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib
import random
import shutil
import tempfile

from bench import load, plots
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked, gateway_available, group_cpu_seconds, metric_samples
from bench.stats import percentile
from qosgate import paths
from qosgate.v1 import generation_pb2

log = logging.getLogger(__name__)

MODEL = "smollm2"
TENANTS = 32
CONCURRENCY = 16
MAX_TOKENS = 8
PREFIX_BYTES = 512
# vLLM caches full blocks only (128 tokens on CPUs): a prompt of ~580 tokens leaves its
# first 4 blocks (512 tokens, all system prompt) for the next call of its tenant. Tenants
# are drawn at random, so a cache holding C of the 32 prefixes hits about C/32 of them
# whatever the eviction order. At 128 blocks (16k tokens) one replica held all 32 and
# least_loaded found as many prompt tokens cached as prefix_affinity (78-83% against
# 74-83%, measured): no effect left to show. Room for 24 prefixes holds the larger share
# the ring gives one replica (18 of 32 with these names) next to the running calls' own
# blocks (one each), while least_loaded keeps about 21 of 32 per replica.
CPU_BLOCK_TOKENS = 128
PREFIX_BLOCKS = 4
KV_BLOCKS = 24 * PREFIX_BLOCKS
CALLER = load.Caller("routing", api_key="bench-routing-key")
GATEWAY_TENANTS = [{"name": "routing", "api_keys": [{"key": CALLER.api_key}]}]
POLICIES = ("prefix_affinity", "least_loaded")
# A B B A: drift over the run (other work on the machine, caches) weighs on both alike.
ORDER = ("prefix_affinity", "least_loaded", "least_loaded", "prefix_affinity")
_WORDS = ("orders", "refunds", "invoices", "shipping", "accounts", "warranty", "returns", "billing",
          "privacy", "delivery", "coupons", "support", "payments", "contracts", "tickets", "renewals")


def system_prompt(tenant: int) -> str:
    """A tenant's own long system prompt (2.5 KB, about 600 tokens), different from its first words."""
    rng = random.Random(tenant)
    rules = " ".join(
        f"Rule {i}: when a customer asks about {rng.choice(_WORDS)}, check the {rng.choice(_WORDS)} "
        f"record first and mention the {rng.choice(_WORDS)} policy of tenant {tenant}."
        for i in range(20)
    )
    return f"You are the assistant of tenant {tenant:02d}. {rules}"


QUESTIONS = ("Where is my order?", "How do I get a refund?", "Can I change my address?",
             "Why was I billed twice?", "Is my warranty still valid?", "How do I close my account?")


def small_cache_repository(directory: pathlib.Path) -> pathlib.Path:
    """A model repository holding smollm2 with its KV cache cut to KV_BLOCKS blocks."""
    repo = directory / "repository"
    shutil.copytree(paths.model_repository() / MODEL, repo / MODEL,
                    ignore=shutil.ignore_patterns("__pycache__"))
    engine = repo / MODEL / "1" / "model.json"
    settings = json.loads(engine.read_text())
    settings["num_gpu_blocks_override"] = KV_BLOCKS
    engine.write_text(json.dumps(settings, indent=2) + "\n")
    return repo


ENGINE_COUNTERS = {
    "cache_queries": "vllm_engine_prefix_cache_queries_total",
    "cache_hits": "vllm_engine_prefix_cache_hits_total",
    "queued_s": "vllm_engine_request_queued_seconds_total",
    "prefill_s": "vllm_engine_request_prefill_seconds_total",
    "finished": "vllm_engine_requests_finished_total",
}


# What a replica's whole process group (Triton, the python stub, vLLM's processes) spent:
# the work a cache hit saves, which the machine's other jobs do not blur as they blur times.
COUNTERS = (*ENGINE_COUNTERS, "cpu_s")


def engine_counters(stack: Stack) -> list[dict[str, float]]:
    """Each replica's COUNTERS for MODEL: its Triton metrics, its processes' CPU time."""
    readings = []
    for replica in stack.replicas:
        totals = dict.fromkeys(COUNTERS, 0.0)
        for name, labels, value in metric_samples(replica.ports.metrics_url):
            for key, metric in ENGINE_COUNTERS.items():
                if name == metric and labels.get("model") == MODEL:
                    totals[key] += value
        assert replica.pid is not None
        totals["cpu_s"] = group_cpu_seconds(replica.pid)
        readings.append(totals)
    return readings


def routed_counts(stack: Stack) -> dict[tuple[str, str], float]:
    """The gateway's routing choices for MODEL so far, by (upstream, outcome)."""
    return {(labels["upstream"], labels["outcome"]): value
            for name, labels, value in metric_samples(stack.gateway_metrics_url)
            if name == "qosgate_routed_total" and labels.get("model") == MODEL}


@dataclasses.dataclass(slots=True)
class Run:
    """One phase: a routing policy under the same load, with what the engines and the
    router did during its counted window."""

    policy: str
    seconds: float = 0.0
    outcomes: list[load.Outcome] = dataclasses.field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    engines: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per replica: COUNTERS' growth over the counted window."""
    routed: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(upstream, outcome): the gateway's choices over the counted window."""

    def counted(self) -> list[load.Outcome]:
        lo, hi = self.window
        return [o for o in self.outcomes if o.ok and o.ttft is not None and lo <= o.start < hi]

    def ttft_ms(self) -> list[float]:
        return [o.ttft * 1e3 for o in self.counted() if o.ttft is not None]

    def tokens(self) -> int:
        lo, hi = self.window
        return sum(lo <= t < hi for o in self.outcomes for t in o.token_times)

    def row(self) -> dict[str, object]:
        ttft = self.ttft_ms()
        row: dict[str, object] = {
            "policy": self.policy, "TTFT p50 ms": round(percentile(ttft, 50)),
            "TTFT p99 ms": round(percentile(ttft, 99)), "output tokens/s": round(self.tokens() / self.seconds, 1),
            "calls counted": len(ttft), "failed": sum(not o.ok for o in self.outcomes)}
        calls = sum(self.routed.values()) or 1.0
        for i, engine in enumerate(self.engines):
            name = f"triton-{i}"
            row[f"{name} calls %"] = round(100 * sum(v for (u, _), v in self.routed.items() if u == name) / calls)
            row[f"{name} cache hits %"] = round(100 * engine["cache_hits"] / max(engine["cache_queries"], 1.0))
            finished = max(engine["finished"], 1.0)
            row[f"{name} queued ms"] = round(1e3 * engine["queued_s"] / finished)
            row[f"{name} prefill ms"] = round(1e3 * engine["prefill_s"] / finished)
            row[f"{name} CPU ms/call"] = round(1e3 * engine["cpu_s"] / finished)
        row["spilled %"] = round(100 * sum(v for (_, o), v in self.routed.items() if o != "affinity") / calls) \
            if self.policy == "prefix_affinity" else None
        return row


def pooled(runs: list[Run], policy: str) -> dict[str, float]:
    """TTFT percentiles and tokens/s of every phase of `policy` taken together."""
    mine = [r for r in runs if r.policy == policy]
    ttft = [t for r in mine for t in r.ttft_ms()]
    hits = sum(e["cache_hits"] for r in mine for e in r.engines)
    queries = sum(e["cache_queries"] for r in mine for e in r.engines)
    cpu = sum(e["cpu_s"] for r in mine for e in r.engines)
    finished = sum(e["finished"] for r in mine for e in r.engines)
    return {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99),
            "tokens/s": sum(r.tokens() for r in mine) / sum(r.seconds for r in mine),
            "cache hits %": 100 * hits / max(queries, 1.0), "CPU ms/call": 1e3 * cpu / max(finished, 1.0)}


def chat_request(tenant: int, question: str) -> generation_pb2.GenerateStreamRequest:
    messages = [generation_pb2.ChatMessage(role=generation_pb2.ROLE_SYSTEM, content=system_prompt(tenant)),
                generation_pb2.ChatMessage(role=generation_pb2.ROLE_USER, content=question)]
    return generation_pb2.GenerateStreamRequest(
        model=MODEL, chat=generation_pb2.Chat(messages=messages),
        sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


async def measure(stack: Stack, url: str, run: Run, warmup: float, seconds: float) -> None:
    """Closed loop of CONCURRENCY callers, each call from a random tenant (same seed for
    every phase, so each sees the same sequence of tenants); the engines' and the
    router's counters are read when the counted window opens and after the last call."""
    target = load.Target(url)
    rng = random.Random(7)
    requests = [chat_request(t, q) for t in range(TENANTS) for q in QUESTIONS]

    async def at_window_start() -> tuple[list[dict[str, float]], dict[tuple[str, str], float]]:
        await asyncio.sleep(warmup)
        return await asyncio.to_thread(lambda: (engine_counters(stack), routed_counts(stack)))

    try:
        begin = target.now()
        opened = asyncio.create_task(at_window_start())
        run.outcomes = await load.closed_loop(
            lambda: target.generate_stream(CALLER, rng.choice(requests), 120.0), CONCURRENCY, begin + warmup + seconds, target.now)
        run.window, run.seconds = (begin + warmup, begin + warmup + seconds), seconds
        engines_before, routed_before = await opened
        engines_after, routed_after = await asyncio.to_thread(lambda: (engine_counters(stack), routed_counts(stack)))
    finally:
        await target.close()
    run.engines = [{k: after[k] - before[k] for k in COUNTERS}
                   for before, after in zip(engines_before, engines_after, strict=True)]
    run.routed = {k: v - routed_before.get(k, 0.0) for k, v in routed_after.items()}
    log.info("%s", run.row())


def run(ctx: RunContext) -> ScenarioResult:
    warmup, seconds = ctx.pick((15.0, 30.0), (30.0, 120.0))
    notes = [f"Two Triton replicas of smollm2 (vLLM, prefix caching on, KV cache cut to {KV_BLOCKS} blocks "
             f"of {CPU_BLOCK_TOKENS} tokens), {TENANTS} tenants with their own ~570-token system prompts, "
             f"{CONCURRENCY} concurrent GenerateStream chat calls of {MAX_TOKENS} tokens, each from a random "
             f"tenant; {warmup:.0f} s of engine warm-up, then phases in the order {' '.join(ORDER)} (each "
             f"{warmup:.0f} s warm-up, {seconds:.0f} s counted), so neither policy profits from going first "
             "or last; a policy's figures pool its two phases. Both replicas share the machine's cores: "
             "absolute numbers are noisy, compare the policies."]
    runs = [Run(policy) for policy in ORDER]
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("TTFT p50, prefix_affinity / least_loaded", None, "%", Aim("<=", 80.0))], {}, notes)
    with tempfile.TemporaryDirectory(prefix="qosgate-bench-routing-") as tmp, \
            checked(Stack(models=[MODEL], model_repository=small_cache_repository(pathlib.Path(tmp)),
                          replicas=2)) as stack:
        # First calls of a fresh engine are slow (warm-up of its kernels): pay for them
        # before either policy is measured.
        url = stack.start_gateway(tenants=GATEWAY_TENANTS)
        asyncio.run(measure(stack, url, Run("engine warm-up"), 0.0, warmup))
        for r in runs:
            stack.wait_idle(MODEL)
            routing = {"policy": r.policy, "prefix_bytes": PREFIX_BYTES}
            url = stack.start_gateway(tenants=GATEWAY_TENANTS, models={MODEL: {"routing": routing}})
            asyncio.run(measure(stack, url, r, warmup, seconds))
    affinity, least = pooled(runs, "prefix_affinity"), pooled(runs, "least_loaded")
    figures = [
        Figure("TTFT p50, prefix_affinity / least_loaded", 100 * affinity["p50"] / least["p50"], "%",
               Aim("<=", 80.0), reference=f"prefix_affinity {affinity['p50']:.0f} ms, "
               f"least_loaded {least['p50']:.0f} ms"),
        Figure("TTFT p99, prefix_affinity / least_loaded", 100 * affinity["p99"] / least["p99"], "%",
               reference=f"prefix_affinity {affinity['p99']:.0f} ms, least_loaded {least['p99']:.0f} ms"),
        Figure("output tokens/s, prefix_affinity / least_loaded",
               100 * affinity["tokens/s"] / least["tokens/s"], "%", Aim(">=", 100.0),
               reference=f"prefix_affinity {affinity['tokens/s']:.1f}, least_loaded {least['tokens/s']:.1f}"),
        Figure("prefix cache hits (prompt tokens), prefix_affinity", affinity["cache hits %"], "%",
               reference=f"least_loaded {least['cache hits %']:.0f}%"),
        Figure("replicas' CPU per call, prefix_affinity / least_loaded",
               100 * affinity["CPU ms/call"] / least["CPU ms/call"], "%",
               reference=f"prefix_affinity {affinity['CPU ms/call']:.0f} ms, "
               f"least_loaded {least['CPU ms/call']:.0f} ms"),
    ]
    return ctx.result(figures, {"phases": [r.row() for r in runs]}, notes, plot=lambda path: draw(runs, path))


def draw(runs: list[Run], path: pathlib.Path) -> None:
    fig, (ttft, hits, cpu, tps, cdf) = plots.panels(5, width=4.4)
    figures = {policy: pooled(runs, policy) for policy in POLICIES}
    xs = range(len(POLICIES))
    ttft.bar([x - 0.2 for x in xs], [figures[p]["p50"] for p in POLICIES], 0.4, label="p50")
    ttft.bar([x + 0.2 for x in xs], [figures[p]["p99"] for p in POLICIES], 0.4, label="p99")
    ttft.set_xticks(list(xs), POLICIES)
    ttft.set_ylabel("ms")
    ttft.set_title(f"time to first token ({TENANTS} tenants)")
    ttft.legend(fontsize=7)
    hits.bar(POLICIES, [figures[p]["cache hits %"] for p in POLICIES], color="tab:purple")
    hits.set_ylabel("% of prompt tokens")
    hits.set_title(f"prefix cache hits ({KV_BLOCKS} x {CPU_BLOCK_TOKENS}-token blocks)")
    cpu.bar(POLICIES, [figures[p]["CPU ms/call"] for p in POLICIES], color="tab:red")
    cpu.set_ylabel("CPU ms per call")
    cpu.set_title("replicas' CPU per call served")
    tps.bar(POLICIES, [figures[p]["tokens/s"] for p in POLICIES], color="tab:green")
    tps.set_ylabel("tokens/s")
    tps.set_title(f"output tokens/s ({CONCURRENCY} streams)")
    for policy in POLICIES:
        values = sorted(t for r in runs if r.policy == policy for t in r.ttft_ms())
        if values:
            cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
    cdf.set_xlabel("time to first token, ms")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("TTFT distribution (both phases)")
    cdf.legend(fontsize=7)
    plots.save(fig, path)
