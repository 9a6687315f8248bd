"""qosgate.v1.AdminService over gRPC: GetUsage from the usage meter.

A tenant reads its own usage; reading another tenant's needs an admin key.
"""

from __future__ import annotations

import grpc

from qosgate import errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.usage import UsageMeter, UsageSummary
from qosgate.v1 import admin_pb2


def _summary(summary: UsageSummary) -> admin_pb2.TokenUsage:
    return admin_pb2.TokenUsage(
        requests=summary.requests,
        prompt_tokens=summary.prompt_tokens,
        completion_tokens=summary.completion_tokens,
    )


class AdminServicer:
    """GetUsage for the caller's tenant, or for any tenant when the caller is an admin
    (served through `edge`)."""

    def __init__(self, directory: TenantDirectory, usage: UsageMeter) -> None:
        self._directory = directory
        self._usage = usage

    def _target(self, caller: Tenant, name: str) -> Tenant:
        if not name or name == caller.name:
            return caller
        self._directory.require_admin(caller, "reading another tenant's usage")
        tenant = self._directory.named(name)
        if tenant is None:
            raise errors.NotFound(f"no tenant named {name!r}")
        return tenant

    async def GetUsage(  # noqa: N802 - gRPC method name
        self, caller: Tenant, request: admin_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetUsageResponse:
        report = await self._usage.report(self._target(caller, request.tenant))
        response = admin_pb2.GetUsageResponse(
            tenant=report.tenant,
            day=report.day,
            today=_summary(report.today),
            this_minute=_summary(report.this_minute),
        )
        if report.daily_token_budget is not None:
            response.daily_token_budget = report.daily_token_budget
        if report.remaining_daily_tokens is not None:
            response.remaining_daily_tokens = report.remaining_daily_tokens
        if report.tokens_per_minute is not None:
            response.tokens_per_minute = report.tokens_per_minute
        return response
