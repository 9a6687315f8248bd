"""Generation requests and results as the gateway sees them, free of protos and tensors.

The edge converts qosgate.v1 messages into these; an adapter turns them into one model's
Triton tensor contract and turns that model's responses back into `GenerationChunk`s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    """Author of a chat turn; the values are what chat templates see as `message.role`."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation."""

    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings after the model's defaults were applied; None = engine default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A request ready for an adapter: the prompt is final (chat template already applied)."""

    model: str
    prompt: str
    sampling: Sampling
    stream: bool


class FinishReason(enum.Enum):
    """Why generation ended; mirrors qosgate.v1.FinishReason."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Tokens one request used: what the quota is reconciled with and the ledger records."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class GenerationChunk:
    """What one upstream response contributed: a text delta, and at the end the outcome.

    `final` is True on the last chunk of a request; only then are `finish_reason` and
    `usage` meaningful.
    """

    text: str = ""
    final: bool = False
    finish_reason: FinishReason | None = None
    usage: TokenCounts | None = None
