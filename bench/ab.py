"""Two gateways side by side on one Triton, alternating: A/B of a change's CPU and latency.

`python -m bench.ab [--a DIR] [--b DIR] [--rounds N] [--levels 16,1] [--requests N] [--streaming]`

Each side is a `qosgate serve` process importing the `qosgate` package from DIR (a
worktree's `server/` directory, say; default: this checkout), both with the overhead
scenario's tenants and config in front of the same Triton (identity model). Each round
starts both afresh and measures every level on both, in an order that flips every round,
so drift on a shared machine, and a process that happens to run cheaper than its twin,
hit both alike; it prints each point, then the medians.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics

from bench import perf
from bench.scenarios.overhead import MODEL, TENANTS, Sample, measure_target
from bench.stack import GroupProcess, Stack, checked


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="",
                        help="directory to import side A's qosgate from (default: this checkout)")
    parser.add_argument("--b", default="", help="the same for side B")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--levels", default="16", help="concurrency levels, comma-separated")
    parser.add_argument("--requests", type=int, default=20000, help="requests per point")
    parser.add_argument("--streaming", action="store_true", help="perf_analyzer --streaming")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    levels = [int(level) for level in args.levels.split(",")]
    settings = perf.PerfSettings(requests=args.requests)
    results: dict[tuple[str, int], list[Sample]] = {}
    notes: list[str] = []
    with checked(Stack(models=[MODEL])) as stack:

        def start(path: str, second: bool) -> tuple[str, GroupProcess]:
            # The gateway process inherits this environment: PYTHONPATH picks its tree.
            saved = os.environ.pop("PYTHONPATH", None)
            if path:
                os.environ["PYTHONPATH"] = path
            try:
                if second:
                    url = stack.start_second_gateway(tenants=TENANTS)
                    assert stack.second_gateway is not None
                    return url, stack.second_gateway
                url = stack.start_gateway(tenants=TENANTS)
                assert stack.gateway is not None
                return url, stack.gateway
            finally:
                os.environ.pop("PYTHONPATH", None)
                if saved is not None:
                    os.environ["PYTHONPATH"] = saved

        for turn in range(args.rounds):
            # Fresh processes each round, started in turn order: one process can be
            # steadily cheaper than its twin for as long as it lives (an A/A run with the
            # same two processes throughout measured the second one 14% cheaper).
            order = [("a", args.a), ("b", args.b)]
            if turn % 2:
                order.reverse()
            sides = [(name, *start(path, name == "b")) for name, path in order]
            for level in levels:
                for name, url, process in sides:
                    sample = measure_target(stack, "qosgate", url, process, level, settings,
                                            notes=notes, streaming=args.streaming)
                    results.setdefault((name, level), []).append(sample)
                    print(f"round {turn} {name} c={level}: {sample.point.throughput:.0f} infer/s "
                          f"p50 {sample.point.p50_us:.0f} us "
                          f"cpu/req {sample.cpu_us_per_request or 0:.1f} us", flush=True)
    for note in notes:
        print(note)
    for level in levels:
        for name in ("a", "b"):
            samples = results[(name, level)]
            print(f"{name} c={level}: median cpu/req "
                  f"{statistics.median(s.cpu_us_per_request or 0 for s in samples):.1f} us, "
                  f"p50 {statistics.median(s.point.p50_us for s in samples):.0f} us, "
                  f"{statistics.median(s.point.throughput for s in samples):.0f} infer/s")


if __name__ == "__main__":
    main()
