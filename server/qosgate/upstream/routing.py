"""Which replica gets a call: the pure choice, free of channels and health checks.

Two policies, chosen per model (`models.<name>.routing.policy`):

- `least_loaded`: the replica with the fewest calls of the model in flight; equals take
  turns.
- `prefix_affinity`: calls whose prompts begin alike go to the same replica, so that the
  engine there finds the prefix's KV cache already computed. The key is a session id
  from a header when the caller sends one, else the first `prefix_bytes` bytes of the
  rendered prompt (for chat: the template's rendering of the system prompt and the
  history, which come first). Keys are placed on a consistent-hash ring with
  `_POINTS_PER_REPLICA` points per replica, so a replica going away moves only its own
  keys and a returning one takes back the same keys. The load is bounded as in
  "consistent hashing with bounded loads" (Mirrokni, Thorup, Zadimoghaddam, 2018): no
  replica takes a call that would bring it above `load_factor` x the average load of
  the candidates (rounded up); a replica over that bound is passed over for the next
  one on the ring, which keeps a second-choice affinity instead of scattering the key.
  A replica whose engine has more than `max_engine_waiting` requests waiting is
  saturated and passed over too. If every candidate is passed over, the least loaded
  one gets the call. The default factor is 2, not the paper's 1 + epsilon: replicas
  run tens of calls each, where 1.25 x the average is only a few calls above it, and a
  replica that owns a little more than its share of the keys (18 of 32 on two) then
  sat at the bound and spilled 17-32% of calls in the routing bench. Each spilled call
  missed the cache and pushed a foreign prefix into the other replica's, so
  prefix_affinity found no more prompt tokens cached than least_loaded (57-69% against
  54-63%); at 2, nothing spilled and it found 75-87%. The SGLang model gateway's
  `cache_aware` policy, for the same reason, leaves cache affinity only past an
  imbalance of 64 requests and 1.5 x.

How this meets the engines' caches: vLLM's automatic prefix caching (on by default in
vLLM's V1 engine; our backend sets `enable_prefix_caching` in model.json) keeps KV blocks
of `block_size` tokens (16 on GPUs, 128 on CPUs) keyed by the hash of every token before them, so a later
prompt reuses all the full blocks it shares from its first token on, and only on the
replica that computed them. TensorRT-LLM's KV cache reuse (`enable_kv_cache_reuse` in
its KvCacheConfig, paged context FMHA) works the same way on blocks of
`tokens_per_block`. Neither engine shares its cache with another replica, so the share
of prompts that land where their prefix is cached is what the router can raise; the key
only needs to be long enough to tell the shared prefixes (system prompts, few-shot
templates) apart, and short enough to end inside them: a key that reaches into the
per-request part scatters calls that share a prefix.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from qosgate.config import RoutingConfig

# Points per replica on the ring: with 64, each of 2-8 replicas owns within about 20% of
# its fair share of the key space, and building the ring stays cheap.
_POINTS_PER_REPLICA = 64


class Outcome(enum.Enum):
    """How a replica was chosen, as the routing metric counts it."""

    LEAST_LOADED = "least_loaded"
    """The least_loaded policy, or a call without an affinity key."""
    AFFINITY = "affinity"
    """The key's own replica."""
    SPILLED = "spilled"
    """A later replica on the key's ring walk: those before it were over the bound."""
    FALLBACK = "fallback"
    """Every replica was over the bound or saturated: the least loaded one."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that may take the call, as the choice sees it."""

    name: str
    in_flight: int
    """Calls in flight there."""
    engine_waiting: float | None = None
    """Requests waiting in the replica's engine, if its metrics are read."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen candidate (its position in the candidates given) and how it was chosen."""

    index: int
    outcome: Outcome


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def affinity_key(prompt: str, prefix_bytes: int, session: str | None = None) -> bytes:
    """The affinity key of a call: its session id if it has one, else its prompt's first
    `prefix_bytes` bytes (UTF-8)."""
    if session:
        return b"session\0" + session.encode()
    return b"prefix\0" + prompt.encode()[:prefix_bytes]


def routing_key(config: RoutingConfig, prompt: str | None, session: str | None) -> bytes | None:
    """The key a call is routed by under `config`: None under `least_loaded`, and for a
    call with neither a prompt the gateway reads (KServe) nor a session id."""
    if config.policy != "prefix_affinity" or (prompt is None and not session):
        return None
    return affinity_key(prompt or "", config.prefix_bytes, session)


def least_loaded(candidates: Sequence[Candidate], turn: int) -> int:
    """The position of the candidate with the fewest calls in flight; among equals the
    first at or after `turn` (modulo), so that a caller counting turns spreads ties."""
    count = len(candidates)
    if count == 0:
        raise ValueError("no candidates")
    best = turn % count
    for step in range(1, count):
        i = (turn + step) % count
        if candidates[i].in_flight < candidates[best].in_flight:
            best = i
    return best


class HashRing:
    """A consistent-hash ring over replica names."""

    __slots__ = ("_points", "_owners")

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        placed = sorted(
            (_point(f"{name}#{i}".encode()), name) for name in names for i in range(_POINTS_PER_REPLICA)
        )
        self._points = [point for point, _ in placed]
        self._owners = [name for _, name in placed]

    def walk(self, key: bytes) -> Iterator[str]:
        """Each replica once, in ring order from the key's point: its preferred one first."""
        start = bisect.bisect(self._points, _point(key))
        seen: set[str] = set()
        total = len(self._owners)
        for step in range(total):
            owner = self._owners[(start + step) % total]
            if owner not in seen:
                seen.add(owner)
                yield owner


@dataclass(frozen=True, slots=True)
class PrefixAffinity:
    """Bounded-load consistent hashing; see the module docstring."""

    load_factor: float = 2.0
    max_engine_waiting: float | None = None

    def choose(self, ring: HashRing, candidates: Sequence[Candidate], key: bytes, turn: int = 0) -> Choice:
        """The candidate for the call with `key`; `turn` breaks ties of the fallback.

        Names on the ring that are not candidates (down, or without the model) are
        skipped, so their keys go to the next replica on the ring until they return.
        """
        if not candidates:
            raise ValueError("no candidates")
        position = {c.name: i for i, c in enumerate(candidates)}
        # The call itself counts: with all idle the bound is ceil(factor / n) >= 1.
        total = sum(c.in_flight for c in candidates) + 1
        bound = math.ceil(self.load_factor * total / len(candidates))
        first = True
        for name in ring.walk(key):
            i = position.get(name)
            if i is None:
                continue
            candidate = candidates[i]
            if candidate.in_flight + 1 <= bound and not self._saturated(candidate):
                return Choice(i, Outcome.AFFINITY if first else Outcome.SPILLED)
            first = False
        return Choice(least_loaded(candidates, turn), Outcome.FALLBACK)

    def _saturated(self, candidate: Candidate) -> bool:
        limit = self.max_engine_waiting
        return limit is not None and candidate.engine_waiting is not None and candidate.engine_waiting > limit
