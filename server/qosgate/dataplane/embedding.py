"""The embedding API's domain: texts in, vectors out, through the same admission and
scheduler as every other request, free of any transport.

One call is one ModelInfer with the texts as a batch of the model's `text` input; the
model's `embedding` output comes back as one FP32 row per text. Embedding calls cost no
LLM tokens: admission counts them as requests (rate, concurrency) only, and the fair
share counts the model's `cost_unit` (per call, per text or per byte of text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tritonclient.grpc import service_pb2

from qosgate.adapters.tensors import TensorReader, TensorWriter
from qosgate.auth import Tenant
from qosgate.config import GatewayConfig
from qosgate.dataplane.plane import CallCost, DataPlane
from qosgate.errors import Internal, InvalidArgument
from qosgate.scheduler.cost import unit_cost

if TYPE_CHECKING:
    from qosgate.upstream.engine import UpstreamObserver

TEXT_INPUT = "text"
EMBEDDING_OUTPUT = "embedding"
# Triton's max_batch_size of the embedding model bounds one call's texts.
MAX_INPUTS = 32


class EngineInfer(Protocol):
    """Sends one ModelInfer to Triton (upstream.engine.PoolEngineInfer); failures are
    raised as GatewayErrors."""

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None, observer: UpstreamObserver
    ) -> service_pb2.ModelInferResponse: ...


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input text, and where the time went (seconds)."""

    vectors: list[list[float]]
    queue_s: float
    total_s: float


class EmbeddingPlane:
    """Serves embedding calls for one config snapshot."""

    def __init__(self, *, config: GatewayConfig, plane: DataPlane, engine: EngineInfer) -> None:
        self._config = config
        self.dataplane = plane
        self._engine = engine
        self._clock = plane.clock

    async def embed(
        self,
        rpc: str,
        tenant: Tenant,
        model: str,
        inputs: Sequence[str],
        *,
        priority_class: str | None = None,
        deadline: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Embeddings:
        """Embed `inputs` for `tenant`; `rpc` names the API and method in metrics and
        traces, `deadline` is on the plane's clock, `headers` may carry a `traceparent`."""
        arrived = self._clock.now()
        async with self.dataplane.open(rpc, tenant, model, headers) as scope:
            if not model:
                raise InvalidArgument("model is required")
            if not inputs:
                raise InvalidArgument("inputs must not be empty")
            if len(inputs) > MAX_INPUTS:
                raise InvalidArgument(f"at most {MAX_INPUTS} inputs per call, got {len(inputs)}")
            unit = self._config.model_policy(model).cost_unit
            cost = unit_cost(unit, texts=len(inputs), size=sum(len(text.encode()) for text in inputs))
            dispatch = await scope.admit(CallCost(fair_share=cost), priority_class=priority_class, deadline=deadline)
            request = service_pb2.ModelInferRequest(model_name=model)
            TensorWriter(request).strings(TEXT_INPUT, inputs, [len(inputs), 1])
            request.outputs.add().name = EMBEDDING_OUTPUT
            request.parameters["priority"].uint64_param = dispatch.priority_level
            if scope.timeout_us is not None:
                request.parameters["timeout"].int64_param = scope.timeout_us
            response = await self._engine.infer(request, scope.timeout_s, scope)
            values = TensorReader(response).numbers(EMBEDDING_OUTPUT)
            if not values or len(values) % len(inputs):
                raise Internal(f"model {model!r} returned no {EMBEDDING_OUTPUT!r} row per input")
        width = len(values) // len(inputs)
        vectors = [[float(v) for v in values[i : i + width]] for i in range(0, len(values), width)]
        return Embeddings(vectors, dispatch.queue_wait_s, self._clock.now() - arrived)
