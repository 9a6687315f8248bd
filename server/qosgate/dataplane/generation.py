"""The generation API's domain: prompt in, text deltas and usage out, free of any transport.

One call (decoded by its front end, its caller identified by the edge) is rendered (chat
template) and costed (the prompt estimate + max_tokens), then goes through the edge
(class, deadline, authorize, daily budget, admission, the same per-model dispatch window
as KServe traffic, the route: prefix affinity keys on the rendered prompt), streams from
Triton through the model's adapter, and is accounted with the tokens the
engine really counted: usage written, daily reservation settled, permit released, fair
share corrected. That last step runs however the call ends (finished, failed, or
cancelled by the caller), so a cancelled stream frees its window slot and its concurrency
at once, and costs only what was generated before the cancel.
"""

from __future__ import annotations

import contextlib
import math
import re
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tritonclient.grpc import service_pb2

from qosgate import paths
from qosgate.adapters import GenerationAdapter, adapter_for
from qosgate.adapters.chat_template import ChatTemplate
from qosgate.adapters.tokenizer import tokenizer_counter
from qosgate.clock import Clock
from qosgate.config import GatewayConfig, ModelPolicy
from qosgate.dataplane.call import Call, CallEdge, Header
from qosgate.errors import Internal, InvalidArgument
from qosgate.kserve.names import ENGINE_PRIORITY_PARAMETER
from qosgate.generation_types import ChatMessage, FinishReason, GenerationRequest, Sampling, TokenCounts
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.upstream.pool import Route

# The engine matches every stop string against each new token's text: a long list slows
# the step of every request in the batch, not only its own.
MAX_STOP_SEQUENCES = 16

# How Triton words a request whose tensors are not the model's inputs (it checks them before
# the model sees the request): a generation call to a model that is no LLM, such as minilm.
_NOT_ITS_INPUTS = re.compile(r"expected \d+ inputs but got \d+ inputs|unexpected inference input")


@dataclass(frozen=True, slots=True)
class GenerationCall:
    """A generation request as its front end parsed it; None means "not set by the caller"."""

    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = True

    def check(self) -> None:
        """InvalidArgument naming the first field set out of range (what can be judged
        without the model's policy: batch submission checks its items with it too)."""
        if not self.model:
            raise InvalidArgument("model is required")
        if self.messages is None and not self.prompt:
            raise InvalidArgument("set either prompt or chat.messages")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens must be at least 1")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument("sampling.temperature must be a finite number >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidArgument("sampling.top_p must be in (0, 1]")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidArgument(f"sampling.stop: at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidArgument("sampling.stop must not contain empty strings")


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


class EngineStreams(Protocol):
    """Sends one request to Triton on its route and streams its responses
    (ModelStreamInfer); see upstream.engine.Engine. Failures are raised as GatewayErrors."""

    def stream(
        self, route: Route, request: bytes, *, headers: Sequence[Header] = (), timeout_s: float | None = None
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]: ...


class GenerationPlane:
    """Serves generation calls for the models of one config snapshot."""

    def __init__(self, *, config: GatewayConfig, edge: CallEdge, engine: EngineStreams, clock: Clock) -> None:
        self._config = config
        self._edge = edge
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

    async def generate(self, call: Call, generation: GenerationCall) -> AsyncGenerator[str | Finished, None]:
        """Text deltas, then one Finished, for `call` (its model is the generation's; its
        class, deadline, session and trace headers as its front end decoded them).

        Close the iterator when done with it (`contextlib.aclosing`): that is what
        releases the request's slot and quotas when the caller stops early.
        """
        arrived = self._clock.now()
        call.model = generation.model
        async with self._edge.open(call) as scope:
            policy = self._config.model_policy(generation.model)
            request = self._request(generation, policy)
            prompt_estimate = self._prompt_counters.get(generation.model, estimate_prompt_tokens)(request.prompt)
            cost = scope.llm_cost(prompt_estimate, request.sampling.max_tokens)
            adapter = self._adapter(generation.model, policy)
            decoder = adapter.decoder(request, prompt_tokens_estimate=prompt_estimate)
            request_id = uuid.uuid4().hex
            responses = 0
            finished: FinishReason | None = None
            try:
                admitted = await self._edge.admit(scope, call, cost, prompt=request.prompt)
                dispatch = admitted.dispatch
                upstream = adapter.encode(request, request_id=request_id)
                upstream.parameters["priority"].uint64_param = admitted.priority_level
                upstream.parameters[ENGINE_PRIORITY_PARAMETER].int64_param = admitted.priority_level
                if admitted.timeout_us is not None:
                    upstream.parameters["timeout"].int64_param = admitted.timeout_us
                first_token: float | None = None
                # aclosing: when our caller leaves mid-stream, the engine stream must be
                # closed now (cancelling the upstream call), not whenever it is collected.
                stream = self._engine.stream(
                    admitted.route, upstream.SerializeToString(), headers=admitted.trace, timeout_s=scope.timeout_s
                )
                async with contextlib.aclosing(stream):
                    with _generation_model(generation.model, policy.adapter):
                        async for response in stream:
                            responses += 1
                            chunk = decoder.feed(response)
                            if chunk.text:
                                if first_token is None:
                                    first_token = self._clock.now()
                                yield chunk.text
                            if chunk.final:
                                finished = chunk.finish_reason
                                break
                if finished is None:
                    raise Internal(f"Triton ended the stream of request {request_id} before its final response")
                now = self._clock.now()
                result = Finished(
                    finish_reason=finished,
                    usage=decoder.counted(),
                    timing=Timing(
                        queue_s=dispatch.queue_wait_s,
                        first_token_s=(first_token if first_token is not None else now) - arrived,
                        total_s=now - arrived,
                    ),
                )
                with contextlib.suppress(GeneratorExit):
                    # A caller that closes us once it has the result did not cancel: the
                    # call ends here as served.
                    yield result
            finally:
                # However it ended (finished, engine error, caller cancelled), the fair share
                # and the quotas are charged what the engine did, and only that.
                used = decoder.counted()
                reason = finished.value if finished is not None else FinishReason.CANCELLED.value
                scope.settle_tokens(request_id, used.prompt_tokens, used.completion_tokens, reason if responses else None)

    def _request(self, call: GenerationCall, policy: ModelPolicy) -> GenerationRequest:
        call.check()
        if call.messages is not None:
            prompt = self._template(call.model, policy).render(call.messages)
        else:
            assert call.prompt is not None  # check() saw one or the other
            prompt = call.prompt
        max_tokens = policy.default_max_tokens if call.max_tokens is None else call.max_tokens
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


@contextlib.contextmanager
def _generation_model(model: str, adapter: str) -> Iterator[None]:
    """Says what a refusal of the request's inputs means: `model` is not an LLM that takes
    `adapter`'s tensors (Triton's own wording, kept after it, names only the tensors)."""
    try:
        yield
    except InvalidArgument as e:
        if not _NOT_ITS_INPUTS.search(e.message):
            raise
        raise InvalidArgument(
            f"model {model!r} is not a generation model: it does not take the {adapter!r} adapter's "
            f"inputs (its `adapter` in the gateway's config names them); Triton said: {e.message}"
        ) from e
