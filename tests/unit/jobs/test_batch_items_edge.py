"""The BatchService edge's pure parts: header defaults, item checks naming the item, the
wire form of stored results (error class name → gRPC code through the one table)."""

from __future__ import annotations

import pytest
from qosgate.errors import InvalidArgument, PermissionDenied
from qosgate.jobs.model import ItemError, ItemKind, ItemResult
from qosgate.services.batch import new_item, result_message
from qosgate.v1 import batch_pb2, embedding_pb2, generation_pb2

from tests.fakes import make_tenant

TENANT = make_tenant("acme", models=("smollm2", "minilm"))


def allow_listed(tenant, model: str) -> None:  # type: ignore[no-untyped-def]
    if not tenant.allows_model(model):
        raise PermissionDenied(f"model {model!r} not allowed")


HEADER = batch_pb2.BatchHeader(
    model="smollm2",
    sampling=generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"]),
)


def test_header_defaults_fill_only_what_the_item_leaves_unset() -> None:
    item = batch_pb2.BatchItem(
        custom_id="q1",
        generate=generation_pb2.GenerateRequest(
            prompt="hi",
            sampling=generation_pb2.SamplingParams(max_tokens=4),
            priority_class="critical",
        ),
    )
    stored = new_item(0, item, HEADER, TENANT, allow_listed)
    assert stored.kind is ItemKind.GENERATE
    request = generation_pb2.GenerateRequest.FromString(stored.payload)
    assert request.model == "smollm2"
    assert request.sampling.max_tokens == 4  # the item's own value wins
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert list(request.sampling.stop) == ["\n"]
    assert request.priority_class == ""  # items always run at the batch class


def test_embed_item_takes_the_header_model() -> None:
    item = batch_pb2.BatchItem(
        custom_id="e1", embed=embedding_pb2.EmbedRequest(model="minilm", inputs=["a"])
    )
    stored = new_item(3, item, HEADER, TENANT, allow_listed)
    assert stored.kind is ItemKind.EMBED
    assert embedding_pb2.EmbedRequest.FromString(stored.payload).inputs == ["a"]


@pytest.mark.parametrize(
    ("item", "error", "text"),
    [
        (batch_pb2.BatchItem(custom_id="x"), InvalidArgument, "generate or embed"),
        (
            batch_pb2.BatchItem(custom_id="", generate=generation_pb2.GenerateRequest(prompt="a")),
            InvalidArgument,
            "custom_id is empty",
        ),
        (
            batch_pb2.BatchItem(custom_id="x", generate=generation_pb2.GenerateRequest()),
            InvalidArgument,
            "prompt or chat",
        ),
        # Sampling is checked at submission as it would be when the item runs: the job is
        # all or nothing, never queued with an item that can only fail.
        (
            batch_pb2.BatchItem(
                custom_id="x",
                generate=generation_pb2.GenerateRequest(
                    prompt="a", sampling=generation_pb2.SamplingParams(temperature=float("nan"))
                ),
            ),
            InvalidArgument,
            "temperature",
        ),
        (
            batch_pb2.BatchItem(
                custom_id="x",
                generate=generation_pb2.GenerateRequest(prompt="a", sampling=generation_pb2.SamplingParams(top_p=0)),
            ),
            InvalidArgument,
            "top_p",
        ),
        (
            batch_pb2.BatchItem(
                custom_id="x",
                generate=generation_pb2.GenerateRequest(
                    chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(content="hi")])
                ),
            ),
            InvalidArgument,
            "role must be set",
        ),
        (
            batch_pb2.BatchItem(
                custom_id="x", generate=generation_pb2.GenerateRequest(model="other", prompt="a")
            ),
            PermissionDenied,
            "'other' not allowed",
        ),
        (
            batch_pb2.BatchItem(custom_id="x", embed=embedding_pb2.EmbedRequest(model="minilm")),
            InvalidArgument,
            "inputs is empty",
        ),
    ],
)
def test_bad_items_are_named_by_position(
    item: batch_pb2.BatchItem, error: type[Exception], text: str
) -> None:
    with pytest.raises(error) as caught:
        new_item(7, item, HEADER, TENANT, allow_listed)
    assert str(caught.value).startswith("item 7 (custom_id")
    assert text in str(caught.value)


def test_result_wire_form() -> None:
    ok = result_message(
        ItemResult(
            offset=4,
            custom_id="q1",
            kind=ItemKind.GENERATE,
            payload=generation_pb2.GenerateResponse(text="Paris").SerializeToString(),
            error=None,
            attempts=2,
            completed_at=1_700_000_000.5,
        )
    )
    assert ok.offset == 4 and ok.generation.text == "Paris" and ok.attempts == 2
    assert ok.completed_at.seconds == 1_700_000_000 and ok.completed_at.nanos == 500_000_000
    failed = result_message(
        ItemResult(5, "q2", ItemKind.GENERATE, None, ItemError("Unavailable", "down"), 5, 0.0)
    )
    assert failed.WhichOneof("outcome") == "error"
    assert (failed.error.code, failed.error.message) == ("UNAVAILABLE", "down")
