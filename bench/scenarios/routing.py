"""routing: `least_loaded` against `prefix_affinity` on two smollm2 Triton replicas, in one
run: many tenants, each with its own long system prompt, chat calls through the gateway's
GenerateStream; time to first token (p50, p99) and output tokens/s per policy.

The engines' prefix caches are kept small on purpose (`num_gpu_blocks_override` in a
copy of smollm2's model.json): every tenant's prefix fits in the two caches together
but not in either one alone, as on a real fleet with more tenants than one replica's
cache holds. Under least_loaded each replica sees every tenant and evicts prefixes
before they come back; under prefix_affinity each replica keeps its own half.
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
from bench.stack import Stack, checked, gateway_available
from bench.stats import percentile
from qosgate import paths
from qosgate.v1 import generation_pb2

log = logging.getLogger(__name__)

MODEL = "smollm2"
TENANTS = 32
CONCURRENCY = 16
MAX_TOKENS = 8
PREFIX_BYTES = 512
# 16k tokens of KV cache per replica, in vLLM's CPU blocks of 128 tokens. A system prompt
# (2.5 KB, about 600 tokens) fills 4 blocks: one replica's cache, next to the calls
# running, holds about 22 of the 32 prefixes; half of them (what prefix_affinity sends it)
# fit.
CPU_BLOCK_TOKENS = 128
KV_BLOCKS = 16_384 // CPU_BLOCK_TOKENS
CALLER = load.Caller("routing", api_key="bench-routing-key")
GATEWAY_TENANTS = [{"name": "routing", "api_keys": [{"key": CALLER.api_key}]}]
POLICIES = ("prefix_affinity", "least_loaded")
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


@dataclasses.dataclass(slots=True)
class Run:
    """One routing policy under the same load."""

    policy: str
    seconds: float = 0.0
    outcomes: list[load.Outcome] = dataclasses.field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    def counted(self) -> list[load.Outcome]:
        lo, hi = self.window
        return [o for o in self.outcomes if o.ok and o.ttft is not None and lo <= o.start < hi]

    def ttft_ms(self) -> list[float]:
        return [o.ttft * 1e3 for o in self.counted() if o.ttft is not None]

    def tokens_per_s(self) -> float:
        lo, hi = self.window
        return sum(lo <= t < hi for o in self.outcomes for t in o.token_times) / self.seconds

    def row(self) -> dict[str, object]:
        ttft = self.ttft_ms()
        return {"policy": self.policy, "TTFT p50 ms": round(percentile(ttft, 50)),
                "TTFT p99 ms": round(percentile(ttft, 99)), "output tokens/s": round(self.tokens_per_s(), 1),
                "calls counted": len(ttft), "failed": sum(not o.ok for o in self.outcomes)}


def chat_request(tenant: int, question: str) -> generation_pb2.GenerateStreamRequest:
    messages = [generation_pb2.ChatMessage(role=generation_pb2.ROLE_SYSTEM, content=system_prompt(tenant)),
                generation_pb2.ChatMessage(role=generation_pb2.ROLE_USER, content=question)]
    return generation_pb2.GenerateStreamRequest(
        model=MODEL, chat=generation_pb2.Chat(messages=messages),
        sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


async def measure(url: str, run: Run, warmup: float, seconds: float) -> None:
    """Closed loop of CONCURRENCY callers, each call from a random tenant (same seed for
    every policy, so both see the same sequence of tenants)."""
    target = load.Target(url)
    rng = random.Random(7)
    requests = [chat_request(t, q) for t in range(TENANTS) for q in QUESTIONS]

    try:
        begin = target.now()
        run.outcomes = await load.closed_loop(
            lambda: target.generate_stream(CALLER, rng.choice(requests), 120.0), CONCURRENCY, begin + warmup + seconds, target.now)
        run.window, run.seconds = (begin + warmup, begin + warmup + seconds), seconds
    finally:
        await target.close()
    log.info("%s", run.row())


def run(ctx: RunContext) -> ScenarioResult:
    warmup, seconds = ctx.pick((15.0, 30.0), (30.0, 120.0))
    notes = [f"Two Triton replicas of smollm2 (vLLM, prefix caching on, KV cache cut to {KV_BLOCKS} blocks "
             f"of {CPU_BLOCK_TOKENS} tokens), {TENANTS} tenants with their own ~600-token system prompts, "
             f"{CONCURRENCY} concurrent GenerateStream chat calls of {MAX_TOKENS} tokens, each from a random "
             f"tenant; {warmup:.0f} s of engine warm-up, then per policy {warmup:.0f} s warm-up and {seconds:.0f} s "
             "counted. prefix_affinity runs first, "
             "so least_loaded starts on caches its rival sorted (in its favour). Both replicas share the "
             "machine's 2 cores: absolute numbers are noisy, compare the policies."]
    runs = [Run(policy) for policy in POLICIES]
    if not gateway_available():
        notes.append("qosgate serve is not available in this checkout: nothing measured.")
        return ctx.result([Figure("TTFT p50, prefix_affinity / least_loaded", None, "%", Aim("<=", 80.0))], {}, notes)
    with tempfile.TemporaryDirectory(prefix="qosgate-bench-routing-") as tmp, \
            checked(Stack(models=[MODEL], model_repository=small_cache_repository(pathlib.Path(tmp)),
                          replicas=2)) as stack:
        # First calls of a fresh engine are slow (warm-up of its kernels): pay for them
        # before either policy is measured.
        url = stack.start_gateway(tenants=GATEWAY_TENANTS, models={MODEL: {"dispatch_window": 2 * CONCURRENCY}})
        asyncio.run(measure(url, Run("engine warm-up"), 0.0, warmup))
        for r in runs:
            stack.wait_idle(MODEL)
            routing = {"policy": r.policy, "prefix_bytes": PREFIX_BYTES}
            url = stack.start_gateway(tenants=GATEWAY_TENANTS, models={
                MODEL: {"dispatch_window": 2 * CONCURRENCY, "routing": routing}})
            asyncio.run(measure(url, r, warmup, seconds))
    affinity, least = runs
    p50 = {r.policy: percentile(r.ttft_ms(), 50) for r in runs}
    p99 = {r.policy: percentile(r.ttft_ms(), 99) for r in runs}
    figures = [
        Figure("TTFT p50, prefix_affinity / least_loaded", 100 * p50[affinity.policy] / p50[least.policy], "%",
               Aim("<=", 80.0), reference=f"prefix_affinity {p50[affinity.policy]:.0f} ms, "
               f"least_loaded {p50[least.policy]:.0f} ms"),
        Figure("TTFT p99, prefix_affinity / least_loaded", 100 * p99[affinity.policy] / p99[least.policy], "%",
               reference=f"prefix_affinity {p99[affinity.policy]:.0f} ms, least_loaded {p99[least.policy]:.0f} ms"),
        Figure("output tokens/s, prefix_affinity / least_loaded",
               100 * affinity.tokens_per_s() / least.tokens_per_s(), "%", Aim(">=", 100.0),
               reference=f"prefix_affinity {affinity.tokens_per_s():.1f}, least_loaded {least.tokens_per_s():.1f}"),
    ]
    return ctx.result(figures, {"policies": [r.row() for r in runs]}, notes, plot=lambda path: draw(runs, path))


def draw(runs: list[Run], path: pathlib.Path) -> None:
    fig, (ttft, tps, cdf) = plots.panels(3)
    names = [r.policy for r in runs]
    xs = range(len(runs))
    ttft.bar([x - 0.2 for x in xs], [percentile(r.ttft_ms(), 50) for r in runs], 0.4, label="p50")
    ttft.bar([x + 0.2 for x in xs], [percentile(r.ttft_ms(), 99) for r in runs], 0.4, label="p99")
    ttft.set_xticks(list(xs), names)
    ttft.set_ylabel("ms")
    ttft.set_title(f"time to first token, {TENANTS} tenants' system prompts")
    ttft.legend(fontsize=7)
    tps.bar(names, [r.tokens_per_s() for r in runs], color="tab:green")
    tps.set_ylabel("tokens/s")
    tps.set_title(f"output tokens/s, {CONCURRENCY} concurrent streams")
    for r in runs:
        values = sorted(r.ttft_ms())
        if values:
            cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=r.policy)
    cdf.set_xlabel("time to first token, ms")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("TTFT distribution (two smollm2 replicas)")
    cdf.legend(fontsize=7)
    plots.save(fig, path)
