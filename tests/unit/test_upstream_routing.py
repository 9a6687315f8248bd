"""The pure replica choice: least loaded, and prefix affinity with bounded loads."""

from __future__ import annotations

import collections

import pytest

from qosgate.upstream.routing import (
    Candidate,
    HashRing,
    Outcome,
    PrefixAffinity,
    affinity_key,
    least_loaded,
)

NAMES = ("a", "b", "c")


def idle(*names: str) -> list[Candidate]:
    return [Candidate(n, 0) for n in names]


def test_least_loaded_takes_the_fewest_in_flight_and_turns_among_equals() -> None:
    candidates = [Candidate("a", 2), Candidate("b", 1), Candidate("c", 1)]
    assert [least_loaded(candidates, turn) for turn in range(4)] == [1, 1, 2, 1]
    assert [least_loaded(idle(*NAMES), turn) for turn in range(4)] == [0, 1, 2, 0]


def test_a_key_keeps_its_replica_and_keys_spread_over_all() -> None:
    ring = HashRing(NAMES)
    policy = PrefixAffinity()
    owners = collections.Counter()
    for tenant in range(300):
        key = affinity_key(f"You are the assistant of tenant {tenant}." * 10, 256)
        choices = {policy.choose(ring, idle(*NAMES), key).index for _ in range(5)}
        assert len(choices) == 1
        owners[NAMES[choices.pop()]] += 1
    # 300 keys on 3 replicas: each owns a fair part (exact shares depend on the hash).
    assert all(60 <= owners[n] <= 140 for n in NAMES), owners


def test_the_key_is_the_prompts_prefix_or_the_session() -> None:
    system = "S" * 300
    assert affinity_key(system + "question one", 256) == affinity_key(system + "question two", 256)
    assert affinity_key(system + "q", 1024) != affinity_key(system + "r", 1024)
    assert affinity_key(system, 256, session="s1") == affinity_key("other", 256, session="s1")
    assert affinity_key(system, 256, session="s1") != affinity_key(system, 256)
    # Cut on bytes: a multi-byte character may be split, the key is still stable.
    assert affinity_key("é" * 10, 5) == affinity_key("é" * 20, 5)


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    ring = HashRing(NAMES)
    policy = PrefixAffinity()
    keys = [affinity_key(f"prompt {i}", 64) for i in range(200)]
    before = [NAMES[policy.choose(ring, idle(*NAMES), k).index] for k in keys]
    remaining = idle("a", "c")
    after = [remaining[policy.choose(ring, remaining, k).index].name for k in keys]
    for owner, now in zip(before, after, strict=True):
        if owner != "b":
            assert now == owner
    assert "b" in before


def test_an_overloaded_replica_spills_to_the_next_on_the_ring() -> None:
    ring = HashRing(NAMES)
    policy = PrefixAffinity(load_factor=1.25)
    key = affinity_key("a shared system prompt", 256)
    preferred, second, _ = list(ring.walk(key))
    # 8 in flight at the preferred one, 0 elsewhere: bound = ceil(1.25 * 9 / 3) = 4.
    candidates = [Candidate(n, 8 if n == preferred else 0) for n in NAMES]
    choice = policy.choose(ring, candidates, key)
    assert (candidates[choice.index].name, choice.outcome) == (second, Outcome.SPILLED)
    # Within the bound it stays: 2 + 1 <= ceil(1.25 * 5 / 3) = 3.
    candidates = [Candidate(n, 2 if n == preferred else 1) for n in NAMES]
    choice = policy.choose(ring, candidates, key)
    assert (candidates[choice.index].name, choice.outcome) == (preferred, Outcome.AFFINITY)


def test_load_stays_within_the_bound_when_every_call_has_one_key() -> None:
    """The worst case for affinity: one hot key. Counts never pass the bound."""
    ring = HashRing(NAMES)
    policy = PrefixAffinity(load_factor=1.25)
    key = affinity_key("one hot prefix", 256)
    loads = dict.fromkeys(NAMES, 0)
    for _ in range(60):
        candidates = [Candidate(n, loads[n]) for n in NAMES]
        choice = policy.choose(ring, candidates, key)
        total = sum(loads.values()) + 1
        loads[candidates[choice.index].name] += 1
        assert max(loads.values()) <= -(-1.25 * total // 3)
    # The key's own replica is filled up to the bound, no further.
    assert loads[next(ring.walk(key))] == 25 == -(-1.25 * 60 // 3)


def test_a_saturated_engine_is_passed_over() -> None:
    ring = HashRing(("a", "b"))
    policy = PrefixAffinity(max_engine_waiting=4)
    key = affinity_key("prompt", 256)
    preferred = next(ring.walk(key))
    candidates = [Candidate(n, 0, engine_waiting=10 if n == preferred else 0) for n in ("a", "b")]
    choice = policy.choose(ring, candidates, key)
    assert candidates[choice.index].name != preferred
    assert choice.outcome is Outcome.SPILLED


def test_all_saturated_falls_back_to_the_least_loaded() -> None:
    ring = HashRing(("a", "b"))
    policy = PrefixAffinity(max_engine_waiting=1)
    candidates = [Candidate("a", 3, engine_waiting=5), Candidate("b", 1, engine_waiting=5)]
    choice = policy.choose(ring, candidates, affinity_key("prompt", 256))
    assert (choice.index, choice.outcome) == (1, Outcome.FALLBACK)


def test_unknown_engine_load_is_not_saturation() -> None:
    ring = HashRing(("a",))
    choice = PrefixAffinity(max_engine_waiting=0).choose(ring, [Candidate("a", 0)], b"k")
    assert choice.outcome is Outcome.AFFINITY


def test_names_must_be_unique_and_candidates_present() -> None:
    with pytest.raises(ValueError):
        HashRing(("a", "a"))
    with pytest.raises(ValueError):
        PrefixAffinity().choose(HashRing(("a",)), [], b"k")
    with pytest.raises(ValueError):
        least_loaded([], 0)
