"""The gateway's HTTP/2 relay with no policy, in front of one Triton: the floor of
qosgate's KServe data path (frames and flow control moved by `qosgate.relay`, no tenant,
quota, scheduler or metrics work), measured by the overhead scenario beside qosgate.

`python -m bench.relay_alone --upstream HOST:PORT --listen HOST:PORT`
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from qosgate.relay.server import Relay


async def serve(upstream: str, listen: str) -> None:
    relay = Relay()
    pool = relay.upstream(upstream)
    await pool.start()
    relay.route(b"/", pool)
    host, _, port = listen.rpartition(":")
    await relay.listen(host, int(port))
    try:
        await asyncio.Event().wait()
    finally:
        await relay.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_alone", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="Triton's gRPC address, host:port")
    parser.add_argument("--listen", required=True, help="host:port to serve on")
    args = parser.parse_args()
    uvloop.run(serve(args.upstream, args.listen))


if __name__ == "__main__":
    main()
