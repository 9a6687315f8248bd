"""Ensemble step 3: generated token ids back to text.

tensorrt_llm returns only generated tokens (exclude_input_in_output), as [batch, beam,
tokens] with the valid length of each beam in SEQUENCE_LENGTH. When streaming, each
response holds one step's tokens and is decoded alone: a character split across two
tokens then arrives as two partial pieces, which the caller joins.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    """Triton's python-backend entry point for the `postprocessing` step."""

    def initialize(self, args: dict[str, str]) -> None:
        parameters = {
            key: value["string_value"]
            for key, value in json.loads(args["model_config"])["parameters"].items()
        }
        self._tokenizer = AutoTokenizer.from_pretrained(parameters["tokenizer_dir"])
        self._skip_special_tokens = parameters.get("skip_special_tokens", "true") == "true"

    def execute(self, requests: list) -> list:
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", self._decode(r))])
            for r in requests
        ]

    def _decode(self, request) -> np.ndarray:
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        texts = np.empty(lengths.shape, dtype=np.object_)
        for batch_index, beam_index in np.ndindex(*lengths.shape):
            valid = tokens[batch_index, beam_index, : lengths[batch_index, beam_index]]
            texts[batch_index, beam_index] = self._tokenizer.decode(
                valid.tolist(), skip_special_tokens=self._skip_special_tokens
            ).encode("utf-8")
        return texts
