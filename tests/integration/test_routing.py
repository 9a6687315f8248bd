"""Routing and failover across two real Triton replicas (identity and smollm2 on each).

Which replica served what is read from each Triton's own statistics (ModelStatistics
success counts), not from the gateway, so the test checks where requests really ran.
The kill -9 test comes last: it takes one replica down for the rest of the module.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import struct
import time
from collections.abc import Iterator

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import free_port, require_model
from gateway_harness import ACME_KEY, GatewayThread, bearer, gateway_config
from qosgate.launcher import LocalTriton, TritonPorts, side_by_side_cpus
from qosgate.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

LLM = "smollm2"
ACME = tuple(bearer(ACME_KEY).items())
LOAD_FACTOR = 1.25
PREFIX_BYTES = 256
# Long enough that the rendered system prompt outlasts PREFIX_BYTES.
SYSTEM = (
    "You are the support assistant of {tenant}. Answer in plain words, keep to the facts of "
    "the customer's own account, never guess an order number, and end with a short summary. "
) * 3


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalTriton]]:
    """Two tritonservers, each with identity and smollm2, started side by side."""
    require_model(LLM)
    require_model("identity")
    servers = []
    for name, cpus in zip("ab", side_by_side_cpus(2), strict=True):
        ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
        log_path = tmp_path_factory.mktemp(f"triton-{name}") / "tritonserver.log"
        servers.append(LocalTriton(models=["identity", LLM], ports=ports, log_path=log_path, cpus=cpus))
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def gateway(replicas: list[LocalTriton]) -> Iterator[GatewayThread]:
    upstreams = [{"name": name, "url": r.ports.grpc_url} for name, r in zip("ab", replicas, strict=True)]
    llm_policy = {
        "dispatch_window": 16,
        "default_temperature": 0.0,
        "routing": {"policy": "prefix_affinity", "prefix_bytes": PREFIX_BYTES, "load_factor": LOAD_FACTOR},
    }
    config = gateway_config(replicas[0].ports.grpc_url, upstreams=upstreams, models={LLM: llm_policy})
    with GatewayThread(config) as running:
        running.wait_ready()
        deadline = time.monotonic() + 30
        while not all(u.live for u in running.gateway.pool.upstreams) and time.monotonic() < deadline:
            time.sleep(0.1)
        yield running


def served(replicas: list[LocalTriton], model: str) -> list[int]:
    """Requests each replica finished for `model`, by Triton's own statistics."""
    counts = []
    for replica in replicas:
        with grpcclient.InferenceServerClient(replica.ports.grpc_url) as client:
            stats = client.get_inference_statistics(model, as_json=True)
        counts.append(int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0)))
    return counts


def chat(tenant: str, question: str, max_tokens: int) -> generation_pb2.GenerateStreamRequest:
    messages = [
        generation_pb2.ChatMessage(role=generation_pb2.ROLE_SYSTEM, content=SYSTEM.format(tenant=tenant)),
        generation_pb2.ChatMessage(role=generation_pb2.ROLE_USER, content=question),
    ]
    return generation_pb2.GenerateStreamRequest(
        model=LLM,
        chat=generation_pb2.Chat(messages=messages),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
    )


def metric(gateway: GatewayThread, name: str, **labels: str) -> float:
    return gateway.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def test_requests_sharing_a_prefix_go_to_one_replica_within_the_load_bound(replicas, gateway) -> None:
    with grpc.insecure_channel(gateway.url) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        # One tenant's calls at a time: each system prompt's calls all land on one replica.
        for tenant in ("acme corp", "globex", "initech", "umbrella"):
            before = served(replicas, LLM)
            for question in ("Where is my order?", "Can I change my address?", "How do I get a refund?"):
                replies = list(stub.GenerateStream(chat(tenant, question, 2), metadata=ACME, timeout=120))
                assert replies[-1].HasField("usage")
            after = served(replicas, LLM)
            delta = sorted(b - a for a, b in zip(before, after, strict=True))
            assert delta == [0, 3], f"{tenant}: {delta}"

        # One hot prefix, 8 calls at once: its replica takes no more than the bound,
        # ceil(load_factor x 8 / 2), and the rest spill to the other one.
        calls = 8
        before = served(replicas, LLM)
        streams = [
            stub.GenerateStream(chat("acme corp", f"Question {i}: explain my invoice.", 48), metadata=ACME, timeout=180)
            for i in range(calls)
        ]
        for stream in streams:
            assert list(stream)[-1].HasField("usage")
        after = served(replicas, LLM)
    delta = sorted(b - a for a, b in zip(before, after, strict=True))
    bound = math.ceil(LOAD_FACTOR * calls / 2)
    assert sum(delta) == calls
    assert calls - bound <= delta[0] <= delta[1] <= bound, delta
    assert metric(gateway, "qosgate_routed_total", model=LLM, upstream="a", outcome="spilled") + metric(
        gateway, "qosgate_routed_total", model=LLM, upstream="b", outcome="spilled"
    ) >= 1


def identity_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(struct.pack("<16f", *range(16)))
    return request.SerializeToString()


async def test_a_replica_killed_under_load_loses_no_call_that_had_not_started(replicas, gateway) -> None:
    metadata = tuple(bearer(ACME_KEY).items())
    victim = replicas[1]
    async with grpc.aio.insecure_channel(gateway.url) as channel:
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        infer = kserve.ModelInfer
        payload = service_pb2.ModelInferRequest.FromString(identity_request())

        # Six long streams of one prefix: the load bound puts at least two on each replica.
        streams = [
            generation.GenerateStream(
                chat("acme corp", f"Write a very long essay about harbour number {i}.", 1500),
                metadata=metadata,
                timeout=300,
            )
            for i in range(6)
        ]
        firsts = [await stream.read() for stream in streams]
        assert all(first.text for first in firsts), "every stream has its first token before the kill"

        async def finish(stream: grpc.aio.UnaryStreamCall) -> str:
            # A stream that ends OK has ended complete, with its usage; one cut short
            # by the kill must say so, never end OK truncated.
            last = None
            try:
                while (reply := await stream.read()) is not grpc.aio.EOF:
                    last = reply
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "OK" if last is not None and last.HasField("usage") else "OK, truncated"

        stream_ends = [asyncio.ensure_future(finish(stream)) for stream in streams]

        codes: list[str] = []
        stop = asyncio.Event()

        async def caller() -> None:
            while not stop.is_set():
                try:
                    await infer(payload, metadata=metadata, timeout=30)
                    codes.append("OK")
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code().name)

        async def calls_past(count: int, at_least_s: float) -> None:
            """Waits at_least_s, then on until more than `count` calls have ended (the
            callers share the CPU with six generations: on a loaded machine a call can
            take seconds), for 30 s at most."""
            await asyncio.sleep(at_least_s)
            deadline = time.monotonic() + 30
            while len(codes) <= count and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

        callers = [asyncio.ensure_future(caller()) for _ in range(8)]
        await calls_past(0, 1.0)
        before_kill = len(codes)
        # 1500 tokens outlast the wait above on any CPU: every stream still runs.
        assert not any(end.done() for end in stream_ends), [end.result() for end in stream_ends if end.done()]
        os.killpg(victim.pid, signal.SIGKILL)
        await calls_past(before_kill, 3.0)
        stop.set()
        await asyncio.gather(*callers)
        # The victim's streams (at least two, by the load bound) end as its connection
        # drops. The survivor's run on: 1500 tokens take minutes on a loaded CPU, longer
        # than their deadline at times, and all that matters of them is that they did
        # not fail; they are cancelled here.
        deadline = time.monotonic() + 30
        while (
            sum(end.done() and end.result() != "OK" for end in stream_ends) < 2
            and not all(end.done() for end in stream_ends)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.1)
        ends = [end.result() for end in stream_ends if end.done()]
        for stream, end in zip(streams, stream_ends, strict=True):
            if not end.done():
                stream.cancel()
                end.cancel()
        await asyncio.gather(*stream_ends, return_exceptions=True)

        # After the kill, the survivor serves new streams of the same prefix.
        after = [r async for r in generation.GenerateStream(chat("acme corp", "Hello?", 2), metadata=metadata, timeout=120)]
        assert after[-1].HasField("usage")

    assert before_kill > 0 and len(codes) > before_kill
    # Unary calls: served (on the first replica or, retried, on the survivor), or refused
    # UNAVAILABLE only after the retry; nothing else.
    assert set(codes) <= {"OK", "UNAVAILABLE"}, sorted(set(codes))
    retried = metric(gateway, "qosgate_failovers_total", model="identity", upstream="b", result="retried")
    unretried = metric(gateway, "qosgate_failovers_total", model="identity", upstream="b", result="no_other_upstream")
    # How many calls were at the victim when it died depends on timing (the gateway sees
    # the connection drop within milliseconds): each of those was retried, never lost.
    assert codes.count("UNAVAILABLE") <= unretried, (codes.count("UNAVAILABLE"), retried, unretried)
    # Streams past their first token are never retried: those on the victim end UNAVAILABLE.
    assert set(ends) <= {"OK", "UNAVAILABLE"}, ends
    assert ends.count("UNAVAILABLE") >= 2, ends
    for upstream in ("a", "b"):
        for result in ("retried", "no_other_upstream"):
            assert metric(gateway, "qosgate_failovers_total", model=LLM, upstream=upstream, result=result) == 0
