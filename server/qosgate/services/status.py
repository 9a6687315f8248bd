"""The one table that turns domain errors into gRPC statuses.

Every servicer reports failures through `to_status` (or `stream_error_message` inside a
KServe stream), so a caller sees the same code and the same details for the same cause
whichever RPC it used. RESOURCE_EXHAUSTED carries `google.rpc.RetryInfo` and
`google.rpc.QuotaFailure`, UNAVAILABLE carries `RetryInfo` when the domain knows when to
retry; both travel in the `grpc-status-details-bin` trailer that grpcio-status decodes.
INTERNAL never shows the cause to the caller: it is logged with an incident number that
the caller does see, so an operator can find it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from qosgate import error_table, errors
from qosgate.clock import Clock, MonotonicClock
from qosgate.services.infer_wire import len_field, varint_field

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error"
# Messages quote what the caller sent (a model name, a URL): bounded, so that a huge value
# cannot make the status trailer exceed what a client accepts (8 KiB by default in gRPC).
MAX_MESSAGE_CHARS = 1024


@dataclass(frozen=True, slots=True)
class StatusRow:
    """How one domain error class appears on the wire, and why it counts as a rejection."""

    code: grpc.StatusCode
    reason: str  # the `reason` label of the rejection metric


# The grpc form of the one table (`qosgate.error_table`), row by row.
TABLE: dict[type[errors.GatewayError], StatusRow] = {
    klass: StatusRow(grpc.StatusCode[row.code], row.reason) for klass, row in error_table.TABLE.items()
}

_INTERNAL_ROW = TABLE[errors.Internal]
_incidents = itertools.count(1)


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


def row_of(error: BaseException) -> StatusRow:
    """The table row for `error`; anything that is not a domain error is INTERNAL."""
    for klass in type(error).__mro__:
        row = TABLE.get(klass)
        if row is not None:
            return row
    return _INTERNAL_ROW


# google.rpc.Status.details, Any's fields, RetryInfo.retry_delay, Duration's fields.
_DETAILS = 3
_TYPE_URL, _VALUE = 1, 2
_RETRY_DELAY = 1
_SECONDS, _NANOS = 1, 2
_RETRY_INFO_TYPE_URL = len_field(_TYPE_URL, b"type.googleapis.com/" + error_details_pb2.RetryInfo.DESCRIPTOR.full_name.encode())


def _retry_info_head(size: int) -> bytes:
    """What precedes a Duration of `size` bytes in a RetryInfo details entry (it depends
    on the size alone)."""
    entry = len_field(_DETAILS, _RETRY_INFO_TYPE_URL + len_field(_VALUE, len_field(_RETRY_DELAY, bytes(size))))
    return entry[: len(entry) - size]


# google.protobuf.Duration's largest value (10,000 years): a longer wait is sent as it.
_MAX_DURATION_S = 315_576_000_000
_MAX_DURATION_BYTES = len(varint_field(_SECONDS, _MAX_DURATION_S - 1) + varint_field(_NANOS, 999_999_999))
_RETRY_INFO_HEADS = [_retry_info_head(size) for size in range(_MAX_DURATION_BYTES + 1)]


def _retry_info_detail(seconds: float) -> bytes:
    """A Status's details entry: Any(RetryInfo(retry_delay=`seconds`)), encoded directly
    (it differs in every refusal; the protobuf runtime would build three messages for it)."""
    # Round up: retrying a little late succeeds, retrying early is refused again.
    whole, micros = divmod(max(0, math.ceil(seconds * 1_000_000)), 1_000_000)
    if whole >= _MAX_DURATION_S:
        whole, micros = _MAX_DURATION_S, 0
    delay = (varint_field(_SECONDS, whole) if whole else b"") + (varint_field(_NANOS, micros * 1000) if micros else b"")
    return _RETRY_INFO_HEADS[len(delay)] + delay


@functools.lru_cache(maxsize=1024)
def _fixed_parts(code: int, message: str, violations: tuple[errors.QuotaViolation, ...] | None) -> tuple[bytes, bytes]:
    """The serialized Status fields that repeat from one refusal to the next: code and
    message (fields 1, 2), and the QuotaFailure details entry (empty without violations)."""
    head = status_pb2.Status(code=code, message=message).SerializeToString()
    if violations is None:
        return head, b""
    failure = error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject=v.subject, description=v.description) for v in violations]
    )
    detail = any_pb2.Any()
    detail.Pack(failure)
    return head, status_pb2.Status(details=[detail]).SerializeToString()


def public_message(error: BaseException, row: StatusRow) -> str:
    """What the caller may read of `error` (every front end shows this text)."""
    if row is _INTERNAL_ROW:
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


def status_bytes(error: BaseException) -> tuple[int, str, bytes]:
    """`error`'s code, public message, and google.rpc.Status serialized (details: RetryInfo
    when it says when to retry, then QuotaFailure for a quota). Fields are written in number
    order, so the bytes are the protobuf runtime's own; the parts that repeat are cached, so a
    tenant retrying a refused call in a loop costs little to answer."""
    row = row_of(error)
    code = row.code.value[0]
    message = public_message(error, row)
    violations = error.violations if isinstance(error, errors.QuotaExceeded) else None
    # An INTERNAL message names its incident: it never repeats, so it is not cached.
    fixed = _fixed_parts.__wrapped__ if row is _INTERNAL_ROW else _fixed_parts
    head, quota = fixed(code, message, violations)
    retry_after = getattr(error, "retry_after_s", None)
    retry = b"" if retry_after is None else _retry_info_detail(retry_after)
    return code, message, head + retry + quota


def to_rich_status(error: BaseException) -> status_pb2.Status:
    """The google.rpc.Status for `error`, details included."""
    return status_pb2.Status.FromString(status_bytes(error)[2])


def to_status(error: BaseException) -> grpc.Status:
    """A grpc.Status (code, details text, trailing metadata with the rich status)."""
    return rpc_status.to_status(to_rich_status(error))


def stream_error_message(error: BaseException) -> str:
    """The `error_message` of an in-band ModelStreamInferResponse.

    KServe streams report a failed request inside the stream and keep it open, so the code
    cannot travel as a status: it leads the text instead ("RESOURCE_EXHAUSTED: ...").
    """
    rich = to_rich_status(error)
    return f"{code_pb2.Code.Name(rich.code)}: {rich.message}"


async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with `error`'s status; never returns (raises grpc's abort exception)."""
    status = to_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
