"""Fakes for unit tests of pure logic (never used by integration tests)."""

from __future__ import annotations

from typing import Any

from qosgate.auth import Tenant
from qosgate.config import LimitsConfig


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


def make_tenant(name: str = "acme", **fields: Any) -> Tenant:
    """A Tenant for unit tests: standard class, every model, no limits unless overridden.

    `limits` may be given as a dict of LimitsConfig fields.
    """
    limits = fields.pop("limits", {})
    values: dict[str, Any] = {
        "weight": 1.0,
        "default_class": "standard",
        "max_class": "critical",
        "models": ("*",),
        "admin": False,
        "limits": limits if isinstance(limits, LimitsConfig) else LimitsConfig(**limits),
    }
    values.update(fields)
    return Tenant(name=name, **values)
