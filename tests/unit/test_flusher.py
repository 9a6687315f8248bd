"""The relay's Flusher: each dirty connection written once per pass, in the same pass when
writing one dirties another, a connection whose write fails closed, not forgotten, and
work deferred with `later` run after the writes of its pass."""

from __future__ import annotations

import asyncio

import pytest

from qosgate.transport.peer import Flusher


class _Peer:
    """What the Flusher uses of a Peer: `dirty`, `write_out()`, `abort()`."""

    def __init__(self, name: str, log: list[str], then: list[_Peer] | None = None, fails: bool = False) -> None:
        self.name = name
        self.dirty = False
        self.log = log
        self.then = then or []
        self.fails = fails
        self.aborted = False

    def mark(self, flusher: Flusher) -> None:
        if not self.dirty:
            self.dirty = True
            flusher.mark(self)

    def write_out(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError("a bug")
        for other in self.then:
            other.mark(self.flusher)

    def abort(self) -> None:
        self.aborted = True


async def _turns(count: int) -> None:
    """Let the loop run `count` passes. The flusher's pass, scheduled before the first,
    runs in it before this task resumes; a pass that pass scheduled would run after."""
    for _ in range(count):
        await asyncio.sleep(0)


async def test_connections_dirtied_while_writing_are_written_in_the_same_pass() -> None:
    flusher = Flusher()
    log: list[str] = []
    downstream = _Peer("down", log)
    upstream = _Peer("up", log, then=[downstream])  # writing it settles a pipe: down is due
    for peer in (downstream, upstream):
        peer.flusher = flusher  # type: ignore[attr-defined]
    upstream.mark(flusher)
    upstream.mark(flusher)  # marked twice, written once
    await _turns(1)
    assert log == ["up", "down"]  # in one pass: no second one scheduled for what it wrote
    await _turns(2)
    assert log == ["up", "down"]


async def test_a_connection_whose_write_fails_is_closed_and_the_others_are_still_written() -> None:
    flusher = Flusher()
    log: list[str] = []
    broken = _Peer("broken", log, fails=True)
    healthy = _Peer("healthy", log)
    for peer in (healthy, broken):
        peer.flusher = flusher  # type: ignore[attr-defined]
        peer.mark(flusher)
    await _turns(1)
    assert sorted(log) == ["broken", "healthy"]
    assert broken.aborted and not healthy.aborted
    # Later marks are still written: the failure did not leave the flusher stuck.
    healthy.mark(flusher)
    await _turns(1)
    assert log[-1] == "healthy"


async def test_deferred_callbacks_run_after_the_writes_of_their_pass_and_their_writes_too() -> None:
    flusher = Flusher()
    log: list[str] = []
    downstream = _Peer("down", log)
    upstream = _Peer("up", log)
    for peer in (downstream, upstream):
        peer.flusher = flusher  # type: ignore[attr-defined]
    downstream.mark(flusher)  # a response to write
    # The call's accounting: deferred, and it dispatches a queued call (upstream is due).
    flusher.later(lambda who: (log.append(f"finished {who}"), upstream.mark(flusher)), "call 1")
    flusher.later(log.append, "finished call 2")
    await _turns(1)
    assert log == ["down", "finished call 1", "up", "finished call 2"]  # all in one pass


async def test_a_failing_deferred_callback_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    flusher = Flusher()
    ran: list[str] = []

    def broken(_: str) -> None:
        raise RuntimeError("a bug")

    flusher.later(broken, "x")
    flusher.later(ran.append, "after")
    await _turns(2)
    assert ran == ["after"]
    assert "deferred callback failed" in caplog.text
