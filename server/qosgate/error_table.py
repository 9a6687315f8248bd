"""The one table of domain errors: each error class's status code and rejection reason,
and the text a caller may read of an error.

Transport-free (code names are gRPC's, as text), so the data plane labels its metrics and
spans by it; each transport renders a row its own way: `transport.status` as a gRPC
status, `openai_api.errors` as an HTTP response.

INTERNAL never shows the cause to the caller: it is logged with an incident number that
the caller does see, so an operator can find it.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

from qosgate import errors
from qosgate.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error"
# Messages quote what the caller sent (a model name, a URL): bounded, so that a huge value
# cannot make a status trailer exceed what a client accepts (8 KiB by default in gRPC).
MAX_MESSAGE_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """How one domain error class ends a call."""

    code: str  # the gRPC status code's name
    reason: str  # the `reason` label of the rejection metric


# Most specific first is not needed: the domain classes do not subclass each other.
TABLE: dict[type[errors.GatewayError], ErrorRow] = {
    errors.Unauthenticated: ErrorRow("UNAUTHENTICATED", "unauthenticated"),
    errors.PermissionDenied: ErrorRow("PERMISSION_DENIED", "permission_denied"),
    errors.InvalidArgument: ErrorRow("INVALID_ARGUMENT", "invalid_argument"),
    errors.QuotaExceeded: ErrorRow("RESOURCE_EXHAUSTED", "quota"),
    errors.Unavailable: ErrorRow("UNAVAILABLE", "unavailable"),
    errors.DeadlineExceeded: ErrorRow("DEADLINE_EXCEEDED", "deadline"),
    errors.Cancelled: ErrorRow("CANCELLED", "cancelled"),
    errors.NotFound: ErrorRow("NOT_FOUND", "not_found"),
    errors.Internal: ErrorRow("INTERNAL", "internal"),
}
INTERNAL = TABLE[errors.Internal]


def row_of(error: BaseException) -> ErrorRow:
    """The table row for `error`; anything that is not a domain error is INTERNAL."""
    for klass in type(error).__mro__:
        row = TABLE.get(klass)
        if row is not None:
            return row
    return INTERNAL


class LogBudget:
    """Counts log entries per window of `window_s`: whoever can trigger a bug must not be
    able to flood the log with its tracebacks, so only the first entries of a window are
    written in full (incident numbers are consecutive: the gap shows how many were not)."""

    def __init__(self, per_window: int, window_s: float, clock: Clock) -> None:
        self.per_window = per_window
        self._window_s = window_s
        self._clock = clock
        self._start = -math.inf
        self._taken = 0

    def take(self) -> int:
        """This entry's position in the current window (1 for the first)."""
        now = self._clock.now()
        if now - self._start >= self._window_s:
            self._start, self._taken = now, 0
        self._taken += 1
        return self._taken


_tracebacks = LogBudget(per_window=10, window_s=60.0, clock=MonotonicClock())
_incidents = itertools.count(1)


def public_message(error: BaseException, row: ErrorRow) -> str:
    """What the caller may read of `error` (every front end shows this text)."""
    if row is INTERNAL:
        incident = next(_incidents)
        # The cause goes to the log only: it may name files, hosts or upstream internals.
        taken = _tracebacks.take()
        if taken <= _tracebacks.per_window:
            log.error("internal error (incident %d): %r", incident, error, exc_info=error)
        elif taken == _tracebacks.per_window + 1:
            log.error(
                "internal error (incident %d): more than %d this minute; not logged until the next",
                incident,
                _tracebacks.per_window,
            )
        return f"{INTERNAL_MESSAGE} (incident {incident})"
    return bounded(error.message)  # type: ignore[attr-defined]


def bounded(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS."""
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."
