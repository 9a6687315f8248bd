"""The self-sizing dispatch window of a model set to `dispatch_window: auto`: pure, on the
caller's `now`.

AIMD, in the manner of Netflix's concurrency limiters and llm-d's saturation detector:
once per interval the controller looks at what the last interval showed and
- shrinks the window by a factor when the engine saturates: requests waiting inside the
  engine beyond a step's arrivals (its own queue, where the gateway's priority and fair share are lost), its
  KV cache nearly full, or dispatch latency (time to first response) far above the
  model's unloaded baseline;
- grows it by a step when the engine keeps up and the window, not demand, is what
  limits (requests queued in the gateway while the window is full);
- otherwise holds it. Always within [window_min, window_max].

The baseline is the lowest median latency of an interval seen so far, let drift up very
slowly so that one lucky reading, or a model that got slower for good, cannot pin it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# How often the window may move; long enough for a few dispatches to report latency.
INTERVAL_S = 0.5
# Saturated when the interval's median latency exceeds the baseline by this factor.
LATENCY_TOLERANCE = 1.5
# Saturated when the engine's KV cache is this full (new sequences would be preempted).
KV_CACHE_HIGH = 0.9
# Multiplicative decrease on saturation; growth is window/8 (at least 1) per interval.
DECREASE = 0.8
GROWTH_DIVISOR = 8
# Per interval the baseline may rise by this fraction towards what is measured.
BASELINE_DRIFT = 0.002
# Engine readings older than this are ignored (the scrape stopped working).
ENGINE_STALE_S = 5.0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports about its own saturation (summed over its upstreams)."""

    waiting: float
    """Requests queued inside the engine, not yet running."""
    kv_cache_usage: float | None
    """Fraction of the KV cache in use (0..1); None if the engine does not say."""


@dataclass(slots=True)
class WindowController:
    """One model's `auto` window."""

    minimum: int
    maximum: int
    window: int
    next_at: float = 0.0
    baseline_s: float | None = None
    engine: EngineLoad | None = None
    engine_at: float = 0.0
    _samples: list[float] = field(default_factory=list)

    def latency(self, seconds: float) -> None:
        """A dispatch's time from dispatch to its first response."""
        self._samples.append(seconds)

    def engine_load(self, load: EngineLoad, now: float) -> None:
        self.engine, self.engine_at = load, now

    def decide(self, now: float, *, queued: int, in_flight: int) -> int | None:
        """The new window if it moves now, else None. Call often: it acts once per interval."""
        if now < self.next_at:
            return None
        self.next_at = now + INTERVAL_S
        recent = statistics.median(self._samples) if self._samples else None
        self._samples.clear()
        if recent is not None:
            if self.baseline_s is None or recent < self.baseline_s:
                self.baseline_s = recent
            else:
                self.baseline_s = min(recent, self.baseline_s * (1.0 + BASELINE_DRIFT))
        if self.saturated(now, recent):
            window = max(self.minimum, int(self.window * DECREASE))
        elif queued and in_flight >= self.window:
            window = min(self.maximum, self.window + max(1, self.window // GROWTH_DIVISOR))
        else:
            return None
        if window == self.window:
            return None
        self.window = window
        return window

    def saturated(self, now: float, recent: float | None) -> bool:
        load = self.engine if now - self.engine_at <= ENGINE_STALE_S else None
        if load is not None:
            # A request or two waits in any engine between its arrival and the next step.
            if load.waiting >= max(2.0, self.window / GROWTH_DIVISOR):
                return True
            if load.kv_cache_usage is not None and load.kv_cache_usage >= KV_CACHE_HIGH:
                return True
        return (
            recent is not None
            and self.baseline_s is not None
            and recent > LATENCY_TOLERANCE * self.baseline_s
        )
