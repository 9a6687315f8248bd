"""The benchmark suite's pure parts: statistics, aims, the report and README rewriting."""

from __future__ import annotations

import math
import pathlib

import pytest

from bench import readme, report
from bench.profile import Profile, parse
from bench.report import Aim, Figure, ScenarioResult
from bench.scenarios import describe_machine
from bench.stats import jain_index, percentile


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_jain_index_bounds() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 2.0]) == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("aim", "value", "met", "distance"),
    [
        (Aim(">=", 80.0), 85.0, True, 5.0),
        (Aim(">=", 80.0), 70.0, False, -10.0),
        (Aim("<=", 100.0), 130.0, False, -30.0),
        (Aim("<=", 100.0), 40.0, True, 60.0),
    ],
)
def test_aim_distance_is_signed_margin(aim: Aim, value: float, met: bool, distance: float) -> None:
    assert aim.met(value) is met
    assert aim.distance(value) == pytest.approx(distance)


def _result() -> ScenarioResult:
    return ScenarioResult(
        scenario="quota", command="python -m bench quota --quick", quick=True,
        started_utc="2026-01-01 00:00 UTC", duration_s=12.0,
        figures=[Figure("admitted rate off the limit", 3.5, "%", Aim("<=", 2.0), reference="x"),
                 Figure("not measured yet", None, "%", Aim("<=", 2.0))],
        tables={"tenants": [{"tenant": "a", "limit": 5.0}]}, machine="Test CPU with 2 cores and AVX2",
    )


def test_result_round_trips_through_json(tmp_path: pathlib.Path) -> None:
    path = _result().write(tmp_path)
    assert ScenarioResult.read(path) == _result()


def test_report_states_missed_aims_with_distance(tmp_path: pathlib.Path) -> None:
    _result().write(tmp_path)
    text = report.write_report(tmp_path).read_text()
    assert "MISSED (-1.5%)" in text
    assert "not measured" in text


def test_readme_update_replaces_only_its_section(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "results"
    _result().write(results)
    target = tmp_path / "README.md"
    target.write_text("a\n<!-- section: performance -->\nold\n<!-- /section: performance -->\nb\n")
    readme.update(target, results)
    text = target.read_text()
    assert text.startswith("a\n<!-- section: performance -->\n## Performance")
    assert text.endswith("<!-- /section: performance -->\nb\n")
    assert "old" not in text
    assert "`python -m bench quota --quick`" in text


def test_readme_update_commits_each_plot_next_to_the_readme(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "results"
    result = _result()
    result.plot = "quota.png"
    result.write(results)
    (results / "quota.png").write_bytes(b"\x89PNG fake")
    target = tmp_path / "README.md"
    target.write_text("<!-- section: performance -->\n<!-- /section: performance -->\n")
    readme.update(target, results)
    assert (tmp_path / readme.PLOTS / "quota.png").read_bytes() == b"\x89PNG fake"
    assert f"![quota]({readme.PLOTS}/quota.png)" in target.read_text()


def test_profile_sums_functions_across_lines() -> None:
    found = Profile({
        "main (app.py:1);work (qosgate/x.py:10)": 3,
        "main (app.py:1);work (qosgate/x.py:12)": 1,
        "main (app.py:1);idle (loop.py:5)": 2,
    })
    assert found.top(1, inclusive=False) == [{"function": "work (qosgate/x.py)", "share %": 66.7}]
    assert found.top(5, inclusive=True, within="qosgate/") == [{"function": "work (qosgate/x.py)", "share %": 66.7}]


def test_profile_names_compiled_functions_and_leaves_out_waiting_threads() -> None:
    loop = "run (qosgate/app.py:445);uv__io_poll (linux.c:1546)"
    found = parse(
        f"{loop};CPyPy_qosgate___transport___peer___Peer___data_received (__native__native.c:216773);"
        "CPyDef_qosgate___transport___peer___Peer___data_received (__native__native.c:216685);"
        "write (libc.so.6) 3\n"
        f"{loop};epoll_wait (libc.so.6) 5\n"
        "main (threading.py:1);poll (libc.so.6) 4\n"
    )
    assert found.samples == 3  # the 9 waiting in the selector are no CPU
    compiled = "transport.peer.Peer.data_received (qosgate/, compiled)"
    assert found.top(1, inclusive=False) == [{"function": "write (libc.so.6)", "share %": 100.0}]
    assert {"function": compiled, "share %": 100.0} in found.top(5, inclusive=True, within="qosgate/")


def test_readme_update_keeps_the_rows_of_scenarios_not_run_again(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "results"
    _result().write(results)
    target = tmp_path / "README.md"
    target.write_text(
        "<!-- section: performance -->\n"
        "| scenario | figure | measured | aim | distance | reference | command |\n|---|---|---|---|---|---|---|\n"
        "| overhead | CPU per request | 80 us | <= 100 us | met (+20 us) | nginx 50 us | `python -m bench overhead` |\n"
        "| quota | admitted rate off the limit | 9.9% | <= 2.0% | MISSED (-7.9%) | x | `python -m bench quota` |\n"
        "\nRuns: overhead 2025-12-01 10:00 UTC, quota 2025-12-01 11:00 UTC.\n\n![overhead](docs/bench/overhead.png)\n"
        "<!-- /section: performance -->\nnotes\n")
    readme.update(target, results)
    text = target.read_text()
    assert "| overhead | CPU per request | 80 us |" in text  # no result this time: as it was
    assert "9.9%" not in text and "| quota | admitted rate off the limit | 3.5% |" in text
    # A run names its machine; an entry kept from before stays as it was.
    assert "Runs: overhead 2025-12-01 10:00 UTC, quota 2026-01-01 00:00 UTC on Test CPU with 2 cores and AVX2." in text
    assert "![overhead](docs/bench/overhead.png)" in text
    assert text.index("| overhead |") < text.index("| quota |")
    assert text.endswith("<!-- /section: performance -->\nnotes\n")


@pytest.mark.parametrize(
    ("cpuinfo", "described"),
    [
        ("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2\n", "AMD EPYC with 2 cores and AVX2"),
        ("model name\t: Intel(R) Xeon(R) Gold, 6338\nflags\t\t: avx2 avx512f avx512bw\n",
         "Intel(R) Xeon(R) Gold 6338 with 2 cores and AVX-512"),
        ("processor\t: 0\n", "unknown CPU with 2 cores and no AVX2"),
    ],
)
def test_a_run_names_its_cpu_without_commas(cpuinfo: str, described: str) -> None:
    assert describe_machine(cpuinfo, 2) == described
