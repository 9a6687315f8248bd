"""The generation API's domain: prompt in, text deltas and usage out, free of any transport.

One call (its tenant identified at the edge) goes authorize → render (chat template) → admit (daily budget from the
usage meter; rate, concurrency and tokens_per_minute in Admission, reserving the prompt
estimate + max_tokens) → schedule (the same per-model dispatch window as KServe traffic)
→ stream from Triton through the model's adapter → account: the usage is written to the
meter, then the daily reservation is settled and the permit released with the tokens the
engine really counted. That last step runs however the call ends (finished, failed, or
cancelled by the caller), so a cancelled stream frees its window slot and its concurrency
at once, and costs only what was generated before the cancel.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tritonclient.grpc import service_pb2

from qosgate import paths
from qosgate.adapters import GenerationAdapter, adapter_for
from qosgate.adapters.chat_template import ChatTemplate
from qosgate.adapters.domain import ChatMessage, FinishReason, GenerationRequest, Sampling, TokenCounts
from qosgate.adapters.tokenizer import tokenizer_counter
from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.config import GatewayConfig, ModelPolicy
from qosgate.errors import DeadlineExceeded, Internal, InvalidArgument
from qosgate.quota import Admission, Refused
from qosgate.quota.tokens import DailyTokenBudget, estimate_prompt_tokens
from qosgate.scheduler import Scheduler
from qosgate.scheduler.cost import token_cost
from qosgate.usage import UsageMeter, UsageRecord

# The request parameter our vLLM backend reads as the engine priority (smaller runs
# first); Triton's own `priority` does not reach Python models in Triton 2.51.
ENGINE_PRIORITY_PARAMETER = "vllm_priority"


@dataclass(frozen=True, slots=True)
class GenerationCall:
    """A generation call as the edge parsed it; None means "not set by the caller"."""

    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    priority_class: str | None = None
    stream: bool = True


@dataclass(slots=True)
class CallLabels:
    """Who made a call and how long it queued, filled in as the plane learns it, so the
    edge can label its metrics however the call ends."""

    tenant: str = ""
    klass: str = ""
    queue_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds spent queued in the gateway, to the first text, and in total."""

    queue_s: float
    first_token_s: float
    total_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The last item of a generation: why it ended, what it cost, where the time went."""

    finish_reason: FinishReason
    usage: TokenCounts
    timing: Timing


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What a generation's upstream may be chosen by (`routing: prefix_affinity`)."""

    prompt: str
    """The rendered prompt (chat: the template's rendering of every message)."""
    session: str | None = None
    """The caller's session id, from the model's `session_header`."""


class EngineStreams(Protocol):
    """Opens one request's response stream at Triton (ModelStreamInfer).

    Closing the iterator early (the caller went away) must cancel the upstream call, so
    Triton cancels the request in the engine. Failures are raised as GatewayErrors.
    `route` is what the model's routing policy may key the choice of upstream on.
    """

    def open(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None, route: RouteHint
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]: ...


class GenerationPlane:
    """Serves generation calls for the models of one config snapshot."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        directory: TenantDirectory,
        admission: Admission,
        budget: DailyTokenBudget,
        scheduler: Scheduler,
        usage: UsageMeter,
        engine: EngineStreams,
        clock: Clock,
    ) -> None:
        self._config = config
        self._directory = directory
        self._admission = admission
        self._budget = budget
        self._scheduler = scheduler
        self._usage = usage
        self._engine = engine
        self._clock = clock
        self._templates: dict[str, ChatTemplate] = {}
        self._adapters: dict[str, GenerationAdapter] = {}
        # Loaded now, so a missing tokenizer stops the gateway at start, not a request.
        self._prompt_counters: dict[str, Callable[[str], int]] = {
            model: tokenizer_counter(policy.tokenizer, paths.hf_home())
            for model, policy in config.models.items()
            if policy.tokenizer is not None
        }

    async def generate(
        self,
        tenant: Tenant,
        call: GenerationCall,
        *,
        deadline: float | None = None,
        labels: CallLabels | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[str | Finished, None]:
        """Text deltas, then one Finished, for `tenant` (identified by the edge, or the
        job's tenant when the batch runner calls). `deadline` is on the plane's clock;
        `headers` are the call's request headers, where the model's routing
        `session_header` is looked up.

        Close the iterator when done with it (`contextlib.aclosing`): that is what
        releases the request's slot and quotas when the caller stops early.
        """
        arrived = self._clock.now()
        labels = labels if labels is not None else CallLabels()
        labels.tenant = tenant.name
        self._directory.require_model(tenant, call.model)
        klass = labels.klass = self._directory.resolve_class(tenant, call.priority_class or None)
        policy = self._config.model_policy(call.model)
        request = self._request(call, policy)
        header = policy.routing.session_header
        route = RouteHint(request.prompt, headers.get(header) if headers and header else None)
        prompt_estimate = self._prompt_counters.get(call.model, estimate_prompt_tokens)(request.prompt)
        cost = prompt_estimate + request.sampling.max_tokens

        reservation = await self._budget.reserve(tenant, cost)
        if isinstance(reservation, Refused):
            raise reservation.error()
        try:
            verdict = await self._admission.admit(tenant, cost_tokens=cost)
        except BaseException:  # quota store unreachable (Unavailable) or cancelled
            self._budget.settle(reservation)
            raise
        if isinstance(verdict, Refused):
            self._budget.settle(reservation)
            raise verdict.error()

        adapter = self._adapter(call.model, policy)
        decoder = adapter.decoder(request, prompt_tokens_estimate=prompt_estimate)
        request_id = uuid.uuid4().hex
        responses = 0
        finished: FinishReason | None = None
        weight = self._config.scheduler.output_token_weight
        try:
            async with self._scheduler.slot(
                tenant=tenant,
                klass=klass,
                model=call.model,
                deadline=deadline,
                cost=token_cost(prompt_estimate, request.sampling.max_tokens, weight),
                tokens=cost,
            ) as dispatch:
                labels.queue_wait_s = dispatch.queue_wait_s
                upstream = adapter.encode(request, request_id=request_id)
                upstream.parameters["priority"].uint64_param = dispatch.priority_level
                upstream.parameters[ENGINE_PRIORITY_PARAMETER].int64_param = dispatch.priority_level
                timeout_s = self._timeout(deadline, upstream)
                first_token: float | None = None
                # aclosing: when our caller leaves mid-stream, the engine stream must be
                # closed now (cancelling the upstream call), not whenever it is collected.
                try:
                    async with contextlib.aclosing(self._engine.open(upstream, timeout_s, route)) as stream:
                        async for response in stream:
                            responses += 1
                            dispatch.responded()
                            chunk = decoder.feed(response)
                            if chunk.text:
                                if first_token is None:
                                    first_token = self._clock.now()
                                yield chunk.text
                            if chunk.final:
                                finished = chunk.finish_reason
                                break
                finally:
                    # The fair share is charged what the engine did, however it ended.
                    counted = decoder.counted() if responses else TokenCounts(0, 0)
                    dispatch.settle(token_cost(counted.prompt_tokens, counted.completion_tokens, weight))
                if finished is None:
                    raise Internal(f"Triton ended the stream of request {request_id} before its final response")
            now = self._clock.now()
            yield Finished(
                finish_reason=finished,
                usage=decoder.counted(),
                timing=Timing(
                    queue_s=dispatch.queue_wait_s,
                    first_token_s=(first_token if first_token is not None else now) - arrived,
                    total_s=now - arrived,
                ),
            )
        finally:
            # Whatever happened (finished, engine error, caller cancelled): account for
            # what the engine did, then free the reservation and the permit.
            used = decoder.counted() if responses else TokenCounts(0, 0)
            try:
                if responses:
                    reason = finished.value if finished is not None else FinishReason.CANCELLED.value
                    await self._usage.record(
                        UsageRecord(
                            tenant.name, call.model, request_id, used.prompt_tokens, used.completion_tokens, reason
                        )
                    )
            finally:  # a meter that cannot write must not leak the tenant's slot and tokens
                self._budget.settle(reservation)
                await verdict.permit.release(actual_tokens=used.total)

    def _request(self, call: GenerationCall, policy: ModelPolicy) -> GenerationRequest:
        if not call.model:
            raise InvalidArgument("model is required")
        if call.messages is not None:
            prompt = self._template(call.model, policy).render(call.messages)
        elif call.prompt:
            prompt = call.prompt
        else:
            raise InvalidArgument("set either prompt or chat.messages")
        max_tokens = policy.default_max_tokens if call.max_tokens is None else call.max_tokens
        if max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens must be at least 1")
        if call.temperature is not None and call.temperature < 0:
            raise InvalidArgument("sampling.temperature must be >= 0")
        if call.top_p is not None and not 0 < call.top_p <= 1:
            raise InvalidArgument("sampling.top_p must be in (0, 1]")
        if any(not s for s in call.stop):
            raise InvalidArgument("sampling.stop must not contain empty strings")
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=policy.default_temperature if call.temperature is None else call.temperature,
            top_p=policy.default_top_p if call.top_p is None else call.top_p,
            top_k=call.top_k,
            seed=call.seed,
            stop=call.stop,
        )
        return GenerationRequest(model=call.model, prompt=prompt, sampling=sampling, stream=call.stream)

    def _template(self, model: str, policy: ModelPolicy) -> ChatTemplate:
        template = self._templates.get(model)
        if template is None:
            template = self._templates[model] = ChatTemplate(policy.chat_template)
        return template

    def _adapter(self, model: str, policy: ModelPolicy) -> GenerationAdapter:
        adapter = self._adapters.get(model)
        if adapter is None:
            adapter = self._adapters[model] = adapter_for(policy.adapter)
        return adapter

    def _timeout(self, deadline: float | None, request: service_pb2.ModelInferRequest) -> float | None:
        if deadline is None:
            return None
        remaining = deadline - self._clock.now()
        if remaining <= 0:
            raise DeadlineExceeded("deadline passed before dispatch to Triton")
        request.parameters["timeout"].int64_param = int(remaining * 1_000_000)
        return remaining
