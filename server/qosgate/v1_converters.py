"""Paired conversions between qosgate.v1 messages and the data plane's domain types.

Used by the gRPC servicers and by the batch job executor, whose items are stored as the
same v1 messages; no transport here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from google.protobuf import duration_pb2

from qosgate import errors
from qosgate.dataplane.embedding import Embeddings
from qosgate.dataplane.generation import Finished, GenerationCall
from qosgate.generation_types import ChatMessage, FinishReason, Role
from qosgate.v1 import common_pb2, embedding_pb2, generation_pb2

_ROLES = {
    generation_pb2.ROLE_SYSTEM: Role.SYSTEM,
    generation_pb2.ROLE_USER: Role.USER,
    generation_pb2.ROLE_ASSISTANT: Role.ASSISTANT,
}
_FINISH = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: generation_pb2.FINISH_REASON_CANCELLED,
}


def to_call(
    request: generation_pb2.GenerateRequest | generation_pb2.GenerateStreamRequest, *, stream: bool
) -> GenerationCall:
    """The domain request of a GenerateRequest or GenerateStreamRequest (its class goes
    on the call's description: the front end decodes it)."""
    sampling = request.sampling
    messages = None
    if request.WhichOneof("input") == "chat":
        messages = tuple(_message(i, m) for i, m in enumerate(request.chat.messages))
    return GenerationCall(
        model=request.model,
        prompt=request.prompt if request.WhichOneof("input") == "prompt" else None,
        messages=messages,
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
        top_k=sampling.top_k if sampling.HasField("top_k") else None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        stream=stream,
    )


def _message(index: int, message: generation_pb2.ChatMessage) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise errors.InvalidArgument(f"chat.messages[{index}].role must be set")
    return ChatMessage(role, message.content)


def duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(max(0, round(seconds * 1e9)))
    return duration


def _usage(finished: Finished) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=finished.usage.prompt_tokens, completion_tokens=finished.usage.completion_tokens
    )


def _timing(finished: Finished) -> common_pb2.Timing:
    timing = finished.timing
    return common_pb2.Timing(
        queue=duration(timing.queue_s),
        time_to_first_token=duration(timing.first_token_s),
        total=duration(timing.total_s),
    )


async def collect_response(items: AsyncIterator[str | Finished]) -> generation_pb2.GenerateResponse:
    """The unary response of a generation: its deltas joined, with the final outcome."""
    texts: list[str] = []
    async for item in items:
        if isinstance(item, Finished):
            return generation_pb2.GenerateResponse(
                text="".join(texts),
                finish_reason=_FINISH[item.finish_reason],
                usage=_usage(item),
                timing=_timing(item),
            )
        texts.append(item)
    raise errors.Internal("generation ended without a result")


def stream_response(item: str | Finished) -> generation_pb2.GenerateStreamResponse:
    """One GenerateStreamResponse: a text delta, or the final outcome."""
    if isinstance(item, Finished):
        return generation_pb2.GenerateStreamResponse(
            finish_reason=_FINISH[item.finish_reason], usage=_usage(item), timing=_timing(item)
        )
    return generation_pb2.GenerateStreamResponse(text=item)


def embed_response(result: Embeddings) -> embedding_pb2.EmbedResponse:
    """The wire form of an embedding result."""
    return embedding_pb2.EmbedResponse(
        embeddings=[embedding_pb2.Embedding(values=v) for v in result.vectors],
        timing=common_pb2.Timing(
            queue=duration(result.queue_s),
            time_to_first_token=duration(result.total_s),
            total=duration(result.total_s),
        ),
    )
