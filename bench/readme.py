"""Rewrite README's `performance` section from the latest bench/results/*.json: the rows of
the scenarios that have a result there, the others' as the section had them."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil

from bench import report

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The plots the README shows are committed here (bench/results/ is not: every run rewrites it).
PLOTS = "docs/bench"
SECTION = re.compile(r"(<!-- section: performance -->\n)(.*?)(<!-- /section: performance -->)", re.S)


def section_text(results: list[report.ScenarioResult], plotted: list[str],
                 before: dict[str, Shown] | None = None) -> str:
    """The section's markdown; `plotted`: the scenarios whose plot sits in PLOTS; `before`:
    what the section showed of each scenario, kept for those with no result this time."""
    before = before or {}
    lines = [
        "## Performance",
        "",
        "The latest run of each scenario of the benchmark suite (`make bench`; what each one",
        "measures and how to read it: [docs/performance.md](docs/performance.md)), on a shared",
        "2-core machine with no GPU and other jobs running: read the ratios to the references,",
        "measured in the same run, rather than the absolute numbers. The distance says by how",
        "much each aim is met or missed. Each entry of the Runs line names the machine that run",
        "had: figures of runs on different machines do not compare.",
        "",
    ]
    fresh = {r.scenario: r for r in results}
    lines += ["| scenario | figure | measured | aim | distance | reference | command |",
              "|---|---|---|---|---|---|---|"]
    runs, plots = [], []
    # In the order the section had them; a scenario shown for the first time goes last.
    for scenario in [*before, *(name for name in fresh if name not in before)]:
        result = fresh.get(scenario)
        if result is None:
            lines += before[scenario].rows
            runs.append(before[scenario].run)
            plots += before[scenario].plot
            continue
        for fig in result.figures:
            cells = [result.scenario, fig.label, report.format_value(fig.value, fig.unit),
                     report.aim_text(fig), report.verdict(fig),
                     "; ".join(x for x in (fig.reference, fig.note) if x), f"`{result.command}`"]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        runs.append(f"{scenario} {result.started_utc}" + (f" on {result.machine}" if result.machine else ""))
        if scenario in plotted:
            plots.append(f"![{scenario}]({PLOTS}/{scenario}.png)")
    lines += ["", f"Runs: {', '.join(runs)}." if runs else "No benchmark has been run yet."]
    for plot in plots:
        lines += ["", plot]
    return "\n".join(lines)


@dataclasses.dataclass(slots=True)
class Shown:
    """What the section shows of a scenario: its table rows, its entry in the Runs line and
    its plot line (empty when it has none)."""

    rows: list[str]
    run: str
    plot: list[str]


def shown(section: str) -> dict[str, Shown]:
    """Each scenario's rows, run and plot as `section` (one written by section_text) has them."""
    found: dict[str, Shown] = {}
    runs = re.search(r"^Runs: (.*)\.$", section, re.M)
    for entry in runs.group(1).split(", ") if runs else []:
        name = entry.split(" ", 1)[0]
        found[name] = Shown([], entry, [])
    for line in section.splitlines():
        row = re.match(r"\| ([\w-]+) \|", line)
        if row and row.group(1) in found:
            found[row.group(1)].rows.append(line)
        plot = re.match(r"!\[([\w-]+)\]", line)
        if plot and plot.group(1) in found:
            found[plot.group(1)].plot.append(line)
    return found


def update(readme: pathlib.Path = README, results: pathlib.Path = report.RESULTS_DIR) -> None:
    text = readme.read_text()
    section = SECTION.search(text)
    if section is None:
        raise RuntimeError(f"{readme} has no <!-- section: performance --> ... <!-- /section: performance --> block")
    found = report.load_results(results)
    plotted = []
    for result in found:
        if result.plot and (results / result.plot).exists():
            (readme.parent / PLOTS).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(results / result.plot, readme.parent / PLOTS / f"{result.scenario}.png")
            plotted.append(result.scenario)
    body = section_text(found, plotted, shown(section.group(2)))
    readme.write_text(SECTION.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1))
