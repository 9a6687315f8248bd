"""Rewrite README's `performance` section from the latest bench/results/*.json."""

from __future__ import annotations

import pathlib
import re
import shutil

from bench import report

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The plots the README shows are committed here (bench/results/ is not: every run rewrites it).
PLOTS = "docs/bench"
SECTION = re.compile(r"(<!-- section: performance -->\n)(.*?)(<!-- /section: performance -->)", re.S)


def section_text(results: list[report.ScenarioResult], plotted: list[str]) -> str:
    """The section's markdown; `plotted`: the scenarios whose plot sits in PLOTS."""
    lines = [
        "## Performance",
        "",
        "`make bench-quick` (about a minute per scenario, more for the LLM ones) or `make bench`",
        "(full length) run the suite; `python -m bench <scenario> [--quick]` runs one of",
        "`overhead isolation fairness quota llm window batching routing`. Each scenario starts what it needs",
        "(local Triton, nginx `grpc_pass` as the plain-proxy reference, `qosgate serve` with a",
        "generated config) on free loopback ports, runs a bounded load (perf_analyzer 2.51.0 from",
        "`make tools`, or a grpc.aio KServe client for multi-tenant and streaming loads), stops",
        "every process group it started and checks that none is left, and writes",
        "`bench/results/<scenario>.json` + `.png` and `bench/results/REPORT.md` (with the",
        "tables, plots and the gateway's py-spy profile). `--update-readme` rewrites this section",
        f"and copies each scenario's plot to `{PLOTS}/`, where the images below are committed.",
        "",
        "The figures below come from the latest run on a shared 2-core CPU machine with no GPU",
        "(other jobs running: read the ratios to the references, measured in the same run, rather",
        "than the absolute numbers). Aims are issue 6's (the overhead ones and the refusal loops':",
        "issue 15's); the distance says by how much each is met or missed.",
        "",
    ]
    figures = [(r, f) for r in results for f in r.figures]
    lines += ["| scenario | figure | measured | aim | distance | reference | command |",
              "|---|---|---|---|---|---|---|"]
    for result, fig in figures:
        cells = [result.scenario, fig.label, report.format_value(fig.value, fig.unit),
                 report.aim_text(fig), report.verdict(fig),
                 "; ".join(x for x in (fig.reference, fig.note) if x), f"`{result.command}`"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    runs = ", ".join(f"{r.scenario} {r.started_utc}" for r in results)
    lines += ["", f"Runs: {runs}." if runs else "No benchmark has been run yet."]
    for scenario in plotted:
        lines += ["", f"![{scenario}]({PLOTS}/{scenario}.png)"]
    return "\n".join(lines)


def update(readme: pathlib.Path = README, results: pathlib.Path = report.RESULTS_DIR) -> None:
    text = readme.read_text()
    if not SECTION.search(text):
        raise RuntimeError(f"{readme} has no <!-- section: performance --> ... <!-- /section: performance --> block")
    found = report.load_results(results)
    plotted = []
    for result in found:
        if result.plot and (results / result.plot).exists():
            (readme.parent / PLOTS).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(results / result.plot, readme.parent / PLOTS / f"{result.scenario}.png")
            plotted.append(result.scenario)
    body = section_text(found, plotted)
    readme.write_text(SECTION.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1))
