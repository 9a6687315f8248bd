"""Resource limits through the real gateway and real gRPC channels (issue 10, "Memory"):
message size, streams per tenant, a stream whose caller does not read, metric label
cardinality, a request crafted of many tiny fields, and memory after big requests.

Slow-reader and crafted-message outcomes are counted (requests Triton executed, codes
returned), not timed; the calls made beside them only carry generous deadlines.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import random
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from tritonclient.grpc import service_pb2

from conftest import free_port, require_model
from gateway_harness import ACME_KEY, GLOBEX_KEY, GatewayProcess, GatewayThread, bearer, gateway_config

pytestmark = pytest.mark.integration

MODEL = "identity"
MiB = 1 << 20
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
LIMITS = {
    "max_request_bytes": MiB,
    "connection_pending_bytes": 4 * MiB,
    "max_streams_per_tenant": 2,
    "stream_buffer_bytes": MiB,
    "stream_max_pending": 8,
}


@pytest.fixture(scope="module")
def gateway(triton) -> Iterator[GatewayThread]:
    require_model(MODEL)
    with GatewayThread(gateway_config(triton.ports.grpc_url, limits=LIMITS)) as running:
        yield running


@pytest.fixture(scope="module")
def channel(gateway) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.url) as channel:
        yield channel


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def identity_request(floats: int, request_id: str = "", model: str = MODEL) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, floats])
    request.raw_input_contents.append(np.ones(floats, dtype=np.float32).tobytes())
    return request.SerializeToString()


def infer(channel: grpc.Channel, raw: bytes, key: str = GLOBEX_KEY, timeout: float = 30.0) -> bytes:
    return channel.unary_unary(INFER)(raw, metadata=auth(key), timeout=timeout)


def executed(triton) -> int:
    """Requests of the identity model Triton has executed so far (it counts them itself)."""
    with grpcclient.InferenceServerClient(triton.ports.grpc_url) as client:
        stats = client.get_inference_statistics(MODEL, as_json=True)
    return sum(int(s["inference_stats"]["success"].get("count", 0)) for s in stats["model_stats"])


def test_a_request_over_max_request_bytes_is_refused_and_the_next_is_served(gateway) -> None:
    with grpcclient.InferenceServerClient(gateway.url) as client:
        too_big = grpcclient.InferInput("INPUT0", [1, 2 * MiB // 4], "FP32")
        too_big.set_data_from_numpy(np.ones((1, 2 * MiB // 4), dtype=np.float32))
        with pytest.raises(grpcclient.InferenceServerException) as refused:
            client.infer(MODEL, [too_big], headers=bearer(ACME_KEY))
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        small = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        small.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        assert client.infer(MODEL, [small], headers=bearer(ACME_KEY)).as_numpy("OUTPUT0").shape == (1, 4)


def test_connection_pending_bytes_reaches_the_relay(gateway) -> None:
    """The relay's bound on first messages waiting for admission is the configured one
    (test_relay.py checks the bound itself on a connection whose calls wait)."""
    relay = gateway.gateway._relay
    assert relay is not None and relay.max_connection_pending == 4 * MiB


class OpenStream:
    """A ModelStreamInfer call kept open: requests are sent one at a time, on demand."""

    def __init__(self, channel: grpc.Channel, key: str) -> None:
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self.call = channel.stream_stream(STREAM)(
            iter(self._requests.get, None), metadata=auth(key), timeout=60
        )

    def roundtrip(self, request_id: str) -> service_pb2.ModelStreamInferResponse:
        self._requests.put(identity_request(4, request_id))
        return service_pb2.ModelStreamInferResponse.FromString(next(self.call))

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def test_one_stream_over_max_streams_is_refused_with_retry_info(channel) -> None:
    streams = [OpenStream(channel, ACME_KEY) for _ in range(2)]
    try:
        for i, stream in enumerate(streams):  # answered: surely open and counted
            assert stream.roundtrip(f"s{i}").infer_response.id == f"s{i}"
        third = OpenStream(channel, ACME_KEY)
        with pytest.raises(grpc.RpcError) as refused:
            third.roundtrip("s3")
        third.close()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        rich = rpc_status.from_call(refused.value)
        assert rich is not None
        kinds = {d.type_url.rsplit("/", 1)[-1]: d for d in rich.details}
        retry, failure = error_details_pb2.RetryInfo(), error_details_pb2.QuotaFailure()
        kinds["google.rpc.RetryInfo"].Unpack(retry)
        kinds["google.rpc.QuotaFailure"].Unpack(failure)
        assert retry.retry_delay.seconds + retry.retry_delay.nanos > 0
        assert [v.description for v in failure.violations] == ["max_streams limit 2 reached"]
        # Another tenant's streams are its own.
        other = OpenStream(channel, GLOBEX_KEY)
        assert other.roundtrip("g").infer_response.id == "g"
        other.close()
    finally:
        for stream in streams:
            stream.close()
    # Closed streams are given back (the gateway notices the cancel a moment later).
    deadline = time.monotonic() + 30
    while True:
        again = OpenStream(channel, ACME_KEY)
        try:
            assert again.roundtrip("again").infer_response.id == "again"
            break
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            again.close()


async def _refused_as_they_open(url: str, raw: bytes, calls: int) -> collections.Counter[str]:
    """`calls` ModelStreamInfer calls at once through grpcio's asyncio client, each
    writing one request as soon as it is opened and half-closing (tritonclient's aio
    stream_infer does the same): the codes they end with."""
    codes: collections.Counter[str] = collections.Counter()

    async def one(channel: grpc.aio.Channel) -> None:
        call = channel.stream_stream(STREAM)(metadata=auth(ACME_KEY), timeout=30)
        try:
            await call.write(raw)
            await call.done_writing()
            async for _ in call:
                pass
            codes["OK"] += 1
        except grpc.aio.AioRpcError as e:
            codes[e.code().name] += 1

    async with grpc.aio.insecure_channel(url) as channel:
        await asyncio.gather(*(one(channel) for _ in range(calls)))
    return codes


def test_streams_refused_as_they_open_reach_an_asyncio_client_with_their_status(channel, gateway) -> None:
    """A stream refused before its caller half-closed used to be answered at once, and
    grpcio's asyncio client turned the write or half-close it made after that answer
    into INTERNAL "Internal error from Core" (grpc/grpc#36066): 431 of some 3,000
    refusals of a flood through the gateway read INTERNAL instead of RESOURCE_EXHAUSTED."""
    streams = [OpenStream(channel, ACME_KEY) for _ in range(2)]
    try:
        for i, stream in enumerate(streams):  # the tenant's two streams are open
            assert stream.roundtrip(f"s{i}").infer_response.id == f"s{i}"
        codes = asyncio.run(_refused_as_they_open(gateway.url, identity_request(4, "r"), calls=200))
    finally:
        for stream in streams:
            stream.close()
    assert codes == {"RESOURCE_EXHAUSTED": 200}, codes


async def _closed_loop_streams(url: str, raw: bytes, *, streams: int, seconds: float) -> collections.Counter[str]:
    """`streams` callers, each opening ModelStreamInfer streams one after another and
    sending on each until it ends (deadlines of 20-300 ms: most end at their deadline,
    some while Triton's answer is on its way); refused ones retry after 10 ms."""
    codes: collections.Counter[str] = collections.Counter()
    until = time.monotonic() + seconds

    async def caller(channel: grpc.aio.Channel) -> None:
        while time.monotonic() < until:
            call = channel.stream_stream(STREAM)(metadata=auth(ACME_KEY), timeout=random.uniform(0.02, 0.3))
            try:
                while True:
                    await call.write(raw)
                    if await call.read() is grpc.aio.EOF:
                        break
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
                if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.01)
            except asyncio.InvalidStateError:  # wrote after the status came: counted by its read
                codes["ended"] += 1
            finally:
                call.cancel()

    async with grpc.aio.insecure_channel(url) as channel:
        await asyncio.gather(*(caller(channel) for _ in range(streams)))
    return codes


def test_streams_over_max_streams_ending_at_their_deadlines_are_each_answered_once(gateway, caplog) -> None:
    """A bench on main (64 closed-loop streams, max_streams 32) logged `UsageError: Abort
    already called!`: a stream passing Triton's DEADLINE_EXCEEDED on raced its caller's
    own deadline, grpc failed to send that abort's status, and the edge took the send
    error for a new failure and aborted the call a second time."""
    caplog.set_level(logging.ERROR)
    codes = asyncio.run(_closed_loop_streams(gateway.url, identity_request(4, "r"), streams=32, seconds=10))
    assert codes["RESOURCE_EXHAUSTED"] and codes["DEADLINE_EXCEEDED"], codes
    twice = [r for r in caplog.records if "UsageError" in r.getMessage() or "Abort already called" in r.getMessage()]
    assert not twice, twice[0].getMessage()
    # Every stream is given back (the gateway notices the cancels a moment later).
    deadline = time.monotonic() + 30
    while gateway.gateway.streams.open_streams("acme"):
        assert time.monotonic() < deadline, "streams still counted open"
        time.sleep(0.1)


def test_a_stream_that_is_not_read_stops_pulling_from_triton_and_slows_no_one_else(
    triton, channel
) -> None:
    sent = 1500
    before = executed(triton)
    requests = (identity_request(16 * 1024, str(i)) for i in range(sent))  # 64 KiB each
    call = channel.stream_stream(STREAM)(requests, metadata=auth(ACME_KEY), timeout=300)
    try:
        # Nothing is read from `call`: wait until Triton stops executing its requests.
        settled, last = 0, -1
        deadline = time.monotonic() + 120
        while settled < 5 and time.monotonic() < deadline:
            time.sleep(0.4)
            now = executed(triton) - before
            settled = settled + 1 if now == last else 0
            last = now
        assert settled == 5, f"Triton kept executing the unread stream's requests: {last}"
        # Bounded by the stream's buffer (1 MiB = 16 responses), its pending requests (8)
        # and the HTTP/2 windows in between; without backpressure all 1500 run.
        assert last < 300, f"{last} of {sent} requests pulled through for a caller that reads nothing"
        # The stalled stream holds no dispatch slot: another tenant is served.
        for _ in range(20):
            assert infer(channel, identity_request(4), timeout=10)
        # Nothing was lost: once read, every request is answered, in full.
        got = [service_pb2.ModelStreamInferResponse.FromString(r) for r in call]
        assert [g.error_message for g in got if g.error_message] == []
        assert sorted(int(g.infer_response.id) for g in got) == list(range(sent))
    finally:
        call.cancel()


def test_model_labels_are_bounded_to_models_that_exist(gateway, channel) -> None:
    for i in range(50):  # acme may call any name; none of these exist
        with pytest.raises(grpc.RpcError):
            infer(channel, identity_request(4, model=f"nosuch-{i}"), ACME_KEY)
    with pytest.raises(grpc.RpcError) as denied:  # globex may call identity only
        infer(channel, identity_request(4, model="secret-model"), GLOBEX_KEY)
    assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert infer(channel, identity_request(4), ACME_KEY)
    url = f"http://127.0.0.1:{gateway.gateway.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    models = set(re.findall(r'model="([^"]*)"', text))
    assert not [m for m in models if m.startswith("nosuch") or m == "secret-model"], models
    assert {"identity", "_other"} <= models


def test_a_request_of_many_tiny_fields_is_refused_without_stalling_another_tenant(channel) -> None:
    # ~4 MB of 2-byte fields (1.3M of them) after a valid head; under the 1 MiB limit
    # here, so 1 MB: 500k fields, which took the old reader about a second each.
    crafted = service_pb2.ModelInferRequest(model_name=MODEL).SerializeToString()
    crafted += b"\x78\x01" * ((MiB - len(crafted) - 64) // 2)
    codes: list[grpc.StatusCode] = []

    def attack() -> None:
        for _ in range(10):
            try:
                infer(channel, crafted, ACME_KEY)
            except grpc.RpcError as e:
                codes.append(e.code())
                assert "more than 4096 fields" in (e.details() or "")

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        # Each call gets a deadline the old reader's stalls (about ten seconds in all)
        # would blow: the loop must keep serving this tenant.
        for _ in range(30):
            assert infer(channel, identity_request(4), GLOBEX_KEY, timeout=3)
    finally:
        attacker.join(timeout=60)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 10


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_returns_near_baseline_after_100_mib_requests_and_20000_ordinary_ones(
    triton, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_model(MODEL)
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": "127.0.0.1:0",
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
        "usage_db": str(tmp_path / "usage.sqlite3"),
        "batch": {"db": str(tmp_path / "batch.sqlite3")},
        "tenants": [{"name": "acme", "api_keys": [{"key": ACME_KEY}]}],
        "limits": {"max_request_bytes": 128 * MiB, "max_response_bytes": 128 * MiB},
    }
    with GatewayProcess.running(config, tmp_path) as gateway:
        assert gateway.proc is not None
        pid = gateway.proc.pid
        with grpcclient.InferenceServerClient(gateway.target) as client:
            small = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            small.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
            for _ in range(200):  # warm up: channels, caches, the allocator's arenas
                client.infer(MODEL, [small], headers=bearer(ACME_KEY))
            baseline = _rss_mb(pid)
            big = grpcclient.InferInput("INPUT0", [1, 25 * MiB], "FP32")  # 100 MiB
            big.set_data_from_numpy(np.ones((1, 25 * MiB), dtype=np.float32))
            for _ in range(3):
                reply = client.infer(MODEL, [big], headers=bearer(ACME_KEY))
                assert reply.as_numpy("OUTPUT0").nbytes == 100 * MiB
                del reply
            # Failed calls too: their errors must not keep the request alive in a cycle.
            for _ in range(3):
                with pytest.raises(grpcclient.InferenceServerException):
                    client.infer("no-such-model", [big], headers=bearer(ACME_KEY))
            # The heap is trimmed a moment after the last large message.
            after_big = _settled_growth(pid, baseline)
        # Then many ordinary calls from several threads: nothing may accumulate per call.
        with grpc.insecure_channel(gateway.target) as channel:
            raw = identity_request(16)

            def ordinary(calls: int) -> None:
                for _ in range(calls):
                    infer(channel, raw, ACME_KEY)

            workers = [threading.Thread(target=ordinary, args=(ORDINARY_CALLS // 8,)) for _ in range(8)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        after_ordinary = _settled_growth(pid, baseline)
    with capsys.disabled():
        print(
            f"\ngateway RSS: baseline {baseline:.0f} MB; +{after_big:.0f} MB after 3 x 100 MiB served and 3 "
            f"failed; +{after_ordinary:.0f} MB after {ORDINARY_CALLS} ordinary calls more"
        )
    assert after_big <= 40, f"gateway RSS still {after_big:.0f} MB above its baseline of {baseline:.0f} MB"
    assert after_ordinary <= 40, f"gateway RSS {after_ordinary:.0f} MB above its baseline after ordinary calls"


ORDINARY_CALLS = 20_000


def _settled_growth(pid: int, baseline: float) -> float:
    """RSS above `baseline` once it is back within 40 MB, or after 30 s of waiting for that."""
    deadline = time.monotonic() + 30
    while (grown := _rss_mb(pid) - baseline) > 40 and time.monotonic() < deadline:
        time.sleep(0.5)
    return grown
