"""run_eagerly: a coroutine runs at once; only one that waits becomes a task."""

from __future__ import annotations

import asyncio

import pytest

from qosgate.eager import run_eagerly


async def _no_wait(log: list[str]) -> str:
    log.append("ran")
    return "done"


async def _waits_on(future: asyncio.Future[int], log: list[str]) -> int:
    log.append("before")
    try:
        value = await future
    except asyncio.CancelledError:
        log.append("cancelled while waiting")
        raise
    log.append("after")
    await asyncio.sleep(0)  # a second wait, a bare yield to the loop
    return value + 1


async def test_a_coroutine_that_never_waits_runs_in_the_callers_frame() -> None:
    log: list[str] = []
    assert run_eagerly(_no_wait(log)) == "done"
    assert log == ["ran"]  # before any turn of the loop
    assert len(asyncio.all_tasks()) == 1  # this test's own: no task was made


async def test_a_coroutine_that_waits_goes_on_in_a_task_from_where_it_stopped() -> None:
    log: list[str] = []
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = run_eagerly(_waits_on(future, log))
    assert isinstance(task, asyncio.Task)
    assert log == ["before"]  # its first part ran at once, exactly once
    await asyncio.sleep(0)
    assert not task.done()
    future.set_result(41)
    assert await task == 42
    assert log == ["before", "after"]


async def test_cancelling_the_task_cancels_the_wait_inside_the_coroutine() -> None:
    log: list[str] = []
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = run_eagerly(_waits_on(future, log))
    assert isinstance(task, asyncio.Task)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["before", "cancelled while waiting"]
    assert future.cancelled()


async def test_errors_come_out_where_they_happen() -> None:
    async def fails_at_once() -> None:
        raise ValueError("at once")

    async def fails_later(future: asyncio.Future[None]) -> None:
        await future
        raise ValueError("later")

    with pytest.raises(ValueError, match="at once"):
        run_eagerly(fails_at_once())
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = run_eagerly(fails_later(future))
    assert isinstance(task, asyncio.Task)
    future.set_result(None)
    with pytest.raises(ValueError, match="later"):
        await task
    # An exception set on the awaited future is raised inside the coroutine.
    future = asyncio.get_running_loop().create_future()
    task = run_eagerly(fails_later(future))
    assert isinstance(task, asyncio.Task)
    future.set_exception(KeyError("from the future"))
    with pytest.raises(KeyError):
        await task
