"""side_by_side_cpus: the CPU shares of replicas run side by side on one host."""

from __future__ import annotations

import os

import pytest

from qosgate.launcher import side_by_side_cpus


@pytest.mark.parametrize(
    ("available", "count", "shares"),
    [
        ({0, 1}, 2, [[0], [1]]),
        ({0, 1, 2, 3, 4, 5, 6, 7}, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ({0, 1, 2, 3, 4}, 2, [[0, 1], [2, 3]]),  # the odd one out is left to the rest
        ({4, 9, 2}, 3, [[2], [4], [9]]),  # the CPUs this process may use, in order
        ({0, 1}, 3, [[0], [1], [0]]),  # more replicas than CPUs: they share round robin
        ({3}, 1, [[3]]),
    ],
)
def test_replicas_get_disjoint_shares_of_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, available: set[int], count: int, shares: list[list[int]]
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: available)
    assert side_by_side_cpus(count) == shares


def test_no_replicas_is_an_error() -> None:
    with pytest.raises(ValueError):
        side_by_side_cpus(0)
