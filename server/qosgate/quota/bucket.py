"""Pure quota arithmetic on a given `now`: no clock, no I/O, no locks."""

from __future__ import annotations

from dataclasses import dataclass

# Refill is computed in floating point: after waiting exactly the advertised retry_after the
# level may land a few ulps short of what is needed. The tolerance makes the advertised wait
# honest without granting anything measurable.
_EPSILON = 1e-9


@dataclass(slots=True)
class TokenBucket:
    """A token bucket: `rate` tokens per second, holding at most `capacity`.

    A request needs min(amount, capacity) tokens present and then takes all `amount`, so the
    level may go negative: a cost larger than the bucket is still admitted once the bucket
    is full, and paid for by the wait of the requests that follow.
    """

    rate: float
    capacity: float
    level: float
    updated: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate=rate, capacity=capacity, level=capacity, updated=now)

    def _refill(self, now: float) -> None:
        # A clock reading from before the last update (a caller's stale `now`) adds nothing.
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_s(self, now: float, amount: float) -> float:
        """Seconds until `amount` can be taken (0.0: now). Takes nothing."""
        self._refill(now)
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= _EPSILON else missing / self.rate

    def take(self, now: float, amount: float) -> None:
        """Take `amount` regardless of the level (check `wait_s` first)."""
        self._refill(now)
        self.level -= amount

    def give_back(self, now: float, amount: float) -> None:
        """Return tokens that were taken but not used (e.g. an over-estimated cost)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)
