"""Domain errors as OpenAI error JSON with the matching HTTP status.

The classification is the one error table's (`error_table.row_of`): a domain error finds
its row there, and this table only says how each row's `reason` looks over HTTP. So both
APIs report the same cause the same way, and a new domain error class added to the one
table must be given an HTTP form here (a unit test checks every row has one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qosgate import error_table, errors
from qosgate.auth import Tenant


@dataclass(frozen=True, slots=True)
class HttpRow:
    """How one row of the error table appears over HTTP: status and OpenAI error type."""

    status: int
    type: str


HTTP_BY_REASON: dict[str, HttpRow] = {
    "unauthenticated": HttpRow(401, "authentication_error"),
    "permission_denied": HttpRow(403, "permission_error"),
    "invalid_argument": HttpRow(400, "invalid_request_error"),
    "quota": HttpRow(429, "rate_limit_error"),
    "unavailable": HttpRow(503, "service_unavailable"),
    "deadline": HttpRow(504, "timeout"),
    # nginx's "client closed request": the caller is gone and reads no body.
    "cancelled": HttpRow(499, "cancelled"),
    "not_found": HttpRow(404, "not_found_error"),
    "internal": HttpRow(500, "server_error"),
}


@dataclass(frozen=True, slots=True)
class HttpError:
    """An error response: status, headers and the JSON body."""

    status: int
    headers: dict[str, str]
    body: dict[str, Any]


def http_error(error: BaseException, tenant: Tenant | None = None) -> HttpError:
    """The response for `error`; `tenant` (when known) fills the x-ratelimit-limit headers
    of a 429."""
    row = error_table.row_of(error)
    http = HTTP_BY_REASON[row.reason]
    headers: dict[str, str] = {}
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        # Whole seconds (the header's grammar), rounded up: retrying early is refused
        # again; the SDKs prefer the exact retry-after-ms when it is there.
        headers["retry-after"] = str(max(1, math.ceil(retry_after)))
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after * 1000)))
    if isinstance(error, errors.QuotaExceeded):
        headers.update(_rate_limit_headers(error, tenant))
    body = {
        "error": {
            "message": error_table.public_message(error, row),
            "type": http.type,
            "param": None,
            "code": row.reason,
        }
    }
    return HttpError(http.status, headers, body)


def _rate_limit_headers(error: errors.QuotaExceeded, tenant: Tenant | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits that refused the request: remaining 0
    and the reset time; the limit itself when the tenant is known."""
    headers: dict[str, str] = {}
    reset = f"{error.retry_after_s:.3f}s"
    for violation in error.violations:
        # Token limits (tokens_per_minute, daily_token_budget) name tokens; the rest
        # (request rate, concurrency) count requests.
        kind = "tokens" if "token" in violation.description else "requests"
        headers[f"x-ratelimit-remaining-{kind}"] = "0"
        headers[f"x-ratelimit-reset-{kind}"] = reset
    if tenant is not None:
        limits = tenant.limits
        if limits.requests_per_second is not None:
            headers["x-ratelimit-limit-requests"] = str(math.floor(limits.requests_per_second * 60))
        if limits.tokens_per_minute is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
    return headers
