"""The HTTP/2 relay (qosgate.relay) in front of a real Triton, through real clients.

A test policy stands in for the gateway's: it forwards most calls untouched, refuses the
tenant `over-quota` with RESOURCE_EXHAUSTED and RetryInfo, appends Triton parameters and a
new request id for `tagged`, and holds `slow` callers forever (a queue that never moves).
Every KServe RPC must behave exactly as against Triton itself.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import socket
import threading
import time

import grpc
import ngh2
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from conftest import require_model
from relay_harness import RelayThread
from test_gateway_perf_analyzer import PERF_ANALYZER, perf_analyzer
from qosgate.transport import http2
from qosgate.relay.policy import CallEnd, CallHead, Decision, Forward
from qosgate.transport.status import RESOURCE_EXHAUSTED, Refuse
from qosgate.relay.server import CALLS_PER_PASS
from qosgate.kserve import wire

pytestmark = pytest.mark.integration

MODEL = "identity"
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _quota_details() -> bytes:
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=3))
    detail = any_pb2.Any()
    detail.Pack(retry)
    return status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED, message="over quota", details=[detail]
    ).SerializeToString()


class KeyedPolicy:
    """Decides by `x-api-key`; records what it saw and how forwarded calls ended."""

    def __init__(self) -> None:
        self.heads: list[CallHead] = []
        self.ends: list[CallEnd] = []
        self.held_cancelled = threading.Event()

    def __call__(self, head: CallHead) -> Decision | asyncio.Future[Decision]:
        self.heads.append(head)
        key = http2.last_header(head.headers, b"x-api-key")
        if key == b"over-quota":
            return Refuse(RESOURCE_EXHAUSTED, "over quota", details=_quota_details())
        if key == b"tagged":
            return Forward(
                append=wire.priority_fragment(1) + wire.len_field(3, b"tagged-by-relay"),  # the id (field 3)
                set_headers=((b"x-relay", b"1"),),
                on_finish=self.ends.append,
            )
        if key == b"slow":
            return asyncio.ensure_future(self._never())
        return Forward(on_finish=self.ends.append)

    async def _never(self) -> Decision:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.held_cancelled.set()
            raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def policy() -> KeyedPolicy:
    return KeyedPolicy()


@pytest.fixture(scope="module")
def relay(triton, policy) -> RelayThread:
    require_model(MODEL)
    with RelayThread(triton.ports.grpc_url, policy) as running:
        yield running


def _inputs(values: np.ndarray) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return [tensor]


def _values(n: int = 8) -> np.ndarray:
    return np.arange(n, dtype=np.float32).reshape(1, n)


def _upstream_streams(relay: RelayThread) -> list[int]:
    """The next stream id of every upstream connection: moves only when a call goes up."""
    assert relay.relay is not None
    return [c.h2._conn.next_stream_id for route in relay.relay.routes for c in route.pool._connections]


def _inference_count(triton_url: str) -> int:
    stats = grpcclient.InferenceServerClient(triton_url).get_inference_statistics(MODEL)
    return stats.model_stats[0].inference_stats.success.count


def test_unary_and_metadata_rpcs_as_through_triton(relay, policy, triton) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    direct = grpcclient.InferenceServerClient(triton.ports.grpc_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert client.get_server_metadata() == direct.get_server_metadata()
    assert client.get_model_metadata(MODEL) == direct.get_model_metadata(MODEL)
    assert client.get_model_config(MODEL) == direct.get_model_config(MODEL)
    assert client.get_model_repository_index() == direct.get_model_repository_index()
    values = _values()
    before = len(policy.ends)
    result = client.infer(MODEL, _inputs(values), request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    assert result.get_response().id == "r1"
    # The policy read the model name from the first message's bytes.
    infer_heads = [h for h in policy.heads if h.path.endswith(b"/ModelInfer")]
    assert wire.peek_request(infer_heads[-1].first_message, 4096).model_name == MODEL
    end = policy.ends[before]
    assert (end.status, end.reset_code, end.requests, end.responses) == (0, None, 1, 1)


def test_upstream_errors_byte_for_byte(relay, triton) -> None:
    def failure(url: str) -> grpc.RpcError:
        with grpc.insecure_channel(url) as channel:
            call = channel.unary_unary(INFER)
            request = service_pb2.ModelInferRequest(model_name="no-such-model").SerializeToString()
            with pytest.raises(grpc.RpcError) as caught:
                call(request)
            return caught.value

    direct, relayed = failure(triton.ports.grpc_url), failure(relay.url)
    assert relayed.code() == direct.code() == grpc.StatusCode.NOT_FOUND
    assert relayed.details() == direct.details()
    assert relayed.trailing_metadata() == direct.trailing_metadata()


async def test_aio_client(relay) -> None:
    async with aioclient.InferenceServerClient(relay.url) as client:
        assert await client.is_model_ready(MODEL)
        values = _values(16)
        results = await asyncio.gather(*(client.infer(MODEL, _inputs(values)) for _ in range(20)))
        for result in results:
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


async def test_a_burst_of_calls_on_one_connection_is_answered_whole(relay) -> None:
    # Far more calls at once than the relay starts per pass for one connection: the rest
    # wait for later passes, in order, and each is answered with its own data.
    count = 25 * CALLS_PER_PASS
    async with aioclient.InferenceServerClient(relay.url) as client:
        calls = asyncio.gather(*(client.infer(MODEL, _inputs(_values(4) + i), request_id=str(i)) for i in range(count)))
        results = await asyncio.wait_for(calls, timeout=60)
    for i, result in enumerate(results):
        assert result.get_response().id == str(i)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), _values(4) + i)


def test_stream_with_many_requests_in_flight(relay) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)))
    try:
        for i in range(64):
            client.async_stream_infer(MODEL, _inputs(_values(4) + i), request_id=f"s{i}")
        seen = {}
        for _ in range(64):
            result, error = answers.get(timeout=30)
            assert error is None, error
            seen[result.get_response().id] = result.as_numpy("OUTPUT0")
    finally:
        client.stop_stream()
    assert sorted(seen) == sorted(f"s{i}" for i in range(64))
    np.testing.assert_array_equal(seen["s7"], _values(4) + 7)


def test_refusal_is_answered_without_an_upstream_call(relay, triton) -> None:
    streams, count = _upstream_streams(relay), _inference_count(triton.ports.grpc_url)
    request = service_pb2.ModelInferRequest(model_name=MODEL).SerializeToString()
    with grpc.insecure_channel(relay.url) as channel:
        call = channel.unary_unary(INFER)
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, metadata=(("x-api-key", "over-quota"),))
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "over quota"
    status = rpc_status.from_call(error)
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry)
    assert retry.retry_delay.seconds == 3
    with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED"):
        grpcclient.InferenceServerClient(relay.url).infer(
            MODEL, _inputs(_values()), headers={"x-api-key": "over-quota"}
        )
    assert _upstream_streams(relay) == streams
    assert _inference_count(triton.ports.grpc_url) == count


@pytest.mark.parametrize("size", [64, 1 << 18])  # one DATA frame; 1 MiB in many
@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_appended_fields_reach_triton(relay, policy, compression, size) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    values = _values(size)
    result = client.infer(
        MODEL,
        _inputs(values),
        request_id="caller-id",
        headers={"x-api-key": "tagged"},
        compression_algorithm=compression,
    )
    # Triton echoes the request id: the appended one replaced the caller's.
    assert result.get_response().id == "tagged-by-relay"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    assert policy.ends[-1].status == 0


def test_compressed_calls_pass_through(relay) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    values = _values(256)
    for algorithm in ("gzip", "deflate"):
        result = client.infer(MODEL, _inputs(values), compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


def test_deadline_while_the_policy_holds_the_call(relay, policy) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    policy.held_cancelled.clear()
    with grpc.insecure_channel(relay.url) as channel:
        call = channel.unary_unary(INFER)
        request = service_pb2.ModelInferRequest(model_name=MODEL).SerializeToString()
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=0.3, metadata=(("x-api-key", "slow"),))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The relay stopped the policy's wait (a scheduler slot would be given back).
    assert policy.held_cancelled.wait(10)
    assert client.is_server_live()


def test_health_and_other_services_reach_the_local_grpcio_server(relay) -> None:
    with grpc.insecure_channel(relay.url) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/qosgate.v1.Nothing/Here")(b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_message_size_bound(triton, policy) -> None:
    with RelayThread(triton.ports.grpc_url, policy, max_message_size=1 << 16) as small:
        streams = _upstream_streams(small)
        client = grpcclient.InferenceServerClient(small.url)
        with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED"):
            client.infer(MODEL, _inputs(_values(1 << 15)))  # 128 KiB of tensor
        np.testing.assert_array_equal(client.infer(MODEL, _inputs(_values())).as_numpy("OUTPUT0"), _values())
        assert _upstream_streams(small)[0] - streams[0] == 2  # only the small call went up


def test_response_size_bound(triton, policy) -> None:
    with RelayThread(triton.ports.grpc_url, policy, max_response_size=1 << 16) as small:
        client = grpcclient.InferenceServerClient(small.url)
        with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED") as refused:
            client.infer(MODEL, _inputs(_values(1 << 15)))  # 128 KiB back from Triton
        assert "over the limit of 65536" in refused.value.message()
        np.testing.assert_array_equal(client.infer(MODEL, _inputs(_values())).as_numpy("OUTPUT0"), _values())


def _own_channel(url: str) -> grpc.Channel:
    """A channel on a TCP connection of its own (grpcio shares subchannels otherwise)."""
    return grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])


def test_first_messages_waiting_for_the_policy_are_bounded_per_connection(triton, policy) -> None:
    """One connection opens many calls whose policy never decides, each with a first
    message near the size limit. Those bytes are read and acknowledged before the decision,
    so the caller's window does not bound them: the relay holds at most
    `max_connection_pending` of them and refuses the calls that would go over it
    RESOURCE_EXHAUSTED. A small call on that connection and calls on another go on, and the
    count goes back to zero as the held calls end."""
    bound = 4 << 20
    floats = 230_000  # 920 KB of tensor: four fit under the bound, the fifth does not
    big = service_pb2.ModelInferRequest(model_name=MODEL)
    big.inputs.add(name="INPUT0", datatype="FP32", shape=[1, floats])
    big.raw_input_contents.append(np.ones(floats, dtype=np.float32).tobytes())
    small = service_pb2.ModelInferRequest(model_name=MODEL)
    small.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 8])
    small.raw_input_contents.append(_values().tobytes())
    with RelayThread(triton.ports.grpc_url, policy, max_message_size=1 << 20, max_connection_pending=bound) as relay:
        assert relay.relay is not None
        clients = relay.relay.clients

        def pending() -> list[int]:
            return [c.pending_bytes for c in list(clients)]

        with _own_channel(relay.url) as hostile, _own_channel(relay.url) as other:
            call = hostile.unary_unary(INFER)
            held = [
                call.future(big.SerializeToString(), timeout=120, metadata=(("x-api-key", "slow"),))
                for _ in range(12)
            ]
            deadline = time.monotonic() + 30
            while sum(f.done() for f in held) < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # no call that is still held ends on its own
            refused = [f for f in held if f.done()]
            waiting = [f for f in held if not f.done()]
            assert 8 <= len(refused) <= 11 and 1 <= len(waiting) <= 4
            for f in refused:
                error = f.exception()
                assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "waiting on this connection" in error.details()
            counted = pending()
            assert max(counted) <= bound and sum(counted) >= len(waiting) * floats * 4
            # The hostile connection's small calls still fit, and others are not touched.
            for channel in (hostile, other):
                reply = service_pb2.ModelInferResponse.FromString(
                    channel.unary_unary(INFER)(small.SerializeToString(), timeout=30)
                )
                np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), _values()[0])
            policy.held_cancelled.clear()
            for f in waiting:
                f.cancel()
            assert policy.held_cancelled.wait(10)
            deadline = time.monotonic() + 10
            while any(pending()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(pending()), pending()  # the cancelled calls gave their bytes back


def test_cancel_reaches_triton(relay, triton) -> None:
    client = grpcclient.InferenceServerClient(relay.url)
    client.update_log_settings({"log_verbose_level": 1})
    try:
        answers: queue.Queue[tuple[object, object]] = queue.Queue()
        client.start_stream(lambda result, error: answers.put((result, error)))
        client.async_stream_infer(MODEL, _inputs(_values()), request_id="before-cancel")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "before-cancel"
        client.stop_stream(cancel_requests=True)  # RST_STREAM(CANCEL) to the relay
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if re.search(r"Cancellation notification received for ModelStreamInferHandler", triton.log_tail(200)):
                break
            time.sleep(0.1)
        else:
            pytest.fail("Triton never saw the stream cancelled:\n" + triton.log_tail(40))
    finally:
        client.update_log_settings({"log_verbose_level": 0})


def test_a_caller_that_cancels_every_call_keeps_its_connection(relay) -> None:
    """Cancelling is ordinary gRPC (a deadline, a caller done with a stream): one that
    resets thousands of live streams, faster than nghttp2's rapid-reset guard allows by
    default (1,000 at once, then 33/s), keeps its connection, as at Triton."""
    message = service_pb2.ModelInferRequest(model_name=MODEL, inputs=[_inputs(_values())[0]._get_tensor()])
    message.raw_input_contents.append(_values().tobytes())
    body = message.SerializeToString()
    framed = b"\0" + len(body).to_bytes(4, "big") + body
    conn = ngh2.Connection(ngh2.Role.CLIENT, ngh2.Configuration())
    conn.initiate_connection({})
    sock = socket.create_connection(("127.0.0.1", relay.port))
    sock.settimeout(0.005)
    events: list[ngh2.Event] = []

    def exchange() -> None:
        sock.sendall(conn.data_to_send())
        while True:
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                return
            assert data, "the relay closed the connection"
            conn.receive_data(data)
            events.extend(conn.events())

    def headers(method: str) -> list[tuple[bytes, bytes]]:
        return [(b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/inference.GRPCInferenceService/{method}".encode()),
                (b":authority", b"relay"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip

    try:
        for _ in range(100):  # 2,000 streams, 20 at a time, each reset while its call runs
            streams = [conn.send_request(headers("ModelStreamInfer")) for _ in range(20)]
            for stream in streams:
                conn.send_data(stream, framed)  # our half stays open: the stream is live
            exchange()
            for stream in streams:
                conn.reset_stream(stream, int(ngh2.ErrorCode.CANCEL))
            exchange()
            assert not any(isinstance(e, ngh2.GoAwayReceived) for e in events)
        # The same connection still serves calls.
        last = conn.send_request(headers("ModelInfer"))
        conn.send_data(last, framed, end_stream=True)
        deadline = time.monotonic() + 30
        while not any(isinstance(e, ngh2.TrailersReceived) and e.stream_id == last for e in events):
            assert time.monotonic() < deadline, "no answer on the connection after the resets"
            exchange()
    finally:
        sock.close()
    (trailers,) = [e for e in events if isinstance(e, ngh2.TrailersReceived) and e.stream_id == last]
    assert http2.header(trailers.headers, b"grpc-status") == b"0"


def test_a_connection_that_nghttp2_ends_is_logged(relay, caplog) -> None:
    """nghttp2 ends a connection itself, GOAWAY and all, when a guard against abusive peers
    trips; the relay says so, since the caller's calls end with it. Here the guard is the
    glitch bucket (10,000 at once, then 330/s), and each PRIORITY frame is one."""
    conn = ngh2.Connection(ngh2.Role.CLIENT, ngh2.Configuration())
    conn.initiate_connection({})
    # PRIORITY (type 2), 5 bytes: no dependency, weight 16; one per idle stream.
    priorities = b"".join(
        b"\0\0\x05\x02\0" + stream.to_bytes(4, "big") + b"\0\0\0\0\x0f" for stream in range(1, 24_000, 2)
    )
    received = bytearray()
    with caplog.at_level(logging.WARNING), socket.create_connection(("127.0.0.1", relay.port)) as sock:
        sock.settimeout(30)
        sock.sendall(conn.data_to_send() + priorities)
        try:
            while chunk := sock.recv(1 << 16):  # until the relay closes the connection
                received += chunk
        except ConnectionResetError:
            pass  # closed with some of our frames unread: the GOAWAY may be lost with them
    conn.receive_data(bytes(received))
    goaways = [e for e in conn.events() if isinstance(e, ngh2.GoAwayReceived)]
    assert [e.error_code for e in goaways] in ([ngh2.ErrorCode.ENHANCE_YOUR_CALM], [])
    # The warning is written before the connection closes.
    assert "nghttp2 ended the HTTP/2 connection" in caplog.text
    assert "a guard against abusive peers tripped" in caplog.text


def test_slow_reader_is_bounded_and_slows_only_itself(relay) -> None:
    """A raw HTTP/2 client that never opens its window: the relay takes no more of its
    response from Triton than one stream window, and other calls go on meanwhile."""
    values = np.arange(1 << 20, dtype=np.float32).reshape(1, -1)  # 4 MiB in, 4 MiB out
    request = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    request.set_data_from_numpy(values)
    message = service_pb2.ModelInferRequest(model_name=MODEL, inputs=[request._get_tensor()])
    message.raw_input_contents.append(values.tobytes())
    body = message.SerializeToString()

    conn = ngh2.Connection(ngh2.Role.CLIENT, ngh2.Configuration(auto_window_update=False))
    conn.initiate_connection({ngh2.Setting.INITIAL_WINDOW_SIZE: 16384})
    sock = socket.create_connection(("127.0.0.1", relay.port))
    sock.settimeout(0.05)
    stream = conn.send_request(
        [(b":method", b"POST"), (b":scheme", b"http"), (b":path", INFER.encode()),
         (b":authority", b"relay"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    )  # fmt: skip
    conn.send_data(stream, len(body).to_bytes(5, "big") + body, end_stream=True)
    received = bytearray()
    done = False

    def exchange() -> None:
        nonlocal done
        sock.sendall(conn.data_to_send())
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            return
        conn.receive_data(data)
        for event in conn.events():
            if isinstance(event, ngh2.DataReceived):
                received.extend(event.data)
            elif isinstance(event, ngh2.TrailersReceived | ngh2.StreamClosed):
                done = True

    def relayed_call():
        assert relay.relay is not None
        for client in relay.relay.clients:
            call = client.calls.get(stream)
            if call is not None and call.response is not None and call.response.unacked:
                return call
        return None

    try:
        # Read until the relay holds part of the response: it is stuck on our window.
        deadline = time.monotonic() + 30
        while relayed_call() is None and time.monotonic() < deadline:
            exchange()
        call = relayed_call()
        assert call is not None, "the response never started"
        for _ in range(20):  # it stays stuck, bounded, while we keep not reading
            exchange()
            assert call.response is not None and call.response.unacked <= http2.STREAM_WINDOW
        assert len(received) <= 16384 and not done
        # Meanwhile other calls through the same upstream connections go on.
        client = grpcclient.InferenceServerClient(relay.url)
        np.testing.assert_array_equal(client.infer(MODEL, _inputs(_values())).as_numpy("OUTPUT0"), _values())
        # Now read: the whole response arrives, intact.
        acknowledged = 0
        deadline = time.monotonic() + 60
        while not done and time.monotonic() < deadline:
            if len(received) > acknowledged:
                conn.acknowledge_received_data(len(received) - acknowledged, stream)
                acknowledged = len(received)
            exchange()
        assert done
    finally:
        sock.close()
    reply = service_pb2.ModelInferResponse.FromString(bytes(received[5:]))
    assert reply.raw_output_contents[0] == values.tobytes()


@pytest.mark.parametrize("mode", [(), ("--async",), ("--streaming",)], ids=["sync", "async", "streaming"])
def test_perf_analyzer(relay, policy, mode) -> None:
    assert PERF_ANALYZER.exists(), f"perf_analyzer missing at {PERF_ANALYZER}: run `make tools`"
    before, heads_before = len(policy.ends), len(policy.heads)
    run = perf_analyzer(relay, "-m", MODEL, "--shape=INPUT0:16", "--concurrency-range=4", *mode)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout
    # A call's end is recorded once the bytes that ended it are written (and, for a stream,
    # once the relay reads perf_analyzer's reset), which may be after perf_analyzer exits.
    deadline = time.monotonic() + 10
    while len(policy.ends) - before < len(policy.heads) - heads_before and time.monotonic() < deadline:
        time.sleep(0.02)
    ends = policy.ends[before:]
    assert len(ends) == len(policy.heads) - heads_before, "calls that never ended"
    if mode == ("--streaming",):
        # One call per stream, many requests each, answered (at most the 4 in flight at
        # the end missing); perf_analyzer cancels its streams when done (RST_STREAM CANCEL).
        streams = [e for e in ends if e.requests > 1]
        assert streams and all(
            e.reset_code == 8 and 0 <= e.requests - e.responses <= 4 for e in streams
        ), streams
    else:
        assert ends and all(end.status == 0 for end in ends), [e for e in ends if e.status != 0]
