"""The TensorRT-LLM ensemble contract (tensorrtllm_backend's `ensemble` / `tensorrt_llm_bls`).

The ensemble has a batch dimension (max_batch_size > 0), so every input is [1, n]:
text_input, max_tokens (INT32), stream, temperature / top_p (FP32), top_k (INT32),
random_seed (UINT64), stop_words (STRING, one element per stop string). Outputs:
text_output, and on some deployments sequence_length (tokens generated so far).

The ensemble does not report token counts the way the vLLM backend does, so:
- the gateway always asks it to stream (also for unary calls): TensorRT-LLM sends one
  response per decoding step, so completion tokens can be counted from the responses
  when `sequence_length` is absent, and a cancel stops the engine mid-generation;
- prompt tokens are the gateway's own estimate.
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from qosgate.generation_types import FinishReason, GenerationChunk, GenerationRequest, TokenCounts
from qosgate.adapters.tensors import TensorReader, TensorWriter, is_final, stream_request

_ONE = [1, 1]


class TrtLlmEnsembleAdapter:
    """Maps a GenerationRequest onto the TensorRT-LLM ensemble's tensors and back."""

    __slots__ = ()

    def encode(self, request: GenerationRequest, *, request_id: str) -> service_pb2.ModelInferRequest:
        sampling = request.sampling
        out = stream_request(request.model, request_id)
        tensors = TensorWriter(out)
        tensors.strings("text_input", [request.prompt], _ONE)
        tensors.scalar("max_tokens", "INT32", sampling.max_tokens, _ONE)
        tensors.scalar("stream", "BOOL", True, _ONE)
        if sampling.temperature is not None:
            tensors.scalar("temperature", "FP32", sampling.temperature, _ONE)
        if sampling.top_p is not None:
            tensors.scalar("top_p", "FP32", sampling.top_p, _ONE)
        if sampling.top_k:
            tensors.scalar("top_k", "INT32", sampling.top_k, _ONE)
        if sampling.seed is not None:
            tensors.scalar("random_seed", "UINT64", sampling.seed, _ONE)
        if sampling.stop:
            tensors.strings("stop_words", list(sampling.stop), [1, len(sampling.stop)])
        return out

    def decoder(self, request: GenerationRequest, *, prompt_tokens_estimate: int) -> TrtLlmDecoder:
        return TrtLlmDecoder(prompt_tokens_estimate, max_tokens=request.sampling.max_tokens)


class TrtLlmDecoder:
    """Counts generated tokens from `sequence_length`, else one per streamed step."""

    __slots__ = ("_prompt_tokens", "_max_tokens", "_steps", "_sequence_length")

    def __init__(self, prompt_tokens_estimate: int, *, max_tokens: int) -> None:
        self._prompt_tokens = prompt_tokens_estimate
        self._max_tokens = max_tokens
        self._steps = 0
        self._sequence_length: int | None = None

    def feed(self, response: service_pb2.ModelInferResponse) -> GenerationChunk:
        outputs = TensorReader(response)
        text = outputs.first_string("text_output")
        if text is not None:
            self._steps += 1
        length = outputs.first_int("sequence_length")
        if length is not None:
            self._sequence_length = length
        chunk = GenerationChunk(text=text or "")
        if is_final(response):
            usage = self.counted()
            chunk.final = True
            # The ensemble reports no finish reason: reaching max_tokens is the only
            # "length" stop it can have; anything shorter ended on end_id or a stop word.
            chunk.finish_reason = (
                FinishReason.LENGTH if usage.completion_tokens >= self._max_tokens else FinishReason.STOP
            )
            chunk.usage = usage
        return chunk

    def counted(self) -> TokenCounts:
        completion = self._steps if self._sequence_length is None else self._sequence_length
        return TokenCounts(self._prompt_tokens, completion)
