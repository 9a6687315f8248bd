"""Which upstream gets a call: healthy ones only, fewest in flight, round-robin among equals."""

from __future__ import annotations

import pytest

from qosgate.config import UpstreamConfig
from qosgate.errors import Unavailable
from qosgate.upstream import UpstreamPool


def pool_of(*names: str) -> UpstreamPool:
    return UpstreamPool([UpstreamConfig(name=n, url=f"127.0.0.1:{i + 1}") for i, n in enumerate(names)])


def test_no_healthy_upstream_is_unavailable_with_a_retry_hint() -> None:
    pool = pool_of("a", "b")
    with pytest.raises(Unavailable) as caught:
        pool.pick()
    assert caught.value.retry_after_s is not None


def test_only_healthy_upstreams_are_picked() -> None:
    pool = pool_of("a", "b", "c")
    pool.upstreams[1].healthy = True
    assert {pool.pick().name for _ in range(6)} == {"b"}


def test_equals_take_turns() -> None:
    pool = pool_of("a", "b", "c")
    for upstream in pool.upstreams:
        upstream.healthy = True
    assert [pool.pick().name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_wins() -> None:
    pool = pool_of("a", "b", "c")
    for upstream in pool.upstreams:
        upstream.healthy = True
    a, b, _ = pool.upstreams
    with a.lease(), a.lease(), b.lease():
        assert {pool.pick().name for _ in range(6)} == {"c"}
    assert a.in_flight == b.in_flight == 0
