"""The HTTP form of the one error table, row by row."""

from __future__ import annotations

import pytest

from qosgate import error_table, errors
from qosgate.auth import TenantDirectory
from qosgate.config import parse_config
from qosgate.openai_api.errors import HTTP_BY_REASON, http_error

ROWS = [
    (errors.Unauthenticated("invalid API key"), 401, "authentication_error"),
    (errors.PermissionDenied("no"), 403, "permission_error"),
    (errors.InvalidArgument("bad"), 400, "invalid_request_error"),
    (
        errors.QuotaExceeded("quota exceeded", 2.5, (errors.QuotaViolation("tenant:t", "requests_per_second limit 1"),)),
        429,
        "rate_limit_error",
    ),
    (errors.Unavailable("shed", retry_after_s=1.0), 503, "service_unavailable"),
    (errors.DeadlineExceeded("late"), 504, "timeout"),
    (errors.Cancelled("gone"), 499, "cancelled"),
    (errors.NotFound("no batch"), 404, "not_found_error"),
]


def test_every_row_of_the_grpc_table_has_an_http_form() -> None:
    assert {row.reason for row in error_table.TABLE.values()} == set(HTTP_BY_REASON)


@pytest.mark.parametrize(("error", "code", "kind"), ROWS, ids=lambda v: type(v).__name__)
def test_row(error: errors.GatewayError, code: int, kind: str) -> None:
    response = http_error(error)
    assert response.status == code
    assert response.body["error"]["type"] == kind
    assert response.body["error"]["message"] == error.message
    assert response.body["error"]["code"] == error_table.row_of(error).reason


def test_internal_shows_an_incident_not_the_cause() -> None:
    response = http_error(RuntimeError("/etc/secret host db-7 failed"))
    assert response.status == 500
    assert "secret" not in response.body["error"]["message"]
    assert response.body["error"]["message"].startswith(error_table.INTERNAL_MESSAGE)


def test_retry_after_rounds_up_and_quota_names_its_limits() -> None:
    config = parse_config(
        {"tenants": [{"name": "t", "limits": {"requests_per_second": 2, "tokens_per_minute": 600}}]}
    )
    tenant = TenantDirectory(config).tenants[0]
    error = errors.QuotaExceeded(
        "quota exceeded", 2.01, (errors.QuotaViolation("tenant:t", "tokens_per_minute limit 600 exceeded"),)
    )
    headers = http_error(error, tenant).headers
    assert headers["retry-after"] == "3" and headers["retry-after-ms"] == "2010"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "2.010s"
    assert "x-ratelimit-remaining-requests" not in headers
    assert headers["x-ratelimit-limit-tokens"] == "600" and headers["x-ratelimit-limit-requests"] == "120"
    shed = http_error(errors.Unavailable("shed", retry_after_s=0.2)).headers
    assert shed == {"retry-after": "1", "retry-after-ms": "200"}
