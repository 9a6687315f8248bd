"""OpenAI request bodies in, qosgate.v1 requests out; domain results in, OpenAI JSON out.

Bodies are parsed into qosgate.v1 GenerateRequest / EmbedRequest, the very messages the
gRPC servicers and the batch runner take, so one conversion (`to_call`) feeds the plane
and a batch line is stored exactly as a BatchService item would be.

Unknown fields are refused 400 ("Unrecognized request argument supplied"), as OpenAI
does. Fields OpenAI has and the gateway does not implement are accepted at their neutral
value (n=1, penalties 0, no logprobs, no tools) and refused 400 otherwise, so a request
never silently means something other than what the caller asked.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qosgate import errors
from qosgate.generation_types import FinishReason
from qosgate.dataplane.embedding import Embeddings
from qosgate.dataplane.generation import Finished
from qosgate.v1 import embedding_pb2, generation_pb2

MAX_STOP = 4
# The widest value the qosgate.v1 fields these become take (max_tokens, top_k: uint32).
_UINT32 = 2**32 - 1

_ROLES = {
    "system": generation_pb2.ROLE_SYSTEM,
    # OpenAI's newer name for system instructions.
    "developer": generation_pb2.ROLE_SYSTEM,
    "user": generation_pb2.ROLE_USER,
    "assistant": generation_pb2.ROLE_ASSISTANT,
}
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
}
_FINISH_OF_PROTO = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


class _Body(BaseModel):
    # Strict, as OpenAI's API is: a string where a number goes (`"max_tokens": "2"`), a
    # number where a flag goes (`"stream": 1`) or a fraction where an integer goes is a 400,
    # not read as what it might mean. (A whole number where a fraction goes is one.)
    model_config = ConfigDict(extra="forbid", strict=True)


_BodyT = TypeVar("_BodyT", bound=BaseModel)


class StreamOptions(_Body):
    include_usage: bool = False
    # Sent by newer SDKs; padding against length side channels, irrelevant here.
    include_obfuscation: bool | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """A chat message. A field it does not have is refused like a body's (a misspelt
    `content` would otherwise be an empty message); tools' roles are refused by `role`."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # The rest of what the SDK hands back as a response's message, sent again as history:
    # taken as long as it holds no tool call, audio or function call, and not read.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[Any] | None = Field(default=None, max_length=0)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_UINT32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # Not OpenAI's, but vLLM's OpenAI server takes it too.
    top_k: int | None = Field(default=None, ge=1, le=_UINT32)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: Literal[1] | None = None
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def _sampling(self, max_tokens: int | None) -> generation_pb2.SamplingParams:
        if self.logit_bias:
            raise errors.InvalidArgument("logit_bias is not supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stop) > MAX_STOP:
            raise errors.InvalidArgument(f"stop: at most {MAX_STOP} sequences")
        sampling = generation_pb2.SamplingParams(stop=stop)
        if max_tokens is not None:
            sampling.max_tokens = max_tokens
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.top_k is not None:
            sampling.top_k = self.top_k
        if self.seed is not None:
            sampling.seed = self.seed
        return sampling

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_UINT32)
    logprobs: Literal[False] | None = None
    top_logprobs: None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Any] | None = None

    def generate_request(self) -> generation_pb2.GenerateRequest:
        if self.response_format not in (None, {"type": "text"}):
            raise errors.InvalidArgument("response_format: only {'type': 'text'} is supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise errors.InvalidArgument("set max_tokens or max_completion_tokens, not both")
        chat = generation_pb2.Chat(
            messages=[
                generation_pb2.ChatMessage(role=_ROLES[m.role], content=m.text()) for m in self.messages
            ]
        )
        return generation_pb2.GenerateRequest(
            model=self.model,
            chat=chat,
            sampling=self._sampling(self.max_completion_tokens or self.max_tokens),
        )


class CompletionRequest(_Sampling):
    """`POST /v1/completions` (the legacy text completion)."""

    prompt: str | list[str]
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    logprobs: None = None
    suffix: None = None

    def generate_request(self) -> generation_pb2.GenerateRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise errors.InvalidArgument("prompt: send one prompt per request")
            prompt = prompt[0]
        if not prompt:
            raise errors.InvalidArgument("prompt must not be empty")
        return generation_pb2.GenerateRequest(
            model=self.model, prompt=prompt, sampling=self._sampling(self.max_tokens)
        )


class EmbeddingRequest(_Body):
    """`POST /v1/embeddings` (text input only)."""

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=_UINT32)
    user: str | None = None
    service_tier: str | None = None

    def embed_request(self) -> embedding_pb2.EmbedRequest:
        inputs = [self.input] if isinstance(self.input, str) else self.input
        return embedding_pb2.EmbedRequest(model=self.model, inputs=inputs)


# A JSON escape of a UTF-16 surrogate: a pair stands for one character, one alone for none.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(raw: bytes, what: str = "request body") -> Any:
    """A request body's JSON (`what`: else, as messages name it); InvalidArgument
    for bytes that are not JSON a request can carry: not UTF-8, nested past the parser's
    depth, an integer of thousands of digits, or a string holding an unpaired surrogate
    (which no text encoding can write)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise errors.InvalidArgument(f"{what} is not JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError among them
        raise errors.InvalidArgument(f"{what} is not JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw) is not None and _has_lone_surrogate(body):
        raise errors.InvalidArgument(f"{what} is not JSON text: a string holds an unpaired surrogate")
    return body


def _has_lone_surrogate(value: Any) -> bool:
    pending = [value]  # a stack, not recursion: the body may nest as deep as JSON allows
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def parse(body_type: type[_BodyT], raw: Any) -> _BodyT:
    """Validate a decoded JSON body; failures are InvalidArgument naming the field."""
    try:
        return body_type.model_validate(raw)
    except ValidationError as e:
        raise errors.InvalidArgument(_describe(e)) from None


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "body"
        if item["type"] == "extra_forbidden":
            problems.append(f"Unrecognized request argument supplied: {where}")
        elif item["type"] == "literal_error" and where in _NEUTRAL:
            problems.append(f"{where}: only {_NEUTRAL[where]} is supported")
        else:
            problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


_NEUTRAL = {
    "n": "1",
    "best_of": "1",
    "presence_penalty": "0",
    "frequency_penalty": "0",
    "logprobs": "false",
    "echo": "false",
    "tool_choice": "'none'",
}


# -- responses -------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion(
    completion_id: str, model: str, created: int, text: str, finish_reason: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


def text_completion(
    completion_id: str, model: str, created: int, text: str, finish_reason: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage,
    }


def completion_of(
    chat: bool, completion_id: str, model: str, created: int, text: str, finished: Finished
) -> dict[str, Any]:
    """The unary body of a finished generation."""
    build = chat_completion if chat else text_completion
    usage = usage_json(finished.usage.prompt_tokens, finished.usage.completion_tokens)
    return build(completion_id, model, created, text, FINISH_REASONS[finished.finish_reason], usage)


def completion_of_response(
    chat: bool, completion_id: str, model: str, created: int, response: generation_pb2.GenerateResponse
) -> dict[str, Any]:
    """The body of a stored batch result (a GenerateResponse)."""
    build = chat_completion if chat else text_completion
    usage = usage_json(response.usage.prompt_tokens, response.usage.completion_tokens)
    return build(
        completion_id, model, created, response.text, _FINISH_OF_PROTO.get(response.finish_reason, "stop"), usage
    )


def chunk(
    chat: bool,
    completion_id: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: a text delta, or (finish_reason set) the last choice chunk."""
    choice: dict[str, Any]
    if chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if with_usage_field:
        # With include_usage every chunk carries `usage: null` but the last one.
        body["usage"] = None
    return body


def usage_chunk(chat: bool, completion_id: str, model: str, created: int, finished: Finished) -> dict[str, Any]:
    """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(finished.usage.prompt_tokens, finished.usage.completion_tokens),
    }


def embedding_list(
    model: str, vectors: list[list[float]], encoding_format: str, dimensions: int | None
) -> dict[str, Any]:
    """`/v1/embeddings` body; base64 is little-endian float32, as OpenAI's SDKs decode it."""
    if dimensions is not None and vectors and dimensions != len(vectors[0]):
        raise errors.InvalidArgument(
            f"dimensions: model {model!r} returns {len(vectors[0])}-dimensional vectors only"
        )
    data = []
    for index, vector in enumerate(vectors):
        encoded: list[float] | str = vector
        if encoding_format == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    # The embedding path counts no tokens (admission counts requests only).
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 0, "total_tokens": 0}}


def embeddings_of(model: str, result: Embeddings, request: EmbeddingRequest) -> dict[str, Any]:
    return embedding_list(model, result.vectors, request.encoding_format, request.dimensions)


def embeddings_of_response(model: str, response: embedding_pb2.EmbedResponse) -> dict[str, Any]:
    """The body of a stored batch result (an EmbedResponse)."""
    return embedding_list(model, [list(e.values) for e in response.embeddings], "float", None)


def model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "qosgate"}
