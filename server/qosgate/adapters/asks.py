"""What a KServe request to an LLM asks of its engine, read from the tensors of either
generation contract: the prompt (`text_input`), the most tokens it may generate (the
TensorRT-LLM ensemble's `max_tokens` input, or `max_tokens` in the vLLM backend's
`sampling_parameters` JSON) and whether it streams. The relay charges a ModelStreamInfer
request of an LLM in tokens by it, as the generation API charges its own calls.

A request of the vLLM contract can also have the engine count its tokens: its
`return_num_input_tokens` / `return_num_output_tokens` flags add the outputs
`num_input_tokens` (the prompt) and `num_output_tokens` (the tokens each response added).
`EngineCounts` is what to append to a request so that its responses carry both, and which
of those outputs its caller did not ask for (the relay takes them out again).
"""

from __future__ import annotations

import functools
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
# The vLLM contract's flags that make the engine count tokens, each with the output it adds.
COUNT_FLAGS = (("return_num_input_tokens", "num_input_tokens"), ("return_num_output_tokens", "num_output_tokens"))


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """How a request gets its engine's token counts: `append` is added to it (the count
    flags it does not set, and their outputs where it names the outputs it wants: Triton
    returns only those), and `strip` names the count outputs its caller did not ask for."""

    append: bytes
    strip: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class GenerationAsk:
    prompt: str
    max_tokens: int
    streaming: bool
    # The vLLM contract's (no `max_tokens` input), unless the request turns a count flag off.
    counts: EngineCounts | None = None


def generation_ask(raw: bytes) -> GenerationAsk | None:
    """The ask of a serialized ModelInferRequest; None when it is no generation request
    (or not one this reads: the engine judges what it makes of it)."""
    if PROMPT_INPUT not in raw:
        return None
    try:
        request = service_pb2.ModelInferRequest.FromString(raw)
        reader = TensorReader(request)
        prompt = reader.first_string("text_input")
        if prompt is None:
            return None
        max_tokens = reader.first_int("max_tokens")
        counts = None
        if max_tokens is None:
            max_tokens = _sampling_max_tokens(reader.first_string("sampling_parameters"))
            counts = _engine_counts(request, reader)
        streaming = bool(reader.first_int("stream"))
    except (DecodeError, Internal, ValueError, TypeError, OverflowError):
        return None
    return GenerationAsk(prompt, max(0, max_tokens), streaming, counts)


def _engine_counts(request: service_pb2.ModelInferRequest, reader: TensorReader) -> EngineCounts | None:
    named = frozenset(output.name for output in request.outputs)
    flags: list[str] = []
    outputs: list[str] = []
    strip: set[bytes] = set()
    for flag, output in COUNT_FLAGS:
        asked = reader.first_int(flag)
        if asked is None:
            flags.append(flag)
        elif not asked:
            return None  # the caller turned it off: a second flag would be a duplicate input
        unnamed = bool(named) and output not in named  # Triton would not return it
        if unnamed:
            outputs.append(output)
        if asked is None or unnamed:
            strip.add(output.encode())
    append = _count_request(tuple(flags), tuple(outputs), raw=bool(request.raw_input_contents))
    return EngineCounts(append, frozenset(strip))


@functools.cache
def _count_request(flags: tuple[str, ...], outputs: tuple[str, ...], *, raw: bool) -> bytes:
    """A ModelInferRequest fragment that sets `flags` and names `outputs`; appended to a
    request, it merges into it (a repeated field's elements are appended in order, so a raw
    value lines up with its input as long as the request's own values are raw too)."""
    extra = service_pb2.ModelInferRequest()
    for flag in flags:
        tensor = extra.inputs.add(name=flag, datatype="BOOL", shape=[1])
        if raw:
            extra.raw_input_contents.append(b"\x01")
        else:
            tensor.contents.bool_contents.append(True)
    for output in outputs:
        extra.outputs.add(name=output)
    return extra.SerializeToString()


def _sampling_max_tokens(sampling: str | None) -> int:
    if not sampling:
        return VLLM_DEFAULT_MAX_TOKENS
    settings = json.loads(sampling)  # ValueError (JSONDecodeError) when it is none
    value = settings.get("max_tokens") if isinstance(settings, dict) else None
    if value is None:
        return VLLM_DEFAULT_MAX_TOKENS
    # The backend takes numbers sent as JSON strings too ({"max_tokens": "64"}, "1e3").
    return int(value) if isinstance(value, int) else int(float(value))
