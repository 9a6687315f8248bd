"""The relay's ModelInfer policy alone, in one process with warm caches: what deciding and
finishing one call costs in CPU when nothing else runs between calls.

`python -m bench.policy [--calls N]`

The gateway of the overhead scenario's config, its upstream marked live by hand and its
relay connections never started; each call is decided (tenant, model read from the
request, admission, dispatch slot, upstream pick) and finished (slot and permit released,
metrics recorded) as the relay does it, and nothing is sent. Beside `python -m bench
overhead`'s CPU per request over the relay alone, the difference is what the policy costs
with the caches a relayed call meets: the network, nghttp2 and the event loop run between
its steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tritonclient.grpc import service_pb2

from bench.scenarios.overhead import API_KEY, MODEL, TENANTS
from qosgate.app import Gateway
from qosgate.config import parse_config
from qosgate.relay.infer_policy import InferAdmissionPolicy
from qosgate.transport.peer import Flusher
from qosgate.relay.policy import CallEnd, CallHead, Forward
from qosgate.upstream.connections import ConnectionPool as Connections

PATH = b"/inference.GRPCInferenceService/ModelInfer"
OK = 0


def head() -> CallHead:
    """A call as perf_analyzer sends it to the overhead scenario's gateway."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(bytes(64))
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH), (b":authority", b"gateway"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"user-agent", b"perf_analyzer"),
               (b"grpc-accept-encoding", b"identity,deflate,gzip"), (b"authorization", f"Bearer {API_KEY}".encode())]
    return CallHead(PATH, headers, request.SerializeToString(), None)


async def measure(calls: int, rounds: int) -> list[float]:
    config = parse_config({"upstreams": [{"name": "triton", "url": "127.0.0.1:1"}], "tenants": TENANTS},
                          source="bench.policy")
    gateway = Gateway(config, serve_metrics=False)
    for upstream in gateway.pool.upstreams:
        upstream.live = True
        upstream.connections = Connections(Flusher(), upstream.url)  # named, never started
    policy = InferAdmissionPolicy(edge=gateway.edge, heap=gateway.heap,
                                  max_request_fields=config.limits.max_request_fields)
    call, end = head(), CallEnd(OK, None, 1, 1)
    per_call = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            decision = policy(call)
            if not isinstance(decision, Forward) or decision.on_finish is None:
                raise RuntimeError(f"the call was not forwarded at once: {decision!r}")
            decision.on_finish(end)
        per_call.append((time.perf_counter() - started) / calls * 1e6)
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    per_call = asyncio.run(measure(args.calls, args.rounds))
    print("us per call, each round: " + ", ".join(f"{us:.2f}" for us in per_call))
    print(f"median {statistics.median(per_call):.2f} us per call (decide + finish, warm caches)")


if __name__ == "__main__":
    main()
