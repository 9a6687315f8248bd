"""The vLLM backend contract (Triton's `vllm` backend and ours in backends/vllm).

Inputs: text_input, stream, sampling_parameters (JSON for vllm.SamplingParams),
exclude_input_in_output and return_finish_reason / return_num_input_tokens /
return_num_output_tokens. Outputs: text_output (a delta when streaming, the whole text
otherwise), finish_reason, num_input_tokens, and num_output_tokens — the tokens this
response added, so their sum over a request is its completion count in either mode.
"""

from __future__ import annotations

import json

from tritonclient.grpc import service_pb2

from qosgate.generation_types import FinishReason, GenerationChunk, GenerationRequest, TokenCounts
from qosgate.adapters.tensors import TensorReader, TensorWriter, is_final, stream_request

# vLLM's finish reasons; "abort" is what the engine reports for a cancelled request.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


class VllmAdapter:
    """Maps a GenerationRequest onto the vLLM backend's tensors and back."""

    __slots__ = ()

    def encode(self, request: GenerationRequest, *, request_id: str) -> service_pb2.ModelInferRequest:
        out = stream_request(request.model, request_id)
        tensors = TensorWriter(out)
        tensors.strings("text_input", [request.prompt], [1])
        tensors.scalar("stream", "BOOL", request.stream, [1])
        tensors.strings("sampling_parameters", [json.dumps(_sampling_json(request))], [1])
        for flag in (
            "exclude_input_in_output",
            "return_finish_reason",
            "return_num_input_tokens",
            "return_num_output_tokens",
        ):
            tensors.scalar(flag, "BOOL", True, [1])
        return out

    def decoder(self, request: GenerationRequest, *, prompt_tokens_estimate: int) -> VllmDecoder:
        return VllmDecoder(prompt_tokens_estimate)


def _sampling_json(request: GenerationRequest) -> dict[str, object]:
    sampling = request.sampling
    params: dict[str, object] = {"max_tokens": sampling.max_tokens}
    if sampling.temperature is not None:
        params["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        params["top_p"] = sampling.top_p
    # vLLM reads top_k 0 or -1 as "no cut"; the API's 0/unset means the same.
    if sampling.top_k:
        params["top_k"] = sampling.top_k
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    return params


class VllmDecoder:
    """Accumulates counts over one request's responses (see the module docstring)."""

    __slots__ = ("_prompt_tokens", "_completion_tokens", "_finish")

    def __init__(self, prompt_tokens_estimate: int) -> None:
        # Replaced by the engine's count as soon as a response carries it.
        self._prompt_tokens = prompt_tokens_estimate
        self._completion_tokens = 0
        self._finish: FinishReason | None = None

    def feed(self, response: service_pb2.ModelInferResponse) -> GenerationChunk:
        outputs = TensorReader(response)
        prompt = outputs.first_int("num_input_tokens")
        if prompt is not None:
            self._prompt_tokens = prompt
        added = outputs.first_int("num_output_tokens")
        if added is not None:
            self._completion_tokens += added
        reason = outputs.first_string("finish_reason")
        if reason:
            self._finish = _FINISH.get(reason, FinishReason.STOP)
        chunk = GenerationChunk(text=outputs.first_string("text_output") or "")
        if is_final(response):
            chunk.final = True
            chunk.finish_reason = self._finish or FinishReason.STOP
            chunk.usage = self.counted()
        return chunk

    def counted(self) -> TokenCounts:
        return TokenCounts(self._prompt_tokens, self._completion_tokens)
