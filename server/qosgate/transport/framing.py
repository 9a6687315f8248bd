"""gRPC's length-prefixed messages (1 byte compressed flag, 4 bytes big-endian length),
and its `grpc-timeout` header.

The relay never buffers a relayed call's messages, except the first one of a call that a
policy reads (a call served message by message collects them in messages.Inbox):
`MessageScanner` follows the prefixes through DATA chunks to count messages and enforce
the size bound without copying, and `FirstMessage` collects exactly one message.
"""

from __future__ import annotations

import zlib
from typing import ClassVar

from qosgate.transport.status import INVALID_ARGUMENT, RESOURCE_EXHAUSTED

PREFIX = 5


class FramingError(Exception):
    """Bytes that do not make an acceptable gRPC message; `status` is the call's answer."""

    status: ClassVar[int] = INVALID_ARGUMENT


class MessageTooLarge(FramingError):
    """A message's declared length is over the relay's bound."""

    status: ClassVar[int] = RESOURCE_EXHAUSTED

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"gRPC message of {length} bytes is over the limit of {limit}")


class UnsupportedEncoding(FramingError):
    """A compressed message in an encoding the relay cannot read."""


class MessageScanner:
    """Counts the messages in a byte stream and bounds their size, holding no payload."""

    __slots__ = ("count", "_left", "_header", "_limit")

    def __init__(self, limit: int) -> None:
        self.count = 0
        self._left = 0  # payload bytes of the current message still to come
        self._header = b""  # a prefix split across chunks
        self._limit = limit

    def scan(self, data: bytes | memoryview) -> None:
        pos, size = 0, len(data)
        if not self._left and not self._header and size >= PREFIX:
            # The usual chunk: exactly one whole message.
            length = int.from_bytes(data[1:PREFIX], "big")
            if PREFIX + length == size:
                if length > self._limit:
                    raise MessageTooLarge(length, self._limit)
                self.count += 1
                return
        while pos < size:
            if self._left:
                step = min(self._left, size - pos)
                self._left -= step
                pos += step
                continue
            need = PREFIX - len(self._header)
            self._header += bytes(data[pos : pos + need])
            pos += need
            if len(self._header) < PREFIX:
                return
            length = int.from_bytes(self._header[1:PREFIX], "big")
            self._header = b""
            if length > self._limit:
                raise MessageTooLarge(length, self._limit)
            self.count += 1
            self._left = length


class FirstMessage:
    """Collects a call's first message from DATA chunks (bounded by the size limit).

    Chunks are kept as they came and joined once, when the message is complete; the
    payload is a view of the joined bytes, so a large message is copied once here.
    """

    __slots__ = ("_chunks", "_size", "_end", "_limit", "compressed", "payload", "rest")

    def __init__(self, limit: int) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._end = 0  # PREFIX + the message's length, once the prefix is in
        self._limit = limit
        self.compressed = False
        self.payload: memoryview | None = None  # set once the whole message is in
        self.rest = b""  # bytes after it in the same chunk (the next messages)

    def add(self, data: bytes) -> bool:
        """Add a chunk; True once the message is complete."""
        chunks = self._chunks
        chunks.append(data)
        self._size += len(data)
        if not self._end:
            if self._size < PREFIX:
                return False
            head = chunks[0] if len(chunks[0]) >= PREFIX else b"".join(chunks)
            length = int.from_bytes(head[1:PREFIX], "big")
            if length > self._limit:
                raise MessageTooLarge(length, self._limit)
            self._end = PREFIX + length
        end = self._end
        if self._size < end:
            return False
        whole = b"".join(chunks)  # no copy when one chunk holds it all
        self._chunks = []
        self.compressed = whole[0] == 1
        self.payload = memoryview(whole)[PREFIX:end]
        self.rest = whole[end:]
        return True


def frame(*parts: bytes | memoryview, compressed: bool = False) -> bytes:
    """One length-prefixed message whose payload is `parts` joined (each copied once)."""
    size = sum(map(len, parts))
    return b"".join(((b"\x01" if compressed else b"\x00") + size.to_bytes(4, "big"), *parts))


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (`<digits><unit>`, at most 8 digits) in seconds; None if malformed."""
    scale = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if scale is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * scale


def format_timeout(seconds: float) -> bytes:
    """The grpc-timeout value for `seconds` left, in whole microseconds (at least 1)."""
    return b"%du" % max(1, min(99_999_999, int(seconds * 1e6)))


# zlib's wbits for each grpc-encoding the relay can read.
_WBITS = {b"gzip": 31, b"deflate": 15}


def decompress(encoding: bytes, payload: bytes | memoryview, limit: int) -> bytes:
    """A compressed message's bytes, refusing any that inflate beyond `limit`."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise UnsupportedEncoding(f"cannot read grpc-encoding {encoding.decode(errors='replace')!r}")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(payload, limit + 1)
    except zlib.error as e:
        raise UnsupportedEncoding(f"corrupt {encoding.decode()} message: {e}") from None
    if len(out) > limit:
        raise MessageTooLarge(len(out), limit)
    return out
