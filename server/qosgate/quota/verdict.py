"""What admission decides, as values: the edge turns a Refused into RESOURCE_EXHAUSTED."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from qosgate.errors import QuotaExceeded, QuotaViolation


@dataclass(slots=True, eq=False, init=False)
class Permit:
    """What an admitted request holds until it finishes: a concurrency slot, reserved tokens.

    `on_release(actual_tokens)` frees them: at once (it returns None) where the quota state
    is in this process, or through what it returns to await (a shared store's answer)."""

    reserved_tokens: int
    _on_release: Callable[[int | None], Awaitable[None] | None] | None = field(repr=False)

    # Written out (init=False) here, in Admitted and in Refused, built on every call: the
    # `__init__` that `dataclasses` generates is interpreted even in a compiled module.
    def __init__(
        self, reserved_tokens: int, on_release: Callable[[int | None], Awaitable[None] | None] | None
    ) -> None:
        self.reserved_tokens = reserved_tokens
        self._on_release = on_release

    async def release(self, actual_tokens: int | None = None) -> None:
        """Free the slot; `actual_tokens` settles the reserved estimate. Idempotent."""
        pending = self.release_now(actual_tokens)
        if pending is not None:
            await pending

    def release_now(self, actual_tokens: int | None = None) -> Awaitable[None] | None:
        """`release`, begun at once: None once it is done, else what is left to await. The
        relay frees a call's permit without a coroutine this way, where nothing waits."""
        # Cleared first: a second release while the first is in flight is a no-op.
        on_release, self._on_release = self._on_release, None
        return None if on_release is None else on_release(actual_tokens)


@dataclass(slots=True, init=False)
class Admitted:
    """The request may proceed; release `permit` when it is done."""

    permit: Permit

    def __init__(self, permit: Permit) -> None:
        self.permit = permit


@dataclass(slots=True, init=False)
class Refused:
    """The request exceeds at least one limit; none of its limits were charged."""

    retry_after_s: float
    violations: tuple[QuotaViolation, ...]

    def __init__(self, retry_after_s: float, violations: tuple[QuotaViolation, ...]) -> None:
        self.retry_after_s = retry_after_s
        self.violations = violations

    def error(self) -> QuotaExceeded:
        described = "; ".join(v.description for v in self.violations)
        return QuotaExceeded(f"quota exceeded: {described}", self.retry_after_s, self.violations)


Verdict = Admitted | Refused
