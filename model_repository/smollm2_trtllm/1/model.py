"""TensorRT-LLM ensemble contract → vLLM backend contract, through BLS.

Each request of this model becomes one request of the engine model (`smollm2`, config
parameter `engine_model`) made with `pb_utils.InferenceRequest(...).async_exec(
decoupled=True)`; every engine response is translated back and sent on this request's
response sender. Nothing is loaded here: the engine is the one `smollm2` already runs.

Mapping: max_tokens → max_tokens, top_k/top_p/temperature/random_seed(→seed)/
repetition_penalty/presence_penalty/frequency_penalty/min_length(→min_tokens) → the same
vLLM sampling parameters, stop_words → stop, bad_words → bad_words, end_id →
stop_token_ids. beam_width > 1 and return_log_probs are refused (the vLLM backend
contract has no beams or log-probs); pad_id and length_penalty (beam search only) are
accepted and ignored. `sequence_length` reports the tokens generated so far.

The request parameter `vllm_priority` (set by the gateway from the priority class) is
passed on so the engine's priority scheduler sees it through this hop too.

Limitation: Triton 2.51's python backend cannot cancel a BLS request. When our client
cancels, we stop forwarding at once and release the request, but the engine request
runs on until its max_tokens or a stop.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

PASSED_PARAMETERS = ("vllm_priority",)

# The BLS response iterator blocks in __next__; each wait runs on a thread of its own so
# concurrent streams do not stall one another (sized like smollm2's max_num_seqs).
MAX_CONCURRENT_STREAMS = 64

# ensemble input → (vLLM sampling key, converter)
SCALAR_SAMPLING = {
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "temperature": ("temperature", float),
    "random_seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "min_length": ("min_tokens", int),
}


class RefusedRequest(Exception):
    """A request this translation cannot serve; the message goes back to the client."""


def _array(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _scalar(request: Any, name: str) -> Any | None:
    values = _array(request, name)
    if values is None:
        return None
    if values.size != 1:
        raise RefusedRequest(f"input {name!r} must hold one value per request, got {values.size}")
    return values[0].item() if hasattr(values[0], "item") else values[0]


def _strings(request: Any, name: str) -> list[str]:
    values = _array(request, name)
    if values is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values if v]


def translate(request: Any) -> tuple[str, bool, bool, dict[str, Any]]:
    """(prompt, stream, exclude_input_in_output, vLLM sampling parameters)."""
    prompt = _scalar(request, "text_input")
    if prompt is None:
        raise RefusedRequest("input 'text_input' is required")
    if isinstance(prompt, bytes):
        prompt = prompt.decode("utf-8")
    max_tokens = _scalar(request, "max_tokens")
    if max_tokens is None or int(max_tokens) < 1:
        raise RefusedRequest("input 'max_tokens' is required and must be >= 1")
    sampling: dict[str, Any] = {"max_tokens": int(max_tokens)}
    for name, (key, convert) in SCALAR_SAMPLING.items():
        value = _scalar(request, name)
        if value is not None:
            sampling[key] = convert(value)
    stop = _strings(request, "stop_words")
    if stop:
        sampling["stop"] = stop
    bad = _strings(request, "bad_words")
    if bad:
        sampling["bad_words"] = bad
    end_id = _scalar(request, "end_id")
    if end_id is not None:
        sampling["stop_token_ids"] = [int(end_id)]
    beam_width = _scalar(request, "beam_width")
    if beam_width is not None and int(beam_width) != 1:
        raise RefusedRequest("beam_width > 1 is not supported by this model (no beam search)")
    if _scalar(request, "return_log_probs"):
        raise RefusedRequest("return_log_probs is not supported by this model")
    stream = bool(_scalar(request, "stream") or False)
    exclude_input = bool(_scalar(request, "exclude_input_in_output") or False)
    return prompt, stream, exclude_input, sampling


def _passed_parameters(request: Any) -> dict[str, Any]:
    try:
        parameters = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        return {}
    return {k: parameters[k] for k in PASSED_PARAMETERS if k in parameters}


def _bytes_tensor(name: str, value: str) -> Any:
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


def _bool_tensor(name: str, value: bool) -> Any:
    return pb_utils.Tensor(name, np.array([value], dtype=np.bool_))


class TritonPythonModel:
    """Serves the TensorRT-LLM ensemble contract by calling the vLLM engine model."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self._engine_model = config["parameters"]["engine_model"]["string_value"]
        self.logger = pb_utils.Logger
        self._waiters = ThreadPoolExecutor(MAX_CONCURRENT_STREAMS, thread_name_prefix="bls-wait")

    def finalize(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)

    async def execute(self, requests: list[Any]) -> None:
        # Decoupled + async: the stub runs this coroutine in the background, so requests
        # of other execute() calls proceed while these stream.
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt, stream, exclude_input, sampling = translate(request)
        except (RefusedRequest, UnicodeDecodeError, ValueError) as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=final)
            return
        engine_request = pb_utils.InferenceRequest(
            model_name=self._engine_model,
            inputs=[
                _bytes_tensor("text_input", prompt),
                _bool_tensor("stream", stream),
                _bytes_tensor("sampling_parameters", json.dumps(sampling)),
                _bool_tensor("exclude_input_in_output", exclude_input),
                _bool_tensor("return_num_output_tokens", True),
            ],
            requested_output_names=["text_output", "num_output_tokens"],
            parameters=_passed_parameters(request),
        )
        generated = 0
        try:
            responses = await engine_request.async_exec(decoupled=True)
            loop = asyncio.get_running_loop()
            while True:
                response = await loop.run_in_executor(self._waiters, next, responses, None)
                if response is None:
                    break
                if sender.is_cancelled():
                    break
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()), flags=final)
                    return
                text = pb_utils.get_output_tensor_by_name(response, "text_output")
                if text is None:
                    continue  # the engine's empty final response
                counted = pb_utils.get_output_tensor_by_name(response, "num_output_tokens")
                generated += int(counted.as_numpy().reshape(-1)[0]) if counted is not None else 0
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("text_output", text.as_numpy().reshape(1, -1)),
                            pb_utils.Tensor("sequence_length", np.array([[generated]], dtype=np.int32)),
                        ]
                    )
                )
        except Exception as exc:  # the model must keep serving other requests
            self.logger.log_error(f"smollm2_trtllm: engine call failed: {exc!r}")
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"engine call failed: {type(exc).__name__}")),
                flags=final,
            )
            return
        sender.send(flags=final)
