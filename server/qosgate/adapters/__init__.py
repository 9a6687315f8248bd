"""Per-model mapping of generation requests onto Triton tensor contracts.

A model's `adapter` in the gateway config names its contract: `vllm` (the vLLM backend's
text_input/sampling_parameters tensors) or `trtllm` (the TensorRT-LLM ensemble's
text_input/max_tokens/... tensors). Each adapter builds the ModelInferRequest and gives a
per-request `ResponseDecoder` that turns the model's streamed responses into
`GenerationChunk`s with a finish reason and token counts.
"""

from __future__ import annotations

from typing import Protocol

from tritonclient.grpc import service_pb2

from qosgate.generation_types import GenerationChunk, GenerationRequest, TokenCounts


class ResponseDecoder(Protocol):
    """Decodes the responses of one request, in order; holds what it has counted so far."""

    def feed(self, response: service_pb2.ModelInferResponse) -> GenerationChunk:
        """One upstream response → a chunk; `final` marks the last one of the request."""
        ...

    def counted(self) -> TokenCounts:
        """Tokens seen so far: the whole usage after the final chunk, the part that was
        generated before a cancel otherwise."""
        ...


class GenerationAdapter(Protocol):
    """Speaks one model family's tensor contract."""

    def encode(self, request: GenerationRequest, *, request_id: str) -> service_pb2.ModelInferRequest:
        """The Triton request for `request`; always for the streaming RPC (decoupled models)."""
        ...

    def decoder(self, request: GenerationRequest, *, prompt_tokens_estimate: int) -> ResponseDecoder:
        """A fresh decoder for the responses of `request`."""
        ...


def adapter_for(kind: str) -> GenerationAdapter:
    """The adapter a model's config names (`vllm` or `trtllm`)."""
    from qosgate.adapters.trtllm import TrtLlmEnsembleAdapter
    from qosgate.adapters.vllm import VllmAdapter

    adapters: dict[str, GenerationAdapter] = {"vllm": VllmAdapter(), "trtllm": TrtLlmEnsembleAdapter()}
    try:
        return adapters[kind]
    except KeyError:
        raise ValueError(f"unknown generation adapter {kind!r}; expected one of {sorted(adapters)}") from None
