"""The self-sizing dispatch window of a model set to `dispatch_window: auto`: pure, on the
caller's `now`.

Two things bound a window, and the controller watches both (in the manner of llm-d's
saturation detector and of Netflix's gradient concurrency limiters):

- The engine's capacity. Requests waiting inside the engine for a second or more (its
  own queue, where the gateway's priority and fair share are lost; a burst of arrivals
  waits for one step, which is no saturation) or a nearly full KV cache mean the window
  is past it: shrink. Otherwise, while the window is what limits (requests queue in the
  gateway with their class's share of the window full), grow: doubling until the first shrink (slow start),
  then by window/8.
- The latency of the highest class, when lower classes share the engine with it. On an
  engine whose step time grows with its batch, every request at the engine slows the
  others' time to first response; the window is the lower classes' throughput traded
  for the highest class's latency. While a higher class and a lower one are both active,
  the window follows the gradient of the higher class's first-response latency against
  its unloaded baseline: above LATENCY_TOLERANCE x baseline it shrinks in proportion
  (by at most half), below it may grow. It also grows while that class itself waits
  in the gateway's queue: then its share of the window is too small for it, and a
  smaller window would only add queueing to its latency. With one class active there
  is nobody to protect: the window sizes for throughput alone, unless the engine exports
  no saturation signal (a dynamic batcher such as minilm's): then that class's latency
  is the only sign of saturation, and bounds the window the same way.

A class's samples in an interval are its dispatches' first-response latencies, and the
age of each of its dispatches still without a first response that is already older than
the class may take (LATENCY_TOLERANCE x baseline): under a flood, first responses can
take longer than an interval, and without these the controller saw no evidence and held
the window where the flood had grown it. A class is active while it has a dispatch in
flight (a stream still answering, long after its first response) or reported a latency
within ACTIVE_S: a critical stream in its decode phase is still protected, where the
window once grew back to full size under it. Nor does latency shrink the window below
what keeps room, under the nested reservation, for as many requests of the protected
class as it had in flight at once in the interval: a smaller window only queues them in
the gateway behind each other (the bench saw a window of 2 to 5 hold one of two critical
streams back for a whole generation of the other).

The baseline of a class is the lowest median of an interval's samples seen, whatever
else ran (a class measured alone sets it), let drift up very slowly so that one lucky reading, or a model that got slower for good, cannot pin it.
The window moves at most once per INTERVAL_S, always within [window_min, window_max].
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

# How often the window may move; long enough for a few dispatches to report latency.
INTERVAL_S = 0.5
# The highest class's first-response latency may reach this multiple of its baseline.
LATENCY_TOLERANCE = 1.5
# Saturated when the engine's KV cache is this full (new sequences would be preempted).
KV_CACHE_HIGH = 0.9
# Shrink on engine saturation; latency shrinks by the gradient, down to at most half.
DECREASE = 0.8
LARGEST_LATENCY_DECREASE = 0.5
GROWTH_DIVISOR = 8
# Per decision the baseline may rise by this fraction towards what is measured.
BASELINE_DRIFT = 0.002
# A class counts as active while it has a dispatch in flight or reported a latency
# within this long; engine readings older than this are ignored (the scrape stopped
# working).
ACTIVE_S = 5.0
ENGINE_STALE_S = 5.0
# Requests arriving together wait in the engine until its next step; only a waiting
# queue that persists this long is saturation.
WAITING_PERSIST_S = 1.0
# Latency samples kept per class and interval (their median decides).
_KEEP = 64


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports about its own saturation (summed over its upstreams)."""

    waiting: float
    """Requests queued inside the engine, not yet running."""
    kv_cache_usage: float | None
    """Fraction of the KV cache in use (0..1); None if the engine does not say."""


@dataclass(slots=True)
class _ClassLatency:
    last_at: float = -ACTIVE_S
    baseline_s: float | None = None
    samples: list[float] = field(default_factory=list)  # of the current interval
    recent_s: float | None = None  # their median, once the interval is over
    # Dispatches not ended yet: when each was dispatched while it still waits for its
    # first response, None once it answered. The most at once in this interval and in the
    # last one.
    in_flight: dict[object, float | None] = field(default_factory=dict)
    peak: int = 0
    recent_peak: int = 0

    def active(self, now: float) -> bool:
        return bool(self.in_flight) or now - self.last_at <= ACTIVE_S

    def close_interval(self, now: float) -> None:
        self.recent_peak, self.peak = self.peak, len(self.in_flight)
        # A dispatch without its first response yet has a latency of at least its age. One
        # already past what the class may take is a sample of that age: an engine so
        # loaded that no first response comes within an interval is not "no evidence".
        if self.baseline_s is not None:
            overdue = LATENCY_TOLERANCE * self.baseline_s
            for dispatched_at in self.in_flight.values():
                if len(self.samples) >= _KEEP:
                    break
                if dispatched_at is not None and now - dispatched_at > overdue:
                    self.samples.append(now - dispatched_at)
        if not self.samples:
            self.recent_s = None
            return
        recent = self.recent_s = statistics.median(self.samples)
        self.samples.clear()
        if self.baseline_s is None or recent < self.baseline_s:
            self.baseline_s = recent
        else:
            self.baseline_s = min(recent, self.baseline_s * (1.0 + BASELINE_DRIFT))


@dataclass(slots=True)
class WindowController:
    """One model's `auto` window."""

    minimum: int
    maximum: int
    window: int
    next_at: float = 0.0
    slow_start: bool = True
    engine: EngineLoad | None = None
    engine_at: float = 0.0
    waiting_since: float | None = None  # since when every reading showed a waiting queue
    # The slots of a window (2nd argument) that classes below `level` (1st) cannot take
    # (the nested reservation); by default all of them.
    reserved: Callable[[int, int], int] = lambda level, window: window
    _classes: dict[int, _ClassLatency] = field(default_factory=dict)

    def dispatched(self, level: int, key: object, now: float) -> None:
        """A request of class `level` (0 highest), known by `key`, was dispatched."""
        stats = self._class(level)
        stats.last_at = now
        stats.in_flight[key] = now
        stats.peak = max(stats.peak, len(stats.in_flight))

    def latency(self, level: int, seconds: float, now: float, key: object = None) -> None:
        """A dispatch of class `level` got its first response `seconds` after it was
        dispatched (`key`: as given to `dispatched`, if it was)."""
        stats = self._class(level)
        if key in stats.in_flight:
            stats.in_flight[key] = None
        stats.last_at = now
        if len(stats.samples) < _KEEP:
            stats.samples.append(seconds)

    def ended(self, level: int, key: object) -> None:
        """The dispatch `key` of class `level` ended, with or without a first response."""
        stats = self._classes.get(level)
        if stats is not None:
            stats.in_flight.pop(key, None)

    def _class(self, level: int) -> _ClassLatency:
        stats = self._classes.get(level)
        if stats is None:
            stats = self._classes[level] = _ClassLatency()
        return stats

    def engine_load(self, load: EngineLoad, now: float) -> None:
        self.engine, self.engine_at = load, now
        # A request or two waits in any engine between its arrival and the next step.
        if load.waiting < max(2.0, self.window / GROWTH_DIVISOR):
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = now

    def decide(self, now: float, *, limited: bool, queued_levels: frozenset[int] = frozenset()) -> int | None:
        """The new window if it moves now, else None; `limited`: the window is what holds
        queued requests back; `queued_levels`: the classes with requests queued in the
        gateway. Call often: it acts once per interval."""
        if now < self.next_at:
            return None
        self.next_at = now + INTERVAL_S
        for stats in self._classes.values():
            stats.close_interval(now)
        load = self.engine if now - self.engine_at <= ENGINE_STALE_S else None
        window: int | None = self._engine_bound(load, now, limited)
        protected = self._protected(now, engine_known=load is not None)
        if protected is not None and window is not None and window >= self.window:
            level, stats, alone = protected
            # The protected class waiting in the gateway's queue: its share of the window
            # is too small for it, and shrinking would only make it wait longer.
            if not alone and level in queued_levels:
                window = self._grown()
            else:
                window = self._latency_bound(level, stats, limited)
        if window is None or window == self.window:
            return None
        if window < self.window:
            self.slow_start = False
        self.window = window
        return window

    def _engine_bound(self, load: EngineLoad | None, now: float, limited: bool) -> int:
        if load is not None and (
            (self.waiting_since is not None and now - self.waiting_since >= WAITING_PERSIST_S)
            or (load.kv_cache_usage is not None and load.kv_cache_usage >= KV_CACHE_HIGH)
        ):
            return max(self.minimum, int(self.window * DECREASE))
        return self._grown() if limited else self.window

    def _protected(self, now: float, *, engine_known: bool) -> tuple[int, _ClassLatency, bool] | None:
        """The class whose latency bounds the window, and whether it is alone: the highest
        active class while a lower one is active too; without an engine reading, also a
        class alone (latency is then the only sign of saturation there is)."""
        active = sorted(level for level, s in self._classes.items() if s.active(now))
        if len(active) >= 2 or (active and not engine_known):
            return active[0], self._classes[active[0]], len(active) == 1
        return None

    def _latency_bound(self, level: int, stats: _ClassLatency, limited: bool) -> int | None:
        recent = stats.recent_s
        if recent is None or stats.baseline_s is None:
            return None  # no evidence from the last interval: hold
        allowed = LATENCY_TOLERANCE * stats.baseline_s
        if recent > allowed:
            factor = max(LARGEST_LATENCY_DECREASE, allowed / recent)
            shrunk = max(self.minimum, min(self.window - 1, int(self.window * factor)))
            return max(shrunk, self._room_for(level, stats.recent_peak))
        return self._grown() if limited else self.window

    def _room_for(self, level: int, count: int) -> int:
        """The smallest window (down to the current one) that keeps room for `count`
        requests of class `level` whatever the classes below hold: smaller, and the
        class's own requests queue in the gateway behind each other."""
        for window in range(self.minimum, self.window):
            if self.reserved(level, window) >= count:
                return window
        return self.window

    def _grown(self) -> int:
        step = self.window if self.slow_start else max(1, self.window // GROWTH_DIVISOR)
        return min(self.maximum, self.window + step)
