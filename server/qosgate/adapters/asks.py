"""What a KServe request to an LLM asks of its engine, read from the tensors of either
generation contract: the prompt (`text_input`), the most tokens it may generate (the
TensorRT-LLM ensemble's `max_tokens` input, or `max_tokens` in the vLLM backend's
`sampling_parameters` JSON) and whether it streams. The relay charges a ModelStreamInfer
request of an LLM in tokens by it, as the generation API charges its own calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from qosgate.adapters.tensors import TensorReader
from qosgate.errors import Internal

# What vLLM generates when a request names no max_tokens (SamplingParams' default).
VLLM_DEFAULT_MAX_TOKENS = 16
# Bytes every generation request of either contract holds (a cheap test before parsing).
PROMPT_INPUT = b"text_input"


@dataclass(frozen=True, slots=True)
class GenerationAsk:
    prompt: str
    max_tokens: int
    streaming: bool


def generation_ask(raw: bytes) -> GenerationAsk | None:
    """The ask of a serialized ModelInferRequest; None when it is no generation request
    (or not one this reads: the engine judges what it makes of it)."""
    if PROMPT_INPUT not in raw:
        return None
    try:
        reader = TensorReader(service_pb2.ModelInferRequest.FromString(raw))
        prompt = reader.first_string("text_input")
        if prompt is None:
            return None
        max_tokens = reader.first_int("max_tokens")
        if max_tokens is None:
            max_tokens = _sampling_max_tokens(reader.first_string("sampling_parameters"))
        streaming = bool(reader.first_int("stream"))
    except (DecodeError, Internal, ValueError, TypeError, OverflowError):
        return None
    return GenerationAsk(prompt, max(0, max_tokens), streaming)


def _sampling_max_tokens(sampling: str | None) -> int:
    if not sampling:
        return VLLM_DEFAULT_MAX_TOKENS
    settings = json.loads(sampling)  # ValueError (JSONDecodeError) when it is none
    value = settings.get("max_tokens") if isinstance(settings, dict) else None
    if value is None:
        return VLLM_DEFAULT_MAX_TOKENS
    # The backend takes numbers sent as JSON strings too ({"max_tokens": "64"}, "1e3").
    return int(value) if isinstance(value, int) else int(float(value))
