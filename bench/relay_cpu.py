"""CPU per forwarded ModelInfer of the HTTP/2 relay (qosgate.relay), next to nginx's
grpc_pass and today's grpcio gateway, in one run (issue 15's measurement; the overhead
scenario takes the relay in once the gateway serves KServe through it).

    .venv/bin/python -m bench.relay_cpu [--requests 20000] [--concurrency 16] [--rounds 2]

Triton serves identity; perf_analyzer drives each hop in turn, interleaved per round so
drift on the shared machine hits them alike; a hop's CPU is utime+stime of its process
group over the run divided by the requests Triton counted (bench.scenarios.overhead).
The relay runs as its own process with a policy that does what the gateway's must per
call: read the key header, peek the model name from the first message, append Triton's
priority. `--serve` is that process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys

from bench import perf
from bench.scenarios.overhead import TENANTS, measure_target
from bench.stack import GroupProcess, Stack, checked, free_port, wait_for_port

MODEL = "identity"


def serve(listen_port: int, upstream: str) -> None:
    import uvloop

    from qosgate.config import ResourceLimits
    from qosgate.relay.policy import CallHead, Forward
    from qosgate.relay.server import Relay
    from qosgate.services import infer_wire

    append = infer_wire.priority_fragment(2)
    max_fields = ResourceLimits().max_request_fields

    def policy(head: CallHead) -> Forward:
        head.header(b"authorization")
        if head.method == "ModelInfer":
            infer_wire.peek_request(head.first_message, max_fields)
        return Forward(append=append if head.method == "ModelInfer" else b"")

    async def main() -> None:
        relay = Relay()
        pool = relay.upstream(upstream)
        await pool.start()
        relay.route(b"/inference.GRPCInferenceService/", pool, policy)
        await relay.listen("127.0.0.1", listen_port)
        await asyncio.Event().wait()

    uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = perf.PerfSettings(requests=args.requests)
    cpu: dict[str, list[float]] = {}
    rate: dict[str, list[float]] = {}
    with checked(Stack(models=[MODEL])) as stack:
        port = free_port()
        relay = GroupProcess(
            "relay", [sys.executable, "-m", "bench.relay_cpu", "--serve", str(port), stack.triton_url],
            stack.dir / "relay.log",
        )
        try:
            wait_for_port(port, relay.proc, "relay")
            targets = [
                ("direct", stack.triton_url, None),
                ("nginx", stack.start_nginx(), stack.nginx),
                ("relay", f"127.0.0.1:{port}", relay),
                ("qosgate", stack.start_gateway(tenants=TENANTS, models={MODEL: {"dispatch_window": 64}}),
                 stack.gateway),
            ]
            for _ in range(args.rounds):
                for name, url, hop in targets:
                    sample = measure_target(stack, name, url, hop, args.concurrency, settings)
                    rate.setdefault(name, []).append(sample.point.throughput)
                    if sample.cpu_us_per_request is not None:
                        cpu.setdefault(name, []).append(sample.cpu_us_per_request)
        finally:
            relay.stop()
    print(f"\nidentity FP32[16], perf_analyzer c={args.concurrency}, {args.requests} requests x {args.rounds} rounds")
    for name in rate:
        cpus = cpu.get(name)
        cpu_text = "  ".join(f"{c:6.1f}" for c in cpus) if cpus else "     -"
        print(f"{name:8s} infer/s {statistics.median(rate[name]):7.0f}   CPU us/request {cpu_text}")


if __name__ == "__main__":
    main()
