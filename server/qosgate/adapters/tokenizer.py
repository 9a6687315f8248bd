"""Exact prompt token counts from the model's own tokenizer (Hugging Face tokenizer.json).

With a model's `tokenizer` configured, the gateway reserves quota for the prompt's real
size and reports it as usage even when the engine does not count it (the TensorRT-LLM
ensemble contract has no such output). Without one, `estimate_prompt_tokens` leans high.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TokenizerNotFound(LookupError):
    """The configured tokenizer is neither a path nor in the local Hugging Face cache."""


def find_tokenizer(spec: str, hf_home: Path) -> Path:
    """`spec` is a tokenizer.json, a folder holding one, or a Hugging Face model id looked
    up (offline) in the hub cache under `$HF_HOME` (default `hf_home`)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if (path / TOKENIZER_FILE).is_file():
        return path / TOKENIZER_FILE
    hub = Path(os.environ.get("HF_HOME", hf_home)) / "hub"
    repo = hub / f"models--{spec.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        raise TokenizerNotFound(f"tokenizer {spec!r}: no such file, folder or cached model in {hub}") from None
    cached = repo / "snapshots" / revision / TOKENIZER_FILE
    if not cached.is_file():
        raise TokenizerNotFound(f"tokenizer {spec!r}: the cached model has no {TOKENIZER_FILE}")
    return cached


def tokenizer_counter(spec: str, hf_home: Path) -> Callable[[str], int]:
    """A function giving the number of tokens the model's tokenizer makes of a prompt."""
    tokenizer = Tokenizer.from_file(str(find_tokenizer(spec, hf_home)))

    def count(prompt: str) -> int:
        return len(tokenizer.encode(prompt).ids)

    return count
