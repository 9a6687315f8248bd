"""Routing and failover across two real Triton replicas serving identity and smollm2: the
session's tritonserver (a) and one started here (b).

Which replica served what is read from each Triton's own statistics (ModelStatistics
success counts), not from the gateway, so the test checks where requests really ran.
The kill -9 test comes last: it takes b down for the rest of the module (never a, which
serves the modules after this one).
"""

from __future__ import annotations

import asyncio
import json
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

from conftest import engine_idle, free_port, kill_triton, require_model, started_then_killed
from gateway_harness import ACME_KEY, GatewayThread, bearer, gateway_config
from qosgate.launcher import LocalTriton, TritonPorts, side_by_side_cpus
from qosgate.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

LLM = "smollm2"
ACME = tuple(bearer(ACME_KEY).items())
LOAD_FACTOR = 1.25
PREFIX_BYTES = 256
SESSION_HEADER = "x-session-id"
# Long enough that the rendered system prompt outlasts PREFIX_BYTES.
SYSTEM = (
    "You are the support assistant of {tenant}. Answer in plain words, keep to the facts of "
    "the customer's own account, never guess an order number, and end with a short summary. "
) * 3


@pytest.fixture(scope="module")
def replicas(triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalTriton]]:
    """The session's tritonserver and a second one with identity and smollm2, its engine on
    the CPUs the session's leaves (left to itself, vLLM binds to the first core)."""
    require_model(LLM)
    require_model("identity")
    ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
    log_path = tmp_path_factory.mktemp("triton-b") / "tritonserver.log"
    other = LocalTriton(models=["identity", LLM], ports=ports, log_path=log_path, cpus=side_by_side_cpus(2)[-1])
    with started_then_killed(other):
        yield [triton, other]


@pytest.fixture(scope="module")
def gateway(replicas: list[LocalTriton]) -> Iterator[GatewayThread]:
    upstreams = [{"name": name, "url": r.ports.grpc_url} for name, r in zip("ab", replicas, strict=True)]
    llm_policy = {
        "dispatch_window": 16,
        "default_temperature": 0.0,
        "routing": {
            "policy": "prefix_affinity",
            "prefix_bytes": PREFIX_BYTES,
            "load_factor": LOAD_FACTOR,
            # KServe requests are keyed by their session header: the gateway reads no tensors.
            "session_header": SESSION_HEADER,
        },
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


def llm_request(request_id: str, max_tokens: int) -> service_pb2.ModelInferRequest:
    """A KServe request of smollm2 (the vLLM backend's tensors), streamed and greedy."""
    request = service_pb2.ModelInferRequest(model_name=LLM, id=request_id)
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).encode()
    for name, datatype, raw in (
        ("text_input", "BYTES", struct.pack("<I", 12) + b"Hello there!"),
        ("stream", "BOOL", b"\x01"),
        ("sampling_parameters", "BYTES", struct.pack("<I", len(sampling)) + sampling),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


def sessions_owned(gateway: GatewayThread) -> dict[str, str]:
    """A session id whose affinity owner is each replica, by the gateway's own ring."""
    pool = gateway.gateway.pool
    owners: dict[str, str] = {}
    for n in range(100):
        session = f"session-{n}"
        owners.setdefault(pool.pick(LLM, key=pool.key(LLM, session=session)).name, session)
        if len(owners) == 2:
            return owners
    raise AssertionError("no session maps to each replica")


def tenant_served_at(replicas: list[LocalTriton], gateway: GatewayThread, replica: LocalTriton) -> str:
    """A tenant whose system prompt `replica` owns: where a 2-token call of it ran."""
    index = replicas.index(replica)
    with grpc.insecure_channel(gateway.url) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for tenant in ("acme corp", "globex", "initech", "umbrella", "hooli", "soylent", "wonka", "tyrell"):
            before = served(replicas, LLM)
            assert list(stub.GenerateStream(chat(tenant, "Hello?", 2), metadata=ACME, timeout=120))[-1].HasField("usage")
            if served(replicas, LLM)[index] > before[index]:
                return tenant
    raise AssertionError("no tenant's prompt maps to the replica")


async def idle(gateway: GatewayThread) -> None:
    """Until no call is in flight at any upstream."""
    deadline = time.monotonic() + 30
    while any(u.in_flight for u in gateway.gateway.pool.upstreams):
        assert time.monotonic() < deadline, [u.in_flight for u in gateway.gateway.pool.upstreams]
        await asyncio.sleep(0.01)


class StreamCall:
    """One ModelStreamInfer call whose responses are gathered per request id; `finished`
    holds each request's end: "OK" once its final response came, else its in-band error."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self.call = stub.ModelStreamInfer(metadata=metadata, timeout=120)
        self.finished: dict[str, str] = {}
        self.responses: dict[str, int] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for reply in self.call:
            rid = reply.infer_response.id
            if reply.error_message:
                self.finished[rid] = reply.error_message
            else:
                self.responses[rid] = self.responses.get(rid, 0) + 1
                if reply.infer_response.parameters["triton_final_response"].bool_param:
                    self.finished[rid] = "OK"

    async def send(self, request: service_pb2.ModelInferRequest) -> None:
        await self.call.write(request)

    async def until_finished(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.finished) < count:
            assert time.monotonic() < deadline, f"finished {self.finished} of {count}"
            assert not self._reader.done() or self._reader.exception() is None, self._reader.exception()
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self._reader, 60)


async def test_a_stream_routes_each_request_by_its_model(replicas: list[LocalTriton], gateway: GatewayThread) -> None:
    owners = sessions_owned(gateway)
    identity = service_pb2.ModelInferRequest.FromString(identity_request())
    async with grpc.aio.insecure_channel(gateway.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        # One stream per session, its LLM requests one at a time (so no load bound is
        # near), each followed by two identity requests at once: each LLM request goes to
        # its session's replica, each identity request to the least loaded replica (the
        # second of a pair to the one the first is not at).
        llm_before, identity_before = served(replicas, LLM), served(replicas, "identity")
        for owner, session in sorted(owners.items()):
            stream = StreamCall(stub, ACME + ((SESSION_HEADER, session),))
            for n in range(3):
                await stream.send(llm_request(f"{owner}-llm-{n}", 2))
                await stream.until_finished(3 * n + 1)
                await idle(gateway)  # its upstream stream ended too: nothing loads a replica
                for pair in range(2):
                    identity.id = f"{owner}-identity-{n}-{pair}"
                    await stream.send(identity)
                await stream.until_finished(3 * n + 3)
            await stream.close()
            assert set(stream.finished.values()) == {"OK"}, stream.finished
        llm = [b - a for a, b in zip(llm_before, served(replicas, LLM), strict=True)]
        identities = [b - a for a, b in zip(identity_before, served(replicas, "identity"), strict=True)]
        assert llm == [3, 3], llm  # each session's three on its own replica
        assert identities == [6, 6], identities


async def test_a_replica_killed_fails_over_what_had_no_response_and_loses_no_call_that_had_not_started(
    replicas: list[LocalTriton], gateway: GatewayThread
) -> None:
    """One kill -9 under load (starting a vLLM replica again would cost half a minute):
    generations past their first token at the victim end UNAVAILABLE, requests of a
    ModelStreamInfer call that had no response yet go once more to the survivor and are
    served, and unary calls are served or, retried and still refused, UNAVAILABLE. The
    victim is b: the session's server, a, owns the long streams' prompt."""
    survivor, victim = replicas
    victim_name = "b"
    tenant = tenant_served_at(replicas, gateway, survivor)
    metadata = tuple(bearer(ACME_KEY).items())
    by_name = {u.name: u for u in gateway.gateway.pool.upstreams}
    llm_failovers = {
        (upstream, result): metric(gateway, "qosgate_failovers_total", model=LLM, upstream=upstream, result=result)
        for upstream in by_name
        for result in ("retried", "no_other_upstream")
    }
    owners = sessions_owned(gateway)
    async with grpc.aio.insecure_channel(gateway.url) as channel:
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        infer = kserve.ModelInfer
        payload = service_pb2.ModelInferRequest.FromString(identity_request())

        # Six long streams of one prefix: the load bound puts at least two on each replica.
        streams = [
            generation.GenerateStream(
                chat(tenant, f"Write a very long essay about harbour number {i}.", 1500),
                metadata=metadata,
                timeout=300,
            )
            for i in range(6)
        ]
        firsts = [await stream.read() for stream in streams]
        assert all(first.text for first in firsts), "every stream has its first token before the kill"
        # The victim has no more of them than the owner (the prefix's spill-over, two or
        # three), so the load bound still takes two more there.
        at_victim = by_name[victim_name]
        long_at_victim = at_victim.in_flight
        assert 2 <= long_at_victim <= by_name["a"].in_flight, {name: u.in_flight for name, u in by_name.items()}

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

        # The victim frozen, then two requests of a ModelStreamInfer call whose session the
        # victim owns, written to its connection: they have had no response when it dies.
        os.killpg(victim.pid, signal.SIGSTOP)
        try:
            stream_call = StreamCall(kserve, ACME + ((SESSION_HEADER, owners[victim_name]),))
            for n in range(2):
                await stream_call.send(llm_request(f"failover-{n}", 4))
            deadline = time.monotonic() + 30
            while at_victim.in_flight < long_at_victim + 2:
                assert time.monotonic() < deadline, at_victim.in_flight
                await asyncio.sleep(0.01)
            assert stream_call.responses == {}

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

            # Unary callers: the least loaded replica is the survivor, but those sent to the
            # frozen victim wait there until it dies.
            callers = [asyncio.ensure_future(caller()) for _ in range(8)]
            await calls_past(0, 1.0)
            before_kill = len(codes)
            # 1500 tokens outlast the wait above on any CPU: every stream still runs.
            assert not any(end.done() for end in stream_ends), [end.result() for end in stream_ends if end.done()]
        finally:
            kill_triton(victim)  # kill -9, and the shared memory it leaves in /dev/shm removed
        await calls_past(before_kill, 3.0)
        stop.set()
        await asyncio.gather(*callers)
        await stream_call.until_finished(2)
        await stream_call.close()
        assert stream_call.finished == {f"failover-{n}": "OK" for n in range(2)}
        # The victim's streams (two or three) end as its connection drops. The survivor's
        # run on: 1500 tokens take minutes on a loaded CPU, longer than their deadline at
        # times, and all that matters of them is that they did not fail; they are
        # cancelled here.
        deadline = time.monotonic() + 30
        while (
            sum(end.done() and end.result() != "OK" for end in stream_ends) < long_at_victim
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
        after = [r async for r in generation.GenerateStream(chat(tenant, "Hello?", 2), metadata=metadata, timeout=120)]
        assert after[-1].HasField("usage")
    engine_idle(survivor, "the cancelled streams still run on the session's server", timeout=60)

    assert before_kill > 0 and len(codes) > before_kill
    # Unary calls: served (on the survivor or, retried, there), or refused UNAVAILABLE only
    # after the retry; nothing else.
    assert set(codes) <= {"OK", "UNAVAILABLE"}, sorted(set(codes))
    unretried = metric(gateway, "qosgate_failovers_total", model="identity", upstream=victim_name,
                       result="no_other_upstream")
    # How many calls were at the victim when it died depends on timing (the gateway sees
    # the connection drop within milliseconds): each of those was retried, never lost.
    assert codes.count("UNAVAILABLE") <= unretried, (codes.count("UNAVAILABLE"), unretried)
    # Streams past their first token are never retried: those on the victim end
    # UNAVAILABLE. The two stream requests without a response were, once each.
    assert set(ends) <= {"OK", "UNAVAILABLE"}, ends
    assert ends.count("UNAVAILABLE") >= long_at_victim, ends
    expected = {**llm_failovers, (victim_name, "retried"): llm_failovers[(victim_name, "retried")] + 2}
    for (upstream, result), count in expected.items():
        assert metric(gateway, "qosgate_failovers_total", model=LLM, upstream=upstream, result=result) == count
