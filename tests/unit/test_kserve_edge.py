"""The KServe edge against an in-process fake Triton: what arrives upstream, and what the
caller gets back, over real gRPC channels.

The fake records each request as Triton would parse it (protobuf merge semantics), so the
appended priority/timeout/id fragments are checked end to end, and it reports when its
stream is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tempfile
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from qosgate.app import Gateway
from qosgate.config import parse_config

KEY = "unit-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers ModelInfer at once; in streams sends `chunks` responses per request, then
    (as a decoupled model that ends without a response) an empty final one if asked."""

    def __init__(self, chunks: int = 2, endless: bool = False) -> None:
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.time_remaining: list[float | None] = []
        self.stream_cancelled = asyncio.Event()
        self.stream_time_remaining: list[float | None] = []
        self.chunks = chunks
        self.endless = endless

    async def ServerLive(self, request, context):  # noqa: N802 - the RPC's name
        return service_pb2.ServerLiveResponse(live=True)

    async def ModelInfer(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        return service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        self.stream_time_remaining.append(context.time_remaining())
        try:
            async for request in request_iterator:
                self.requests.append(request)
                count = 10**9 if self.endless else self.chunks
                for _ in range(count):
                    response = service_pb2.ModelStreamInferResponse()
                    response.infer_response.id = request.id
                    response.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
                    response.infer_response.parameters["triton_final_response"].bool_param = False
                    await context.write(response)
                    if self.endless:
                        await asyncio.sleep(0.01)
                if request.parameters["triton_enable_empty_final_response"].bool_param:
                    final = service_pb2.ModelStreamInferResponse()
                    final.infer_response.id = request.id
                    final.infer_response.parameters["triton_final_response"].bool_param = True
                    await context.write(final)
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise


async def one_request_then_wait(request_id: str) -> AsyncIterator[service_pb2.ModelInferRequest]:
    """A stream's requests: one, then none while the stream stays open."""
    yield service_pb2.ModelInferRequest(model_name="m", id=request_id)
    await asyncio.Event().wait()


class EdgeStub(service_pb2_grpc.GRPCInferenceServiceStub):
    """The KServe stub plus the health stub, on one channel to the gateway."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.health = health_pb2_grpc.HealthStub(channel)


@contextlib.asynccontextmanager
async def gateway_before(
    fake: FakeTriton,
    on_upstream: Callable[[grpc.aio.Server], None] = lambda _server: None,
    limits: dict[str, int] | None = None,
) -> AsyncIterator[EdgeStub]:
    upstream = grpc.aio.server()
    on_upstream(upstream)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, upstream)
    port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    state = tempfile.TemporaryDirectory(prefix="qosgate-edge-")
    config = parse_config(
        {
            "listen": "127.0.0.1:0",
            "usage_db": f"{state.name}/usage.sqlite3",
            "batch": {"db": f"{state.name}/batch.sqlite3"},
            "upstreams": [{"name": "fake", "url": f"127.0.0.1:{port}"}],
            "tenants": [{"name": "t", "api_keys": [{"key": KEY}], "max_class": "critical"}],
            "limits": limits or {},
            "openai": {"listen": "127.0.0.1:0"},  # not the default 8080: `make run` may hold it
        }
    )
    gateway = Gateway(config, serve_metrics=False, health_check_interval_s=0.1)
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            yield EdgeStub(channel)
    finally:
        await gateway.stop(grace_s=0)
        await upstream.stop(None)
        state.cleanup()


async def test_priority_and_timeout_reach_triton_and_override_the_callers() -> None:
    fake = FakeTriton()
    async with gateway_before(fake) as stub:
        request = service_pb2.ModelInferRequest(model_name="m", id="a")
        request.parameters["priority"].uint64_param = 4  # the caller's own wish loses
        request.parameters["custom"].string_param = "kept"
        metadata = AUTH + (("x-priority", "critical"),)
        reply = await stub.ModelInfer(request, metadata=metadata, timeout=20)
    assert reply.id == "a"
    seen = fake.requests[0]
    assert seen.parameters["priority"].uint64_param == 1  # critical = level 1
    timeout_us = seen.parameters["timeout"].int64_param
    assert 15_000_000 < timeout_us <= 20_000_000
    assert seen.parameters["custom"].string_param == "kept"
    # The gRPC deadline travels too. On the wire it is a `grpc-timeout` header that gRPC
    # rounds up (seen: 20.0995 s of a 20 s deadline), so allow that much above it.
    assert fake.time_remaining[0] is not None and 15 < fake.time_remaining[0] <= 20.5


async def test_without_a_deadline_no_timeout_is_set() -> None:
    fake = FakeTriton()
    async with gateway_before(fake) as stub:
        await stub.ModelInfer(service_pb2.ModelInferRequest(model_name="m"), metadata=AUTH)
    assert "timeout" not in fake.requests[0].parameters
    assert fake.requests[0].parameters["priority"].uint64_param == 3  # default class standard


@pytest.mark.parametrize("caller_wants_empty_final", [False, True])
async def test_stream_requests_and_responses_pass_as_sent(caller_wants_empty_final: bool) -> None:
    """Each request of a stream reaches Triton as the caller sent it (its id, its own
    empty-final choice; only priority and timeout are set), and Triton's responses come
    back as Triton wrote them."""
    fake = FakeTriton(chunks=2)
    async with gateway_before(fake) as stub:
        requests = []
        for rid in ("x", "y"):
            request = service_pb2.ModelInferRequest(model_name="m", id=rid)
            if caller_wants_empty_final:
                request.parameters["triton_enable_empty_final_response"].bool_param = True
            requests.append(request)
        responses = [r async for r in stub.ModelStreamInfer(iter(requests), metadata=AUTH, timeout=20)]
    assert sorted(r.id for r in fake.requests) == ["x", "y"]
    flags = {r.parameters["triton_enable_empty_final_response"].bool_param for r in fake.requests}
    assert flags == {caller_wants_empty_final}
    per_id = {rid: [r for r in responses if r.infer_response.id == rid] for rid in ("x", "y")}
    expected = 3 if caller_wants_empty_final else 2
    assert [len(v) for v in per_id.values()] == [expected, expected]
    assert len(responses) == 2 * expected


async def test_closing_the_stream_cancels_the_upstream_stream() -> None:
    fake = FakeTriton(endless=True)
    async with gateway_before(fake) as stub:
        call = stub.ModelStreamInfer(one_request_then_wait("long"), metadata=AUTH)
        received = 0
        async for response in call:
            assert response.infer_response.id == "long"
            received += 1
            if received == 3:
                call.cancel()
                break
        await asyncio.wait_for(fake.stream_cancelled.wait(), timeout=10)


async def test_cancelling_a_unary_call_cancels_upstream() -> None:
    release = asyncio.Event()
    cancelled = asyncio.Event()

    class SlowTriton(FakeTriton):
        async def ModelInfer(self, request, context):  # noqa: N802
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return service_pb2.ModelInferResponse()

    async with gateway_before(SlowTriton()) as stub:
        call = stub.ModelInfer(service_pb2.ModelInferRequest(model_name="m"), metadata=AUTH)
        await asyncio.sleep(0.3)
        call.cancel()
        await asyncio.wait_for(cancelled.wait(), timeout=10)


async def test_stream_refusal_in_band_or_as_status_with_triton_grpc_error() -> None:
    fake = FakeTriton()
    request = service_pb2.ModelInferRequest(model_name="m", id="r9")
    async with gateway_before(fake) as stub:
        metadata = AUTH + (("x-priority", "gold"),)
        responses = [r async for r in stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=20)]
        assert [(r.infer_response.id, r.error_message.split(":")[0]) for r in responses] == [
            ("r9", "INVALID_ARGUMENT")
        ]
        call = stub.ModelStreamInfer(
            iter([request]), metadata=metadata + (("triton_grpc_error", "true"),), timeout=20
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [r async for r in call]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.requests == []  # nothing refused reached Triton


async def test_health_watch_follows_upstream_readiness() -> None:
    servers: list[grpc.aio.Server] = []
    async with gateway_before(FakeTriton(), servers.append) as stub:
        watch = stub.health.Watch(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await servers[0].stop(None)  # Triton goes away
        second = await asyncio.wait_for(watch.read(), timeout=10)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


class FailingTriton(FakeTriton):
    """Answers a request once, then ends its stream with an error status."""

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            self.requests.append(request)
            response = service_pb2.ModelStreamInferResponse()
            response.infer_response.id = request.id
            response.infer_response.outputs.add(name="text_output")
            await context.write(response)
            context.set_trailing_metadata((("x-triton-detail", "draining"),))
            await context.abort(grpc.StatusCode.CANCELLED, "triton is shutting down")


async def test_an_upstream_failure_of_a_request_is_answered_in_the_stream_which_goes_on() -> None:
    async with gateway_before(FailingTriton()) as stub:
        requests = [service_pb2.ModelInferRequest(model_name="m", id=rid) for rid in ("r", "s")]
        responses = [r async for r in stub.ModelStreamInfer(iter(requests), metadata=AUTH, timeout=20)]
    for rid in ("r", "s"):
        mine = [r for r in responses if r.infer_response.id == rid]
        assert [bool(r.error_message) for r in mine] == [False, True]
        assert mine[1].error_message == "CANCELLED: triton is shutting down"


async def test_with_triton_grpc_error_an_upstream_failure_ends_the_stream_with_its_status() -> None:
    async with gateway_before(FailingTriton()) as stub:
        metadata = AUTH + (("triton_grpc_error", "true"),)
        call = stub.ModelStreamInfer(one_request_then_wait("r"), metadata=metadata, timeout=20)
        first = await call.read()
        assert first.infer_response.id == "r"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        assert caught.value.details() == "triton is shutting down"
        assert ("x-triton-detail", "draining") in list(caught.value.trailing_metadata() or ())


async def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_is_cancelled_upstream() -> None:
    fake = FakeTriton(endless=True)
    async with gateway_before(fake) as stub:
        call = stub.ModelStreamInfer(one_request_then_wait("slow"), metadata=AUTH, timeout=1.5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(fake.stream_cancelled.wait(), timeout=10)
    # Triton was given the caller's deadline on its stream too.
    (left,) = fake.stream_time_remaining
    assert left is not None and 0 < left <= 1.6


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
async def test_stream_requests_larger_than_a_window_arrive_whole(compression: grpc.Compression) -> None:
    """Requests of several HTTP/2 windows each (and gzip-compressed ones) reach Triton as sent."""
    fake = FakeTriton(chunks=1)
    payloads = [bytes(range(256)) * (12 * 1024 + n) for n in range(3)]  # about 3 MiB each
    requests = [
        service_pb2.ModelInferRequest(model_name="m", id=f"big{n}", raw_input_contents=[p])
        for n, p in enumerate(payloads)
    ]
    async with gateway_before(fake) as stub:
        call = stub.ModelStreamInfer(iter(requests), metadata=AUTH, timeout=30, compression=compression)
        responses = [r async for r in call]
    # Each request is a call of its own: answered as it finishes, in whatever order.
    assert sorted(r.infer_response.id for r in responses) == ["big0", "big1", "big2"]
    assert {r.id: list(r.raw_input_contents) for r in fake.requests} == {f"big{n}": [p] for n, p in enumerate(payloads)}


async def test_a_stream_request_over_the_size_limit_ends_the_stream_resource_exhausted() -> None:
    fake = FakeTriton(chunks=1)
    small = service_pb2.ModelInferRequest(model_name="m", id="ok")
    large = service_pb2.ModelInferRequest(model_name="m", id="large", raw_input_contents=[b"x" * 8192])
    async with gateway_before(fake, limits={"max_request_bytes": 4096}) as stub:

        async def small_then_large():
            yield small
            await asyncio.sleep(0.5)  # its answer first
            yield large

        call = stub.ModelStreamInfer(small_then_large(), metadata=AUTH, timeout=20)
        first = await call.read()
        assert first.infer_response.id == "ok"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4096" in (caught.value.details() or "")
    assert len(fake.requests) == 1  # the large one never reached Triton


async def test_finished_streams_leave_no_reference_cycles() -> None:
    """A stream's objects are freed as it ends, not left to the cycle collector, whose full
    passes stall every call in flight (tens of ms under a stream flood)."""
    fake = FakeTriton(chunks=1)
    async with gateway_before(fake) as stub:
        request = service_pb2.ModelInferRequest(model_name="m", id="c")
        await asyncio.wait_for(_drain(stub.ModelStreamInfer(iter([request]), metadata=AUTH)), 20)  # warm
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for n in range(20):
                metadata = AUTH if n % 2 else AUTH + (("x-priority", "gold"),)  # served, refused in band
                await asyncio.wait_for(_drain(stub.ModelStreamInfer(iter([request]), metadata=metadata)), 20)
            stream = stub.ModelStreamInfer(one_request_then_wait("open"), metadata=AUTH)
            await stream.read()
            stream.cancel()  # cancelled by the caller
            await asyncio.sleep(0.5)
            gc.collect()
            # The call path's objects: the relay's and the data plane's.
            left = [o for o in gc.garbage if type(o).__module__.startswith(("qosgate.relay", "qosgate.dataplane"))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert [type(o).__qualname__ for o in left] == []


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    async for _ in call:
        pass
