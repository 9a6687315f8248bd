"""Handing the memory of large messages back to the operating system.

glibc's malloc gives freed memory back only from the top of each heap. A large message
passes through gRPC as many slices allocated by several threads, so once it is freed
most of its pages sit free in the middle of malloc's heaps, still counted in the
process's RSS until reused: measured here, three 100 MiB ModelInfer calls left the
gateway ~140 MB above its baseline with nothing alive holding them (a full GC freed
nothing). `malloc_trim(0)` returns those pages (back to ~+40 MB).

`HeapTrimmer` runs it off the event loop, once, shortly after the last large message,
so a burst of them costs one trim. Without glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# Messages at least this large leave enough freed pages behind to be worth a trim.
LARGE_MESSAGE_BYTES = 8 << 20
# Wait this long after a large message: its buffers are freed once gRPC has sent the reply.
TRIM_DELAY_S = 1.0


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Trims malloc's heaps after large messages; see the module docstring."""

    def __init__(self, trim: Callable[[int], int] | None = None, *, delay_s: float = TRIM_DELAY_S) -> None:
        """`trim`: the function to run (default: glibc's malloc_trim, if present)."""
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None
        self._running: asyncio.Future[int] | None = None

    def message(self, size: int) -> None:
        """A message of `size` bytes went through; call on the event loop."""
        if size < LARGE_MESSAGE_BYTES or self._trim is None:
            return
        loop = asyncio.get_running_loop()
        if self._pending is not None:
            self._pending.cancel()
        self._pending = loop.call_later(self._delay_s, self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pending = None
        if self._running is not None and not self._running.done():
            return  # one trim at a time; it frees what the later messages left too
        assert self._trim is not None
        # malloc_trim walks every heap (milliseconds for hundreds of MB): not on the loop.
        self._running = loop.run_in_executor(None, self._trim, 0)
        self._running.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("malloc_trim failed: %r", future.exception())

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
