"""Run a coroutine at once, in the caller's frame, and make a task of it only if it waits.

The relay decides each call in a protocol callback. Most decisions never wait (the
tenant is known, its quota has room, the model's window has a free slot), yet a task per
call costs its creation, a turn of the event loop before it starts and another before its
done-callback runs: a good share of the CPU a relayed call costs, and a loop turn of
latency. Python 3.12's eager task factory does this for every task; this is the same
for the few coroutines on the relay's hot path, on Python 3.11 and any event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def run_eagerly(coro: Coroutine[Any, Any, T]) -> T | asyncio.Task[T]:
    """`coro`'s result if it finishes without waiting; else a task that carries it on from
    where it first waited (cancelling the task cancels that wait, as for any task)."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as done:
        return done.value
    # An exception out of `send` has ended the coroutine: nothing to close.
    return asyncio.get_running_loop().create_task(_carried_on(_Started(coro, waiting_on)))


async def _carried_on(started: _Started[T]) -> T:
    return await started


class _Started(Generic[T]):
    """A coroutine already past its first step, awaitable from the running task: what
    it yields goes to the task, what the task sends or throws goes back into it."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, T]:
        coro, waiting_on = self._coro, self._waiting_on
        while True:
            try:
                sent = yield waiting_on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as error:  # the task's cancellation, among others
                try:
                    waiting_on = coro.throw(error)
                except StopIteration as done:
                    return done.value
                continue
            try:
                waiting_on = coro.send(sent)
            except StopIteration as done:
                return done.value
