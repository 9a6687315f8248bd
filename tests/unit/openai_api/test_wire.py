"""OpenAI bodies into qosgate.v1 requests: what is taken, what is refused and how."""

from __future__ import annotations

import base64
import struct

import pytest

from qosgate import errors
from qosgate.openai_api import wire
from qosgate.v1 import generation_pb2

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_becomes_a_generate_request_with_sampling() -> None:
    body = wire.parse(
        wire.ChatCompletionRequest,
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "\n",
            "n": 1,
            "user": "someone",
        },
    )
    request = body.generate_request()
    assert [m.role for m in request.chat.messages] == [generation_pb2.ROLE_SYSTEM, generation_pb2.ROLE_USER]
    assert request.chat.messages[1].content == "hi there"
    assert request.sampling.max_tokens == 9 and request.sampling.seed == 3
    assert list(request.sampling.stop) == ["\n"]
    assert not request.sampling.HasField("top_k")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"frobnicate": 1}, "Unrecognized request argument supplied: frobnicate"),
        ({"n": 2}, "n: only 1 is supported"),
        ({"presence_penalty": 0.5}, "presence_penalty: only 0 is supported"),
        ({"logprobs": True}, "logprobs: only false is supported"),
        ({"temperature": 3}, "temperature: Input should be less than or equal to 2"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        # A misspelt field of a message is no empty message.
        ({"messages": [{"role": "user", "contnet": "x"}]}, "Unrecognized request argument supplied: messages.0.contnet"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages.0.tool_calls"),
        # Values of another JSON type than the field's are not read as what they might mean.
        ({"max_tokens": "2"}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 2.0}, "max_tokens: Input should be a valid integer"),
        ({"stream": "true"}, "stream: Input should be a valid boolean"),
        ({"stream": 1}, "stream: Input should be a valid boolean"),
        ({"temperature": "0.5"}, "temperature: Input should be a valid number"),
    ],
)
def test_refused_fields_name_themselves(extra: dict[str, object], message: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        wire.parse(wire.ChatCompletionRequest, {**CHAT, **extra})


def test_a_response_message_sent_back_as_history_is_taken() -> None:
    """What the SDK hands back as a response's message (its fields unset or empty), as a
    conversation's next request sends it; and whole numbers where fractions go."""
    answered = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None}
    body = wire.parse(wire.ChatCompletionRequest, {
        **CHAT, "messages": [*CHAT["messages"], answered, {"role": "user", "content": "and Rome?"}],  # type: ignore[list-item]
        "temperature": 1, "top_p": 1, "presence_penalty": 0.0,
    })
    request = body.generate_request()
    assert [m.content for m in request.chat.messages] == ["hi", "Paris.", "and Rome?"]
    assert request.sampling.temperature == 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_tokens": 5, "max_completion_tokens": 5}, "not both"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_inconsistent_requests_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        wire.parse(wire.ChatCompletionRequest, {**CHAT, **extra}).generate_request()


def test_completion_takes_one_prompt() -> None:
    request = wire.parse(wire.CompletionRequest, {"model": "m", "prompt": ["once"], "max_tokens": 3}).generate_request()
    assert request.prompt == "once" and request.sampling.max_tokens == 3
    with pytest.raises(errors.InvalidArgument, match="one prompt per request"):
        wire.parse(wire.CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).generate_request()


def test_embeddings_base64_is_little_endian_float32() -> None:
    body = wire.embedding_list("minilm", [[0.5, -1.0]], "base64", None)
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert struct.unpack("<2f", raw) == (0.5, -1.0)
    with pytest.raises(errors.InvalidArgument, match="2-dimensional"):
        wire.embedding_list("minilm", [[0.5, -1.0]], "float", 3)
