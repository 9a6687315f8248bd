"""The one request path: every inference call of every API goes through a `CallScope`.

    scope = plane.open(rpc, tenant, model, headers)      span starts, labels known so far
    await scope.admit(CallCost(...), priority_class=..., deadline=...)
        authorize (model, class) → daily budget → admission (rate, concurrency, tokens)
        → scheduler slot (queue span) → remaining deadline → upstream timeout
    scope.upstream_started(name) / upstream_finished()   latency metric, upstream span
    scope.responded()                                    window latency sample, first-token span
    scope.settle_tokens(...)                             an LLM call's real cost and usage
    await scope.close(error)                             release slot, usage, budget, permit;
                                                         metrics and span by the error table
                                                         (`async with` the scope closes it)

Each attempt at an upstream (a failover makes two) is one `upstream_started` ..
`upstream_finished`; the engine calls them (the scope is its upstream.engine
.UpstreamObserver) and sends `upstream_headers()` (the W3C trace context) to Triton.

`close` runs once however the call ended (returned, refused, failed upstream, cancelled),
and is where every API's request, rejection and queue metrics are recorded, so they cannot
drift apart between front ends. In-process callers use the scope as an async context
manager, which closes it with the exception that left the block; a front end whose call
ends in a callback (the HTTP/2 relay's `on_finish`) calls `close_now` itself.

No transport here: a refusal is raised as a GatewayError, and the front end's error
wrapper turns it into its status (gRPC) or HTTP response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace

from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.dataplane.tracing import Tracing
from qosgate.error_table import row_of
from qosgate.errors import DeadlineExceeded, GatewayError
from qosgate.metrics import GatewayMetrics
from qosgate.quota import Admission, Refused
from qosgate.quota.tokens import BudgetReservation, DailyTokenBudget
from qosgate.quota.verdict import Permit
from qosgate.scheduler import Dispatch, Scheduler, Slot
from qosgate.scheduler.cost import token_cost
from qosgate.usage import UsageMeter, UsageRecord

OK = "OK"
CANCELLED = "CANCELLED"


@dataclass(slots=True, init=False)
class CallCost:
    """What a call costs: `fair_share` in the scheduler's unit (weighted tokens for an
    LLM, the model's cost_unit otherwise); `tokens` the LLM tokens reserved against the
    tenant's tokens_per_minute, daily budget and in-flight tokens (0 for other models)."""

    fair_share: float
    tokens: int

    # Written out (init=False) here and in CallLabels, built on every call: the `__init__`
    # that `dataclasses` generates is interpreted even in a compiled module.
    def __init__(self, fair_share: float = 1.0, tokens: int = 0) -> None:
        self.fair_share = fair_share
        self.tokens = tokens


@dataclass(slots=True, init=False)
class CallLabels:
    """The one label carrier: who made a call, of what, and how it ended, filled in as the
    plane learns it, so metrics and the span are labelled the same however the call ends."""

    rpc: str
    tenant: str
    model: str
    klass: str
    code: str

    def __init__(self, rpc: str, tenant: str = "", model: str = "", klass: str = "", code: str = OK) -> None:
        self.rpc = rpc
        self.tenant = tenant
        self.model = model
        self.klass = klass
        self.code = code


class DataPlane:
    """Authorize, admit, schedule, account and observe calls (see the module docstring)."""

    def __init__(
        self,
        *,
        directory: TenantDirectory,
        admission: Admission,
        budget: DailyTokenBudget,
        scheduler: Scheduler,
        usage: UsageMeter,
        metrics: GatewayMetrics,
        tracing: Tracing,
        clock: Clock,
        output_token_weight: float,
    ) -> None:
        self.directory = directory
        self.admission = admission
        self.budget = budget
        self.scheduler = scheduler
        self.usage = usage
        self.metrics = metrics
        self.tracing = tracing
        self.clock = clock
        # An LLM call's fair-share cost: prompt + this x generated tokens (SchedulerConfig).
        self.output_token_weight = output_token_weight

    def open(
        self, rpc: str, tenant: Tenant, model: str, headers: Mapping[str, str] | None = None
    ) -> CallScope:
        """A call of `rpc` (the API and method, the `rpc` metric label) by `tenant` for
        `model`; `headers` may carry the caller's W3C `traceparent`. Close it (`async with`
        does, with whatever ends the block: nothing, an error, a cancel)."""
        return CallScope(self, CallLabels(rpc, tenant.name, model), tenant, headers)

    def deadline(self, remaining_s: float | None) -> float | None:
        """A caller's remaining seconds (gRPC `time_remaining`) as a deadline on our clock."""
        return None if remaining_s is None else self.clock.now() + remaining_s


class CallScope:
    """One call on its way through the plane; implements upstream.engine.UpstreamObserver."""

    __slots__ = (
        "_budget_reservation",
        "_dispatch",
        "_first_token_span",
        "_plane",
        "_permit",
        "_slot",
        "_upstream",
        "_upstream_span",
        "_upstream_started",
        "_usage",
        "_actual_tokens",
        "_closed",
        "_responded",
        "_traced",
        "deadline",
        "labels",
        "span",
        "tenant",
        "timeout_s",
    )

    def __init__(
        self, plane: DataPlane, labels: CallLabels, tenant: Tenant, headers: Mapping[str, str] | None
    ) -> None:
        self._plane = plane
        self.labels = labels
        self.tenant = tenant
        self.span = plane.tracing.call_span(labels.rpc, tenant.name, labels.model, headers)
        # With tracing off, no span work at all (a caller's context still goes upstream).
        self._traced = plane.tracing.enabled
        self.deadline: float | None = None
        self.timeout_s: float | None = None
        self._budget_reservation: BudgetReservation | None = None
        self._permit: Permit | None = None
        self._slot: Slot | None = None
        self._dispatch: Dispatch | None = None
        self._upstream = ""
        self._upstream_started: float | None = None
        self._upstream_span: trace.Span | None = None
        self._first_token_span: trace.Span | None = None
        self._usage: UsageRecord | None = None
        self._actual_tokens: int | None = None
        self._closed = False
        self._responded = False

    async def __aenter__(self) -> CallScope:
        return self

    async def __aexit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        await self.close(error)

    # -- admission and scheduling ---------------------------------------------------------

    async def admit(
        self, cost: CallCost, *, priority_class: str | None, deadline: float | None
    ) -> Dispatch:
        """Authorize, admit and wait for a dispatch slot; raises the refusal as a
        GatewayError. `deadline` is on the plane's clock; on return `timeout_s` holds the
        seconds left for the upstream call (None: no deadline)."""
        plane, tenant, labels = self._plane, self.tenant, self.labels
        plane.directory.require_model(tenant, labels.model)
        klass = labels.klass = plane.directory.resolve_class(tenant, priority_class or None)
        if self._traced:
            self.span.set_attribute("qosgate.class", klass)
        if cost.tokens:
            reservation = await plane.budget.reserve(tenant, cost.tokens)
            if isinstance(reservation, Refused):
                raise reservation.error()
            self._budget_reservation = reservation
        admission = plane.admission
        verdict = admission.admit_now(tenant, cost_tokens=cost.tokens)
        if verdict is None:  # a shared quota store: its answer comes over the network
            verdict = await admission.admit(tenant, cost_tokens=cost.tokens)
        if isinstance(verdict, Refused):
            raise verdict.error()
        self._permit = verdict.permit
        self.deadline = deadline
        slot = plane.scheduler.slot(
            tenant=tenant, klass=klass, model=labels.model, deadline=deadline, cost=cost.fair_share, tokens=cost.tokens
        )
        queued = plane.tracing.child(self.span, "queue") if self._traced else None
        try:
            dispatch = slot.enter_now()
            if dispatch is None:
                dispatch = await slot.wait()
        finally:
            if queued is not None:
                queued.end()
        self._slot, self._dispatch = slot, dispatch
        plane.metrics.queue_wait(klass, tenant.name, dispatch.queue_wait_s)
        if deadline is not None:
            remaining = deadline - plane.clock.now()
            if remaining <= 0:
                raise DeadlineExceeded("deadline passed before dispatch to Triton")
            self.timeout_s = remaining
        return dispatch

    @property
    def timeout_us(self) -> int | None:
        """The upstream timeout in microseconds (Triton's `timeout` parameter)."""
        return None if self.timeout_s is None else int(self.timeout_s * 1_000_000)

    def free_slot(self) -> None:
        """Give the dispatch slot back before the call ends (a KServe stream whose caller
        stopped reading must not hold the model's window). Idempotent."""
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    # -- upstream (UpstreamObserver) -------------------------------------------------------

    def upstream_started(self, upstream: str) -> None:
        self._upstream = upstream
        self._upstream_started = time.perf_counter()
        if self._traced:
            tracing = self._plane.tracing
            self._upstream_span = tracing.child(self.span, "upstream", {"qosgate.upstream": upstream})
            self._first_token_span = tracing.child(self.span, "first_token")

    def upstream_finished(self) -> None:
        started, self._upstream_started = self._upstream_started, None
        if started is not None:
            self._plane.metrics.upstream_latency(self._upstream, self.labels.model, time.perf_counter() - started)
        for span in (self._first_token_span, self._upstream_span):
            if span is not None:
                span.end()
        self._first_token_span = self._upstream_span = None

    def upstream_headers(self) -> Sequence[tuple[str, str]]:
        if self.span is trace.INVALID_SPAN:  # tracing off, and the caller sent no context
            return ()
        upstream_span = self._upstream_span
        return self._plane.tracing.headers(upstream_span if upstream_span is not None else self.span, self.span)

    def responded(self) -> None:
        """A response came from the engine: the first is a latency sample for an `auto`
        window, names the model in metric labels (it exists) and ends the first-token span."""
        if self._responded:
            return
        self._responded = True
        if self._dispatch is not None:
            self._dispatch.responded()
        self._plane.metrics.model_served(self.labels.model)
        span, self._first_token_span = self._first_token_span, None
        if span is not None:
            span.end()

    # -- accounting --------------------------------------------------------------------------

    def llm_cost(self, prompt_tokens: int, max_tokens: int) -> CallCost:
        """An LLM call's cost at admission: its prompt and all of max_tokens, reserved
        against the tenant's token quotas until `settle_tokens` says what it used."""
        weight = self._plane.output_token_weight
        return CallCost(token_cost(prompt_tokens, max_tokens, weight), prompt_tokens + max_tokens)

    def settle_tokens(
        self, request_id: str, prompt_tokens: int, completion_tokens: int, finish_reason: str | None
    ) -> None:
        """What an LLM call really used: its fair-share cost corrected, its token
        reservation settled, and a usage record written at `close`. `finish_reason` None:
        the engine answered nothing, so nothing is charged or recorded."""
        if finish_reason is None:
            prompt_tokens = completion_tokens = 0
        else:
            self._usage = UsageRecord(
                self.tenant.name, self.labels.model, request_id, prompt_tokens, completion_tokens, finish_reason
            )
        if self._dispatch is not None:
            self._dispatch.settle(token_cost(prompt_tokens, completion_tokens, self._plane.output_token_weight))
        self._actual_tokens = prompt_tokens + completion_tokens

    # -- the end -------------------------------------------------------------------------------

    async def close(self, error: BaseException | None) -> None:
        """End the call: release what it holds and record it, its code by the error table."""
        pending = self.end(error)
        if pending is not None:
            await pending

    def end(self, error: BaseException | None) -> Awaitable[None] | None:
        """`close`, begun at once (see `close_now`)."""
        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            code = CANCELLED
        elif error is not None:
            code = row_of(error).code
        else:
            code = OK
        return self.close_now(code, error)

    async def close_with_code(self, code: str, error: BaseException | None = None) -> None:
        """`close` for a front end that knows the call's status code rather than an error
        (the relay: Triton's code, "UPSTREAM_ERROR" for an in-band stream error)."""
        pending = self.close_now(code, error)
        if pending is not None:
            await pending

    def close_now(self, code: str, error: BaseException | None = None) -> Awaitable[None] | None:
        """`close_with_code`, begun at once: None once it is done, else what is left to
        await (a usage record to write, a shared quota store's answer). The relay closes a
        call in a protocol callback, without a coroutine where nothing waits."""
        if self._closed:
            return None
        self._closed = True
        self.labels.code = code
        self.upstream_finished()  # a call cancelled mid-upstream
        self.free_slot()
        if self._usage is not None:
            return self._record_and_settle(self._usage, error)
        return self._settle(error)

    async def _record_and_settle(self, usage: UsageRecord, error: BaseException | None) -> None:
        # The usage is in the ledger before the day's budget reservation is settled, so the
        # budget never undercounts. A meter that cannot write must not leak the tenant's
        # slot and tokens. (No await in a `finally` here: mypyc-compiled, one re-raised an
        # exception being handled.)
        plane, labels = self._plane, self.labels
        plane.metrics.tokens(labels.model, labels.tenant, usage.prompt_tokens, usage.completion_tokens)
        failed: BaseException | None = None
        try:
            await plane.usage.record(usage)
        except BaseException as e:
            failed = e
        pending = self._settle(error)
        if pending is not None:
            await pending
        if failed is not None:
            raise failed

    def _settle(self, error: BaseException | None) -> Awaitable[None] | None:
        """Settle the budget reservation, free the permit, count the call and end its span;
        what is left to await of the permit's release (a shared quota store), if anything."""
        plane, labels = self._plane, self.labels
        if self._budget_reservation is not None:
            plane.budget.settle(self._budget_reservation)
        pending = self._permit.release_now(self._actual_tokens) if self._permit is not None else None
        if isinstance(error, GatewayError):
            plane.metrics.rejected(row_of(error).reason, labels.tenant, labels.klass)
        plane.metrics.request_done(labels.rpc, labels.model, labels.tenant, labels.klass, labels.code)
        if self._traced:
            plane.tracing.end_call(self.span, labels.code, error)
        return pending
