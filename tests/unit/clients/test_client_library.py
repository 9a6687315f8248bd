"""The client library against an in-process fake GenerationService: metadata carries the
key, requests carry what the caller asked, and a refusal surfaces as ClientError with the
server's RetryInfo delay."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from qosgate.v1 import generation_pb2, generation_pb2_grpc
from qosgate_client import Client, ClientError


class RecordingGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Streams the prompt back word by word; refuses requests for model "refuse"."""

    def __init__(self) -> None:
        self.seen: list[tuple[generation_pb2.GenerateStreamRequest, dict[str, str]]] = []

    def GenerateStream(
        self, request: generation_pb2.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateStreamResponse]:
        self.seen.append((request, dict(context.invocation_metadata())))
        if request.model == "refuse":
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2)))
            context.abort_with_status(
                rpc_status.to_status(
                    status_pb2.Status(
                        code=code_pb2.RESOURCE_EXHAUSTED, message="over budget", details=[detail]
                    )
                )
            )
        words = request.chat.messages[-1].content.split() if request.HasField("chat") else []
        for word in words:
            yield generation_pb2.GenerateStreamResponse(text=word + " ")
        yield generation_pb2.GenerateStreamResponse(finish_reason=generation_pb2.FINISH_REASON_STOP)


@pytest.fixture
def served() -> Iterator[tuple[str, RecordingGeneration]]:
    servicer = RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def test_stream_sends_key_chat_and_sampling(served: tuple[str, RecordingGeneration]) -> None:
    target, servicer = served
    with Client(target, "secret-key") as client:
        parts = list(
            client.generate_stream(
                "m",
                messages=[("system", "be brief"), ("user", "one two")],
                priority_class="batch",
                max_tokens=5,
                temperature=0.0,
                stop=["\n"],
            )
        )
    assert "".join(p.text for p in parts) == "one two "
    assert parts[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
    request, metadata = servicer.seen[0]
    assert metadata["authorization"] == "Bearer secret-key"
    assert [m.role for m in request.chat.messages] == [
        generation_pb2.ROLE_SYSTEM,
        generation_pb2.ROLE_USER,
    ]
    assert request.priority_class == "batch"
    assert request.sampling.max_tokens == 5
    # Explicit zero is sent (greedy), while unset fields stay unset for model defaults.
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert not request.sampling.HasField("top_p")
    assert list(request.sampling.stop) == ["\n"]


def test_refusal_carries_code_message_and_retry_delay(
    served: tuple[str, RecordingGeneration],
) -> None:
    target, _ = served
    with Client(target, "k") as client, pytest.raises(ClientError) as caught:
        list(client.generate_stream("refuse", "hi"))
    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert caught.value.message == "over budget"
    assert caught.value.retry_after_s == 2.0


def test_prompt_and_messages_are_exclusive() -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError):
        list(client.generate_stream("m", "p", messages=[("user", "q")]))
