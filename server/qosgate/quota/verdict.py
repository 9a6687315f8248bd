"""What admission decides, as values: the edge turns a Refused into RESOURCE_EXHAUSTED."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from qosgate.errors import QuotaExceeded, QuotaViolation


class PermitRelease(Protocol):
    """Frees what a permit holds; called at most once per permit."""

    def __call__(self, reserved_tokens: int, actual_tokens: int | None) -> None: ...


@dataclass(slots=True, eq=False)
class Permit:
    """What an admitted request holds until it finishes: a concurrency slot, reserved tokens."""

    reserved_tokens: int
    _release: PermitRelease | None = field(repr=False)

    def release(self, actual_tokens: int | None = None) -> None:
        """Free the slot; `actual_tokens` replaces the reserved estimate. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release(self.reserved_tokens, actual_tokens)


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may proceed; release `permit` when it is done."""

    permit: Permit


@dataclass(frozen=True, slots=True)
class Refused:
    """The request exceeds at least one limit; none of its limits were charged."""

    retry_after_s: float
    violations: tuple[QuotaViolation, ...]

    def error(self) -> QuotaExceeded:
        described = "; ".join(v.description for v in self.violations)
        return QuotaExceeded(f"quota exceeded: {described}", self.retry_after_s, self.violations)


Verdict = Admitted | Refused
