"""bench/perf.py: a perf_analyzer run is stopped, with the reason, when what it measures
dies under it or its time is up (perf_analyzer alone would wait forever); a run whose time
is up is run once more."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from bench import perf


def test_a_watch_that_objects_stops_the_run_and_its_reason_is_returned() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    answers = iter([None, None, "tritonserver died (signal 11)"])
    assert perf._wait(proc, 120, lambda: next(answers)) == ("tritonserver died (signal 11)", False)
    assert proc.returncode is not None  # killed, not left running


def test_a_run_past_its_timeout_is_stopped() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    assert perf._wait(proc, 0.1, lambda: None) == ("no result after 0s", True)
    assert proc.returncode is not None


def test_a_run_that_ends_by_itself_has_no_reason() -> None:
    proc = subprocess.Popen(["sleep", "0.7"])
    asked: list[int] = []

    def watch() -> None:
        asked.append(1)

    assert perf._wait(proc, 60, watch) == (None, False)
    assert proc.returncode == 0
    assert asked  # it was watched while it ran


# Stands in for perf_analyzer: hangs on the runs listed in HANG (counted in a file), and
# otherwise writes a one-request profile export where --profile-export-file says.
_FAKE = """#!/bin/sh
count=$(($(cat "{dir}/runs" 2>/dev/null || echo 0) + 1))
echo $count > "{dir}/runs"
for n in {hang}; do [ "$n" = "$count" ] && exec sleep 60; done
while [ $# -gt 0 ]; do
  [ "$1" = "--profile-export-file" ] && printf '%s' '{export}' > "$2"
  shift
done
"""
_EXPORT = {"experiments": [{"requests": [{"timestamp": 0, "response_timestamps": [2_000_000]}]}]}


def _fake_perf_analyzer(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, hang: str) -> pathlib.Path:
    script = tmp_path / "perf_analyzer"
    script.write_text(_FAKE.format(dir=tmp_path, hang=hang, export=json.dumps(_EXPORT)))
    script.chmod(0o755)
    monkeypatch.setattr(perf, "perf_analyzer", lambda: script)
    return tmp_path / "runs"


def _measure(**kwargs: object) -> perf.PerfPoint:
    return perf.measure(url="x", model="m", concurrency=1, settings=perf.PerfSettings(1), **kwargs)


def test_a_run_that_gives_no_result_in_time_is_run_once_more(tmp_path, monkeypatch) -> None:
    runs = _fake_perf_analyzer(tmp_path, monkeypatch, hang="1")
    point = _measure(timeout=0.5)
    assert runs.read_text().strip() == "2"
    assert point.throughput == pytest.approx(500.0)  # one request in 2 ms, from the second run


def test_a_second_run_without_a_result_fails_the_point(tmp_path, monkeypatch) -> None:
    runs = _fake_perf_analyzer(tmp_path, monkeypatch, hang="1 2")
    with pytest.raises(perf.PerfAnalyzerTimedOut, match="no result after"):
        _measure(timeout=0.5)
    assert runs.read_text().strip() == "2"


def test_a_watch_that_objects_is_not_run_again(tmp_path, monkeypatch) -> None:
    runs = _fake_perf_analyzer(tmp_path, monkeypatch, hang="1")
    with pytest.raises(perf.PerfAnalyzerFailed, match="Triton exited") as failed:
        _measure(timeout=60, watch=lambda: "Triton exited")
    assert not isinstance(failed.value, perf.PerfAnalyzerTimedOut)
    assert runs.read_text().strip() == "1"
