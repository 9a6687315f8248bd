"""The embedding API's domain: texts in, vectors out, through the same admission and
scheduler as every other request, free of any transport.

One call is one ModelInfer with the texts as a batch of the model's `text` input; the
model's `embedding` output comes back as one FP32 row per text. Embedding calls cost no
LLM tokens: admission counts them as requests (rate, concurrency) only, and the fair
share counts the model's `cost_unit` (per call, per text or per byte of text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tritonclient.grpc import service_pb2

from qosgate.adapters.tensors import TensorReader, TensorWriter
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.dataplane.call import Call, CallEdge, Header
from qosgate.dataplane.plane import CallCost
from qosgate.errors import Internal, InvalidArgument
from qosgate.scheduler.cost import unit_cost
from qosgate.upstream.pool import Route

TEXT_INPUT = "text"
EMBEDDING_OUTPUT = "embedding"
# Triton's max_batch_size of the embedding model bounds one call's texts.
MAX_INPUTS = 32


class EngineInfer(Protocol):
    """Sends one ModelInfer to Triton on its route (upstream.engine.Engine); failures are
    raised as GatewayErrors."""

    async def infer(
        self, route: Route, request: bytes, *, headers: Sequence[Header] = (), timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse: ...


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input text, and where the time went (seconds)."""

    vectors: list[list[float]]
    queue_s: float
    total_s: float


class EmbeddingPlane:
    """Serves embedding calls for one config snapshot."""

    def __init__(self, *, config: GatewayConfig, edge: CallEdge, engine: EngineInfer, clock: Clock) -> None:
        self._config = config
        self._edge = edge
        self._engine = engine
        self._clock = clock

    async def embed(self, call: Call, inputs: Sequence[str]) -> Embeddings:
        """Embed `inputs` with `call`'s model, for its caller, at its class, within its
        deadline."""
        arrived = self._clock.now()
        model = call.model
        async with self._edge.open(call) as scope:
            if not model:
                raise InvalidArgument("model is required")
            if not inputs:
                raise InvalidArgument("inputs must not be empty")
            if len(inputs) > MAX_INPUTS:
                raise InvalidArgument(f"at most {MAX_INPUTS} inputs per call, got {len(inputs)}")
            unit = self._config.model_policy(model).cost_unit
            cost = unit_cost(unit, texts=len(inputs), size=sum(len(text.encode()) for text in inputs))
            admitted = await self._edge.admit(scope, call, CallCost(fair_share=cost))
            dispatch = admitted.dispatch
            request = service_pb2.ModelInferRequest(model_name=model)
            TensorWriter(request).strings(TEXT_INPUT, inputs, [len(inputs), 1])
            request.outputs.add().name = EMBEDDING_OUTPUT
            request.parameters["priority"].uint64_param = admitted.priority_level
            if admitted.timeout_us is not None:
                request.parameters["timeout"].int64_param = admitted.timeout_us
            response = await self._engine.infer(
                admitted.route, request.SerializeToString(), headers=admitted.trace, timeout_s=scope.timeout_s
            )
            values = TensorReader(response).numbers(EMBEDDING_OUTPUT)
            if not values or len(values) % len(inputs):
                raise Internal(f"model {model!r} returned no {EMBEDDING_OUTPUT!r} row per input")
        width = len(values) // len(inputs)
        vectors = [[float(v) for v in values[i : i + width]] for i in range(0, len(values), width)]
        return Embeddings(vectors, dispatch.queue_wait_s, self._clock.now() - arrived)
