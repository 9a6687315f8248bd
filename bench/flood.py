"""One tenant's flood of calls, sent from a process of its own at the lowest CPU priority.

The isolation scenario measures what a flood does to another tenant's calls through the
system under test (Triton alone, or the gateway). On a machine of a few cores the flood's
own client would skew that: grpc.aio spends a few hundred microseconds of CPU per call, so
thousands of calls a second take a core away from Triton and the gateway, which a tenant
whose clients run on other machines does not. A flood here runs in its own process at
nice 19, so it gets the CPU the system under test leaves idle; the critical caller stays
in the bench's process at normal priority. The scenario also runs one phase with the flood
at normal priority, so the report shows what the flood's own client costs.

`python -m bench.flood` is the child: it reads a `Flood` as one JSON line on stdin,
connects, prints `ready`, reads the phase's end time (on the run's clock) from stdin,
runs the loop until then, and prints its outcomes as one JSON line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

from tritonclient.grpc import service_pb2

from bench import load

NICE = 19


@dataclasses.dataclass(frozen=True, slots=True)
class Flood:
    """Who floods, with what, and how: an open loop at `rate` per second, or `concurrency`
    callers each sending again `retry_pause` seconds after a refusal (a closed loop)."""

    url: str
    epoch: float  # the run's clock (time.monotonic() at its start): outcomes share it
    caller: load.Caller
    request: bytes  # a serialised ModelInferRequest
    streaming: bool
    timeout: float
    rate: float = 0.0
    concurrency: int = 0
    retry_pause: float = 0.0
    nice: int = NICE


@contextlib.asynccontextmanager
async def started(flood: Flood) -> AsyncIterator[Callable[[float], Awaitable[list[load.Outcome]]]]:
    """Start `flood`'s process and wait until it is connected; yields the function that
    runs it until a time on the run's clock and returns its outcomes."""
    spec = dataclasses.asdict(flood)
    spec["request"] = base64.b64encode(flood.request).decode()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.flood", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None

    async def run_until(until: float) -> list[load.Outcome]:
        stdin.write(f"{until}\n".encode())
        await stdin.drain()
        out = await stdout.read()
        if await child.wait() != 0:
            raise RuntimeError(f"the flood process for {flood.url} failed (exit {child.returncode})")
        return [load.Outcome(**row) for row in json.loads(out)]

    try:
        stdin.write(json.dumps(spec).encode() + b"\n")
        await stdin.drain()
        if (await stdout.readline()).strip() != b"ready":
            raise RuntimeError(f"the flood process for {flood.url} did not start")
        yield run_until
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def _child() -> None:
    spec = json.loads(sys.stdin.readline())
    os.nice(spec.pop("nice"))
    caller = load.Caller(**spec.pop("caller"))
    flood = Flood(caller=caller, request=base64.b64decode(spec.pop("request")), **spec)
    request = service_pb2.ModelInferRequest.FromString(flood.request)
    target = load.Target(flood.url, flood.epoch)
    try:
        await target.channel.channel_ready()
        print("ready", flush=True)
        until = float(await asyncio.to_thread(sys.stdin.readline))
        call = target.stream if flood.streaming else target.infer
        send = lambda: call(caller, request, flood.timeout)  # noqa: E731
        if flood.concurrency:
            outcomes = await load.closed_loop(send, flood.concurrency, until, target.now, flood.retry_pause)
        else:
            outcomes = await load.open_loop(send, flood.rate, until, target.now, seed=2)
    finally:
        await target.close()
    print(json.dumps([dataclasses.asdict(o) for o in outcomes]), flush=True)


if __name__ == "__main__":
    asyncio.run(_child())
