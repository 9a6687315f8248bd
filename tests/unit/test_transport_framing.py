"""gRPC message framing, grpc-timeout and status encoding of the relay (pure logic)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from qosgate.relay.policy import CallHead
from qosgate.transport import framing, http2
from qosgate.transport.status import (
    MAX_MESSAGE_BYTES,
    RESOURCE_EXHAUSTED,
    Refuse,
    bounded_messages,
    percent_encode,
    status_headers,
)


def test_scanner_counts_messages_split_anywhere() -> None:
    stream = framing.frame(b"a" * 10) + framing.frame(b"") + framing.frame(b"b" * 300, compressed=True)
    for cut in range(1, len(stream)):
        scanner = framing.MessageScanner(limit=1000)
        scanner.scan(stream[:cut])
        scanner.scan(stream[cut:])
        assert scanner.count == 3


def test_scanner_counts_one_whole_message_per_chunk_and_keeps_its_bound() -> None:
    scanner = framing.MessageScanner(limit=100)
    for payload in (b"", b"x" * 100, b"y"):
        scanner.scan(framing.frame(payload))
    assert scanner.count == 3
    scanner.scan(framing.frame(b"z" * 50)[:9])  # then a split one still counts once
    scanner.scan(framing.frame(b"z" * 50)[9:])
    assert scanner.count == 4
    with pytest.raises(framing.MessageTooLarge, match="101 bytes"):
        scanner.scan(framing.frame(b"x" * 101))


def test_scanner_refuses_a_message_over_the_limit_from_its_prefix() -> None:
    scanner = framing.MessageScanner(limit=100)
    with pytest.raises(framing.MessageTooLarge, match="101 bytes"):
        scanner.scan(framing.frame(b"x" * 101)[:7])  # the payload need not arrive


def test_first_message_collects_one_message_and_keeps_the_rest() -> None:
    first = framing.FirstMessage(limit=1000)
    data = framing.frame(b"hello", compressed=True) + framing.frame(b"next")
    assert not first.add(data[:3])
    assert not first.add(data[3:8])
    assert first.add(data[8:])
    assert (first.payload, first.compressed, first.rest) == (b"hello", True, framing.frame(b"next"))


def test_first_message_over_the_limit() -> None:
    with pytest.raises(framing.MessageTooLarge):
        framing.FirstMessage(limit=4).add(framing.frame(b"hello"))
    first = framing.FirstMessage(limit=4)  # refused on its prefix alone, split across chunks
    assert not first.add(framing.frame(b"hello")[:2])
    with pytest.raises(framing.MessageTooLarge, match="5 bytes"):
        first.add(framing.frame(b"hello")[2:5])


def test_first_message_from_many_chunks_and_a_message_of_parts() -> None:
    payload = bytes(range(256)) * 40
    data = framing.frame(payload) + b"\x00"
    first = framing.FirstMessage(limit=len(payload))
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    assert not any(first.add(chunk) for chunk in chunks[:-1])
    assert first.add(chunks[-1])
    assert (bytes(first.payload or b""), first.rest) == (payload, b"\x00")
    assert framing.frame(payload[:10], memoryview(payload)[10:], b"") == framing.frame(payload)


def test_decompress_gzip_and_deflate_with_a_bound() -> None:
    body = b"tensor bytes " * 100
    assert framing.decompress(b"gzip", gzip.compress(body), 10_000) == body
    assert framing.decompress(b"deflate", zlib.compress(body), 10_000) == body
    with pytest.raises(framing.MessageTooLarge):
        framing.decompress(b"gzip", gzip.compress(b"\0" * 1_000_000), 1000)  # a zip bomb stops early
    with pytest.raises(framing.UnsupportedEncoding):
        framing.decompress(b"snappy", b"", 1000)
    with pytest.raises(framing.UnsupportedEncoding, match="corrupt"):
        framing.decompress(b"gzip", b"not gzip", 1000)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"1S", 1.0), (b"250m", 0.25), (b"3M", 180.0), (b"1H", 3600.0), (b"20u", 20e-6), (b"5n", 5e-9)],
)
def test_grpc_timeout(value: bytes, seconds: float) -> None:
    assert framing.parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"", b"S", b"10", b"10x", b"123456789S", b"-1S"])
def test_malformed_grpc_timeout_is_ignored(value: bytes) -> None:
    assert framing.parse_timeout(value) is None


def test_format_timeout_round_trips_in_microseconds() -> None:
    assert framing.format_timeout(0.25) == b"250000u"
    assert framing.format_timeout(-1.0) == b"1u"  # already late: the upstream fails it at once
    assert framing.parse_timeout(framing.format_timeout(2.5)) == pytest.approx(2.5)


def test_status_headers_encode_message_and_details() -> None:
    fields = dict(status_headers(Refuse(RESOURCE_EXHAUSTED, "100% über", details=b"\x08\x08")))
    assert fields[b"grpc-status"] == b"8"
    assert fields[b"grpc-message"] == b"100%25 %C3%BCber"
    assert fields[b"grpc-status-details-bin"] == b"CAg"  # base64, padding dropped
    assert percent_encode("plain text") == b"plain text"


def test_percent_encoding_escapes_exactly_the_bytes_outside_printable_ascii_and_percent() -> None:
    for code in range(0x80):
        plain = 0x20 <= code <= 0x7E and code != 0x25
        expected = bytes([code]) if plain else b"%%%02X" % code
        assert percent_encode(f"a{chr(code)}b") == b"a" + expected + b"b", hex(code)
    assert percent_encode("quota: tenant:a (burst 1) exceeded") == b"quota: tenant:a (burst 1) exceeded"
    assert percent_encode("\u00e9\U0001f600") == b"%C3%A9%F0%9F%98%80"


def test_long_messages_are_cut_short_and_never_inside_an_escape() -> None:
    # Triton quotes request values (a model name of 10 kB) in its errors; a client refuses
    # trailers over 8 KiB, so an upstream's grpc-message reaches the caller cut short.
    quoted = b"unknown model '" + b"m" * 10_000 + b"'"
    trailers = bounded_messages([(b"grpc-status", b"5"), (b"grpc-message", quoted)])
    assert trailers[0] == (b"grpc-status", b"5")
    assert len(trailers[1][1]) == MAX_MESSAGE_BYTES and trailers[1][1].endswith(b"...")
    # An escape straddling the cut is dropped whole, not split.
    for offset in range(4):
        encoded = b"x" * (MAX_MESSAGE_BYTES - 6 + offset) + b"%C3%BC" * 10
        cut = dict(bounded_messages([(b"grpc-message", encoded)]))[b"grpc-message"]
        assert len(cut) <= MAX_MESSAGE_BYTES and cut.endswith(b"...")
        body = cut[: -len(b"...")]
        assert all(len(body[i + 1 : i + 3]) == 2 for i in range(len(body)) if body[i] == ord("%"))
    # A refusal of our own is cut the same way, however its text encodes.
    own = dict(status_headers(Refuse(RESOURCE_EXHAUSTED, "ü" * 1024)))
    assert len(own[b"grpc-message"]) <= MAX_MESSAGE_BYTES
    assert bounded_messages([(b"grpc-message", b"short")]) == [(b"grpc-message", b"short")]


def test_the_last_header_of_a_repeated_key() -> None:
    head = CallHead(
        b"/inference.GRPCInferenceService/ModelInfer",
        [(b"x-api-key", b"one"), (b"x-api-key", b"two")],
        b"",
        None,
    )
    assert http2.last_header(head.headers, b"x-api-key") == b"two"
    assert http2.header(head.headers, b"x-api-key") == b"one"
    assert http2.last_header(head.headers, b"authorization") is None
