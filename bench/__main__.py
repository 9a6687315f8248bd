"""`python -m bench <scenario|all|report> [--quick] [--update-readme]`.

Each scenario starts what it needs, runs a bounded load, and writes
bench/results/<scenario>.json and <scenario>.png; REPORT.md is rebuilt from every result
present after each run.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from bench import readme, report
from bench.scenarios import SCENARIOS, RunContext


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all", "report"],
                        help="a scenario, all of them, or only rebuild the report")
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute each)")
    parser.add_argument("--update-readme", action="store_true",
                        help="rewrite README's performance section from the report")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    # SIGTERM (timeout, CI cancel) unwinds like Ctrl-C, so every started process group is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = list(SCENARIOS) if args.scenario == "all" else [] if args.scenario == "report" else [args.scenario]
    failed = []
    for name in names:
        ctx = RunContext(scenario=name, quick=args.quick)
        begun = time.monotonic()
        try:
            result = SCENARIOS[name](ctx)
        except Exception:
            logging.exception("scenario %s failed", name)
            failed.append(name)
            continue
        path = result.write()
        logging.info("%s: %s (%.0f s)", name, path, time.monotonic() - begun)
    path = report.write_report()
    logging.info("report: %s", path)
    if args.update_readme:
        readme.update()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
