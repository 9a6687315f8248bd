"""The one table of domain errors: each error class's status code and rejection reason.

Transport-free (code names are gRPC's, as text), so the data plane labels its metrics and
spans by it; `services.status` turns a row into a gRPC status, `openai_api.errors` into an
HTTP response.
"""

from __future__ import annotations

from dataclasses import dataclass

from qosgate import errors


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
