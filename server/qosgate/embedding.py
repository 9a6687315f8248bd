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
from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.errors import DeadlineExceeded, Internal, InvalidArgument
from qosgate.quota import Admission, Refused
from qosgate.scheduler import Scheduler
from qosgate.scheduler.cost import unit_cost

TEXT_INPUT = "text"
EMBEDDING_OUTPUT = "embedding"
# Triton's max_batch_size of the embedding model bounds one call's texts.
MAX_INPUTS = 32


class EngineInfer(Protocol):
    """Sends one ModelInfer to Triton; failures are raised as GatewayErrors."""

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelInferResponse: ...


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input text, and where the time went (seconds)."""

    vectors: list[list[float]]
    queue_s: float
    total_s: float


class EmbeddingPlane:
    """Serves embedding calls for one config snapshot."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        directory: TenantDirectory,
        admission: Admission,
        scheduler: Scheduler,
        engine: EngineInfer,
        clock: Clock,
    ) -> None:
        self._config = config
        self._directory = directory
        self._admission = admission
        self._scheduler = scheduler
        self._engine = engine
        self._clock = clock

    async def embed(
        self,
        tenant: Tenant,
        model: str,
        inputs: Sequence[str],
        *,
        priority_class: str | None = None,
        deadline: float | None = None,
    ) -> Embeddings:
        """Embed `inputs` for `tenant`; `deadline` is on the plane's clock."""
        arrived = self._clock.now()
        if not model:
            raise InvalidArgument("model is required")
        if not inputs:
            raise InvalidArgument("inputs must not be empty")
        if len(inputs) > MAX_INPUTS:
            raise InvalidArgument(f"at most {MAX_INPUTS} inputs per call, got {len(inputs)}")
        self._directory.require_model(tenant, model)
        klass = self._directory.resolve_class(tenant, priority_class)
        verdict = await self._admission.admit(tenant)
        if isinstance(verdict, Refused):
            raise verdict.error()
        unit = self._config.model_policy(model).cost_unit
        cost = unit_cost(unit, texts=len(inputs), size=sum(len(text.encode()) for text in inputs))
        try:
            async with self._scheduler.slot(
                tenant=tenant, klass=klass, model=model, deadline=deadline, cost=cost
            ) as dispatch:
                request = service_pb2.ModelInferRequest(model_name=model)
                TensorWriter(request).strings(TEXT_INPUT, inputs, [len(inputs), 1])
                request.outputs.add().name = EMBEDDING_OUTPUT
                request.parameters["priority"].uint64_param = dispatch.priority_level
                timeout_s = None
                if deadline is not None:
                    timeout_s = deadline - self._clock.now()
                    if timeout_s <= 0:
                        raise DeadlineExceeded("deadline passed before dispatch to Triton")
                    request.parameters["timeout"].int64_param = int(timeout_s * 1_000_000)
                response = await self._engine.infer(request, timeout_s)
                dispatch.responded()
        finally:
            await verdict.permit.release()
        values = TensorReader(response).numbers(EMBEDDING_OUTPUT)
        if not values or len(values) % len(inputs):
            raise Internal(f"model {model!r} returned no {EMBEDDING_OUTPUT!r} row per input")
        width = len(values) // len(inputs)
        vectors = [[float(v) for v in values[i : i + width]] for i in range(0, len(values), width)]
        return Embeddings(vectors, dispatch.queue_wait_s, self._clock.now() - arrived)
