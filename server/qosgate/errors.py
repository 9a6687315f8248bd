"""Domain errors of the gateway, free of any transport.

The edge (`qosgate.services.status`) owns the one table that turns each of these into a
gRPC status code and status details; domain code only raises or returns them.
"""

from __future__ import annotations

from typing import NamedTuple


class GatewayError(Exception):
    """Base of every error the gateway reports to a caller; `message` is safe to show them."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unauthenticated(GatewayError):
    """No API key, or one that belongs to no tenant."""


class PermissionDenied(GatewayError):
    """The tenant is known but may not use this model, class or RPC."""


class InvalidArgument(GatewayError):
    """The request itself is malformed (e.g. an unknown priority class)."""


class QuotaViolation(NamedTuple):
    """One exceeded limit, in the shape of google.rpc.QuotaFailure.Violation. A tuple: every
    refusal builds one and hashes it (the status details are cached by their violations),
    which a frozen dataclass does in interpreted code."""

    subject: str
    description: str


class QuotaExceeded(GatewayError):
    """A tenant limit refused the request; retrying after `retry_after_s` may succeed."""

    def __init__(
        self, message: str, retry_after_s: float, violations: tuple[QuotaViolation, ...]
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.violations = violations


class Unavailable(GatewayError):
    """Shed under overload, a full queue, or no live upstream; the call may be retried."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(GatewayError):
    """The caller's deadline passed before the request could be served."""


class Cancelled(GatewayError):
    """The caller went away."""


class NotFound(GatewayError):
    """The named model, job or resource does not exist (or is not visible to the tenant)."""


class Internal(GatewayError):
    """A bug or an unexpected upstream failure; the edge shows generic text, logs the detail."""
