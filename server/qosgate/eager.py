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
    # `coro` runs inside `_into`, which awaits it and keeps its result: a finished step
    # then ends without an exception to catch. Catching the StopIteration of `coro.send`
    # here instead costs a traceback entry, which compiled code (mypyc) builds from scratch,
    # on every call that did not wait.
    result: _Result[T] = _Result()
    step = _into(coro, result).__await__()
    waiting_on = next(step, _FINISHED)  # an exception out of it has ended the coroutine
    if waiting_on is _FINISHED:
        return result.value
    return asyncio.get_running_loop().create_task(_carried_on(_Started(step, waiting_on), result))


class _Result(Generic[T]):
    __slots__ = ("value",)

    value: T


async def _into(coro: Coroutine[Any, Any, T], result: _Result[T]) -> None:
    result.value = await coro


_FINISHED: Any = object()


async def _carried_on(started: _Started, result: _Result[T]) -> T:
    await started
    return result.value


class _Started:
    """A coroutine's steps already past the first one, awaitable from the running task:
    what they yield goes to the task, what the task sends or throws goes back into them."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Generator[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
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
                except StopIteration:
                    return
                continue
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return
