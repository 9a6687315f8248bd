"""Fakes for unit tests of pure logic (never used by integration tests)."""

from __future__ import annotations


class FakeClock:
    """A Clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._now += seconds
