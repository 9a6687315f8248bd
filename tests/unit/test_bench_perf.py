"""bench/perf.py: a perf_analyzer run is stopped, with the reason, when what it measures
dies under it or its time is up (perf_analyzer alone would wait forever)."""

from __future__ import annotations

import subprocess

from bench import perf


def test_a_watch_that_objects_stops_the_run_and_its_reason_is_returned() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    answers = iter([None, None, "tritonserver died (signal 11)"])
    assert perf._wait(proc, 120, lambda: next(answers)) == "tritonserver died (signal 11)"
    assert proc.returncode is not None  # killed, not left running


def test_a_run_past_its_timeout_is_stopped() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    assert perf._wait(proc, 0.1, lambda: None) == "no result after 0s"
    assert proc.returncode is not None


def test_a_run_that_ends_by_itself_has_no_reason() -> None:
    proc = subprocess.Popen(["sleep", "0.7"])
    asked: list[int] = []

    def watch() -> None:
        asked.append(1)

    assert perf._wait(proc, 60, watch) is None
    assert proc.returncode == 0
    assert asked  # it was watched while it ran
