"""The overhead bench's pure parts: one figure per point from its rounds; and the policy
measure (`python -m bench.policy`) deciding real calls in process."""

from __future__ import annotations

from bench import policy
from bench.perf import PerfPoint
from bench.scenarios.overhead import REDIS_GATEWAY, Sample, by_point, median, spread, summarise


def _sample(target: str, concurrency: int, rate: float, p50_us: float, cpu: float | None,
            streaming: bool = False) -> tuple[int, Sample]:
    return concurrency, Sample(target, PerfPoint(concurrency, rate, p50_us, p50_us * 2, p50_us * 3), cpu, streaming)


def test_each_point_is_the_median_of_its_rounds_and_shows_their_range() -> None:
    runs = []
    for rate, cpu in ((1000.0, 120.0), (3000.0, 90.0), (2000.0, 300.0)):  # three rounds
        runs += [_sample("nginx", 16, rate * 2, 400.0, cpu / 2), _sample("qosgate", 16, rate, 500.0, cpu),
                 _sample("qosgate", 16, rate / 2, 900.0, cpu * 2, streaming=True)]
    points = by_point(runs)
    assert list(points) == [(16, "nginx", False), (16, "qosgate", False), (16, "qosgate", True)]
    unary = median(16, points[(16, "qosgate", False)])
    # Each figure on its own: the middle rate is not the middle CPU's round.
    assert (unary.point.throughput, unary.cpu_us_per_request, unary.streaming) == (2000.0, 120.0, False)
    assert median(16, points[(16, "qosgate", True)]).streaming
    assert spread(points[(16, "qosgate", False)]) == {"infer/s range": "1,000-3,000", "hop CPU range": "90-300 us"}


def test_the_table_carries_each_points_range_when_there_were_rounds() -> None:
    runs = [_sample(target, c, 1000.0 + r, 300.0 + r, None if target == "direct" else 80.0 + r)
            for r in range(3) for c in (1, 16) for target in ("direct", "nginx", "qosgate")]
    points = by_point(runs)
    samples = [(c, median(c, group)) for (c, _, _), group in points.items()]
    figures, tables = summarise(samples, [1, 16], {key: spread(group) for key, group in points.items()})
    cpu = next(f for f in figures if f.label.startswith("qosgate CPU per request"))
    assert cpu.value == 81.0
    direct = next(row for row in tables["perf_analyzer"] if row["target"] == "direct")
    assert direct["infer/s range"] == "1,000-1,002" and direct["hop CPU range"] == ""
    _, single = summarise(samples, [1, 16])
    assert "infer/s range" not in single["perf_analyzer"][0]


def test_the_redis_store_is_held_against_the_in_memory_one_at_concurrency_16() -> None:
    samples = [_sample(target, c, 1000.0, 300.0, None if target == "direct" else 100.0)
               for c in (1, 16) for target in ("direct", "nginx", "qosgate")]
    samples.append(_sample(REDIS_GATEWAY, 16, 900.0, 320.0, 130.0))
    figures, tables = summarise(samples, [1, 16])
    redis = next(f for f in figures if "redis / in-memory store" in f.label)
    assert redis.value == 1.3
    assert redis.met is False
    assert redis.reference.startswith("redis store 130 us, in-memory store 100 us")
    assert [row["target"] for row in tables["perf_analyzer"]].count(REDIS_GATEWAY) == 1
    without, _ = summarise(samples[:-1], [1, 16])
    assert not any("redis" in f.label for f in without)


async def test_the_policy_measure_decides_and_finishes_real_calls() -> None:
    per_call = await policy.measure(calls=200, rounds=2)
    assert len(per_call) == 2 and all(us > 0 for us in per_call)

