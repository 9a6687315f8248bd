"""batching: what Triton's dynamic batching buys and costs on minilm.

Temporary model-repository variants of model_repository/minilm differ only in
max_batch_size / preferred sizes and max_queue_delay; perf_analyzer measures each at
the same concurrency, straight at Triton.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import tempfile
from collections.abc import Callable

from bench import perf, plots, repository
from bench.report import Figure, ScenarioResult
from bench.scenarios import RunContext
from bench.stack import Stack, checked

log = logging.getLogger(__name__)

SOURCE = "minilm"


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """One dynamic-batching setting of minilm."""

    max_batch: int
    delay_us: int

    @property
    def name(self) -> str:
        return f"{SOURCE}_b{self.max_batch}_d{self.delay_us}"


def batching(variant: Variant) -> Callable[[repository.ModelConfig], None]:
    def edit(config: repository.ModelConfig) -> None:
        config.max_batch_size = variant.max_batch
        dynamic = config.dynamic_batching
        del dynamic.preferred_batch_size[:]
        dynamic.preferred_batch_size.extend(s for s in (4, 8, 16, 32) if s <= variant.max_batch)
        dynamic.max_queue_delay_microseconds = variant.delay_us

    return edit


def run(ctx: RunContext) -> ScenarioResult:
    sizes: list[int] = ctx.pick([1, 8, 32], [1, 2, 4, 8, 16, 32])
    delays: list[int] = ctx.pick([0, 20000], [0, 1000, 5000, 20000, 50000])
    base_delay = 5000
    concurrency = 16
    variants = [Variant(b, base_delay) for b in sizes] + [Variant(32, d) for d in delays if d != base_delay]
    settings = perf.PerfSettings(requests=ctx.pick(300, 1000))
    points: dict[Variant, perf.PerfPoint] = {}
    with tempfile.TemporaryDirectory(prefix="minilm-variants-") as tmp:
        repo = pathlib.Path(tmp)
        for variant in variants:
            repository.write_variant(repo, SOURCE, variant.name, batching(variant))
        # One load at a time: five copies of minilm loading at once once left one python stub
        # hung in its model load (seen here, not explained), and Triton never became ready.
        with checked(Stack(models=[v.name for v in variants], model_repository=repo,
                           triton_args=["--model-load-thread-count=1"])) as stack:
            for variant in variants:
                points[variant] = perf.measure(url=stack.triton_url, model=variant.name,
                                               concurrency=concurrency, settings=settings,
                                               watch=stack.triton_failure)
                log.info("%s: %.1f infer/s p50 %.1f ms", variant.name, points[variant].throughput,
                         points[variant].p50_us / 1e3)
    rows = [{"max_batch_size": v.max_batch, "queue delay us": v.delay_us,
             "infer/s": round(p.throughput, 1), "p50 ms": p.p50_us / 1e3, "p99 ms": p.p99_us / 1e3}
            for v, p in points.items()]
    unbatched, batched = points[Variant(sizes[0], base_delay)], points[Variant(sizes[-1], base_delay)]
    figures = [
        Figure(f"throughput gain, max_batch_size {sizes[-1]} vs {sizes[0]}",
               batched.throughput / unbatched.throughput, "x",
               reference=f"{batched.throughput:.1f} vs {unbatched.throughput:.1f} infer/s"),
        Figure(f"p50 latency, max_batch_size {sizes[-1]} vs {sizes[0]}",
               batched.p50_us / 1e3, "ms", reference=f"unbatched {unbatched.p50_us / 1e3:.1f} ms"),
    ]
    notes = [f"perf_analyzer concurrency {concurrency}, random 128-character strings, "
             f"{settings.requests} requests per point; queue-delay sweep at max_batch_size 32; "
             f"preferred sizes 4/8/16/32 up to the max; torch 1 thread per model instance."]
    return ctx.result(figures, {"minilm variants": rows}, notes,
                      plot=lambda path: draw(points, sizes, delays, base_delay, path))


def draw(points: dict[Variant, perf.PerfPoint], sizes: list[int], delays: list[int],
         base_delay: int, path: pathlib.Path) -> None:
    fig, (by_size, by_delay) = plots.panels(2)
    for ax, xs, variants, label in (
        (by_size, sizes, [Variant(b, base_delay) for b in sizes], "max_batch_size"),
        (by_delay, [d / 1000 for d in sorted({*delays, base_delay})],
         [Variant(32, d) for d in sorted({*delays, base_delay})], "max_queue_delay (ms)"),
    ):
        ax.plot(xs, [points[v].throughput for v in variants], marker="o", color="tab:blue")
        ax.set_xlabel(label)
        ax.set_ylabel("infer/s", color="tab:blue")
        twin = ax.twinx()
        twin.plot(xs, [points[v].p50_us / 1e3 for v in variants], marker="s", color="tab:red", label="p50")
        twin.plot(xs, [points[v].p99_us / 1e3 for v in variants], marker="^", color="tab:orange", label="p99")
        twin.set_ylabel("latency ms", color="tab:red")
        twin.legend(fontsize=7)
        ax.set_title(f"minilm at concurrency 16 vs {label}")
    plots.save(fig, path)
