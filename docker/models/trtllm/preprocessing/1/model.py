"""Ensemble step 1: prompt text and stop/bad words to the token tensors tensorrt_llm takes.

Runs in NVIDIA's tritonserver:<yy.mm>-trtllm-python-py3 image (transformers and numpy are
there). The tokenizer folder is the `tokenizer_dir` parameter filled at deployment.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    """Triton's python-backend entry point for the `preprocessing` step."""

    def initialize(self, args: dict[str, str]) -> None:
        parameters = {
            key: value["string_value"]
            for key, value in json.loads(args["model_config"])["parameters"].items()
        }
        self._tokenizer = AutoTokenizer.from_pretrained(parameters["tokenizer_dir"])
        # BOS comes from the tokenizer, as in vLLM, so the gateway's chat template leaves
        # it out for both engines.
        self._add_special_tokens = parameters.get("add_special_tokens", "true") == "true"
        # Encoder-style tokenizers end a sequence with SEP rather than EOS.
        eos = self._tokenizer.eos_token_id
        if eos is None:
            eos = self._tokenizer.sep_token_id
        if eos is None:
            raise ValueError(f"tokenizer in {parameters['tokenizer_dir']} has no end token")
        pad = self._tokenizer.pad_token_id
        self._end_id = int(eos)
        self._pad_id = int(eos if pad is None else pad)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._encode(request)))
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses

    def _encode(self, request) -> list:
        queries = _strings(request, "QUERY")
        batch = len(queries)
        output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
        if (output_len <= 0).any():
            raise ValueError("max_tokens must be at least 1")

        ids = [
            self._tokenizer.encode(query, add_special_tokens=self._add_special_tokens)
            for query in queries
        ]
        if any(not row for row in ids):
            raise ValueError("text_input is empty")
        lengths = np.array([[len(row)] for row in ids], dtype=np.int32)
        input_ids = np.full((batch, int(lengths.max())), self._pad_id, dtype=np.int32)
        for index, row in enumerate(ids):
            input_ids[index, : len(row)] = row

        end_id = _ints_or(request, "END_ID", self._end_id, batch)
        pad_id = _ints_or(request, "PAD_ID", self._pad_id, batch)
        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.astype(np.int32)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._word_lists(request, "STOP_WORDS", batch)),
            pb_utils.Tensor("BAD_WORDS_IDS", self._word_lists(request, "BAD_WORDS", batch)),
            pb_utils.Tensor("OUT_END_ID", end_id),
            pb_utils.Tensor("OUT_PAD_ID", pad_id),
        ]

    def _word_lists(self, request, name: str, batch: int) -> np.ndarray:
        """[batch, 2, n]: row 0 the ids of every word back to back, row 1 each word's end
        offset; both padded (ids with 0, offsets with -1) to the longest in the batch."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        rows = tensor.as_numpy().reshape(batch, -1) if tensor is not None else [[]] * batch
        flat_ids, offsets = [], []
        for words in rows:
            ids: list[int] = []
            ends: list[int] = []
            for word in words:
                text = word.decode("utf-8") if isinstance(word, bytes) else str(word)
                if not text:
                    continue
                ids.extend(self._tokenizer.encode(text, add_special_tokens=False))
                ends.append(len(ids))
            flat_ids.append(ids)
            offsets.append(ends)
        width = max([1, *map(len, flat_ids)])
        result = np.zeros((batch, 2, width), dtype=np.int32)
        result[:, 1, :] = -1
        for index, (ids, ends) in enumerate(zip(flat_ids, offsets)):
            result[index, 0, : len(ids)] = ids
            result[index, 1, : len(ends)] = ends
        return result


def _strings(request, name: str) -> list[str]:
    values = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8") from exc


def _ints_or(request, name: str, default: int, batch: int) -> np.ndarray:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return np.full((batch, 1), default, dtype=np.int32)
    return tensor.as_numpy().astype(np.int32).reshape(batch, 1)
