"""Each row of the error table, through a real gRPC channel, decoded as a client would."""

from __future__ import annotations

import logging
import math

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from qosgate import error_table, errors
from qosgate.services import status
from qosgate.transport.status import status_of
from tests.fakes import FakeClock

_METHOD = "/test.Errors/Raise"

ROWS = [
    (errors.Unauthenticated("no API key"), grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied("model 'x' not allowed"), grpc.StatusCode.PERMISSION_DENIED),
    (errors.InvalidArgument("unknown class 'gold'"), grpc.StatusCode.INVALID_ARGUMENT),
    (
        errors.QuotaExceeded(
            "rate limit", 1.25, (errors.QuotaViolation("tenant:acme", "50 requests/s"),)
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
    (errors.Unavailable("shed", retry_after_s=0.5), grpc.StatusCode.UNAVAILABLE),
    (errors.Unavailable("no healthy upstream"), grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded("deadline passed in queue"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Cancelled("client went away"), grpc.StatusCode.CANCELLED),
    (errors.NotFound("no such model"), grpc.StatusCode.NOT_FOUND),
    (errors.Internal("db password wrong at /etc/secret"), grpc.StatusCode.INTERNAL),
    (KeyError("/etc/secret"), grpc.StatusCode.INTERNAL),
]


@pytest.fixture
async def raising_server():
    """An in-process server whose one method aborts with the error named in the request."""
    by_index = dict(enumerate(err for err, _ in ROWS))

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await status.abort(context, by_index[int(request)])
        raise AssertionError("abort returned")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Errors", {"Raise": grpc.unary_unary_rpc_method_handler(handler)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel.unary_unary(_METHOD)
    await server.stop(None)


# The server fixture lives on the session loop (pyproject); the test must share it.
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("index", range(len(ROWS)), ids=[type(e).__name__ for e, _ in ROWS])
async def test_row_through_real_channel(raising_server, index: int) -> None:
    error, code = ROWS[index]
    call = raising_server(str(index).encode())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code
    rich = rpc_status.from_call(caught.value)
    assert rich is not None and rich.code == code.value[0]
    details = {d.TypeName(): d for d in rich.details}

    if code is grpc.StatusCode.INTERNAL:
        # Generic text only: the cause stays in the log.
        assert caught.value.details().startswith(error_table.INTERNAL_MESSAGE)
        assert "secret" not in caught.value.details()
        return
    assert caught.value.details() == error.message

    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is None:
        assert "google.rpc.RetryInfo" not in details
    else:
        info = error_details_pb2.RetryInfo()
        details["google.rpc.RetryInfo"].Unpack(info)
        assert info.retry_delay.ToTimedelta().total_seconds() == pytest.approx(retry_after)
    if isinstance(error, errors.QuotaExceeded):
        failure = error_details_pb2.QuotaFailure()
        details["google.rpc.QuotaFailure"].Unpack(failure)
        assert [(v.subject, v.description) for v in failure.violations] == [
            ("tenant:acme", "50 requests/s")
        ]
    else:
        assert "google.rpc.QuotaFailure" not in details


def test_every_domain_error_has_a_row() -> None:
    domain = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.GatewayError)}
    assert domain - {errors.GatewayError} == set(error_table.TABLE)


def test_a_wait_past_what_a_duration_holds_is_sent_as_the_largest_one() -> None:
    for wait in (315_576_000_000.5, 1e300):
        rich = _rich(errors.Unavailable("busy", retry_after_s=wait))
        info = error_details_pb2.RetryInfo()
        rich.details[0].Unpack(info)
        assert (info.retry_delay.seconds, info.retry_delay.nanos) == (315_576_000_000, 0)


def test_retry_delay_rounds_up() -> None:
    rich = _rich(errors.Unavailable("busy", retry_after_s=0.0000015))
    info = error_details_pb2.RetryInfo()
    rich.details[0].Unpack(info)
    assert (info.retry_delay.seconds, info.retry_delay.nanos) == (0, 2000)


def test_a_message_quoting_a_huge_value_is_cut_to_the_bound() -> None:
    rich = _rich(errors.PermissionDenied(f"may not use model {'m' * 100_000!r}"))
    assert len(rich.message) == error_table.MAX_MESSAGE_CHARS
    assert rich.message.startswith("may not use model 'mmm") and rich.message.endswith("...")
    short = _rich(errors.InvalidArgument("x" * error_table.MAX_MESSAGE_CHARS))
    assert short.message == "x" * error_table.MAX_MESSAGE_CHARS


def test_internal_errors_are_logged_in_full_only_up_to_the_budget(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(error_table, "_tracebacks", error_table.LogBudget(per_window=3, window_s=60.0, clock=clock))
    caplog.set_level(logging.ERROR, logger=error_table.__name__)

    def burst(count: int) -> list[logging.LogRecord]:
        caplog.clear()
        for _ in range(count):
            assert _rich(RuntimeError("bug")).message.startswith(error_table.INTERNAL_MESSAGE)
        return caplog.records

    logged = burst(50)
    # Three with their traceback, one line saying the rest are not logged, then silence.
    assert [bool(r.exc_info) for r in logged] == [True, True, True, False]
    assert "not logged until the next" in logged[-1].getMessage()
    clock.advance(59.9)
    assert burst(5) == []
    clock.advance(0.1)  # a new window
    assert [bool(r.exc_info) for r in burst(3)] == [True, True, True]


def _rich(error: BaseException) -> status_pb2.Status:
    return status_pb2.Status.FromString(status_of(error)[2])


def _runtime_status(code: int, message: str, retry_after: float | None, violations: tuple[errors.QuotaViolation, ...]) -> bytes:
    """The Status as the protobuf runtime builds and serializes it, message by message."""
    rich = status_pb2.Status(code=code, message=message)
    if retry_after is not None:
        micros = math.ceil(retry_after * 1_000_000)
        delay = duration_pb2.Duration(seconds=micros // 1_000_000, nanos=micros % 1_000_000 * 1000)
        rich.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    if violations:
        failure = error_details_pb2.QuotaFailure()
        for v in violations:
            failure.violations.add(subject=v.subject, description=v.description)
        rich.details.add().Pack(failure)
    return rich.SerializeToString()


@pytest.mark.parametrize("retry_after", [0.0, 0.0000015, 0.25, 1.0, 59.999999, 3600.5, 86400 * 400, 300_000_000_000.5, 315_575_999_999.999999])
def test_status_bytes_are_the_protobuf_runtimes_own(retry_after: float) -> None:
    one = (errors.QuotaViolation("tenant:acme", "requests_per_second limit 50 (burst 50) exceeded"),)
    two = (*one, errors.QuotaViolation("tenant:acme", "max_concurrent limit 4 reached"))
    for violations in (one, two):
        for _ in range(2):  # built, then from the cache
            error = errors.QuotaExceeded("quota exceeded: é " + "x" * 200, retry_after, violations)
            code, message, details = status_of(error)
            assert (code, message) == (8, error.message)
            assert details == _runtime_status(8, error.message, retry_after, violations)
    shed = errors.Unavailable("shed", retry_after_s=retry_after)
    assert status_of(shed)[2] == _runtime_status(14, "shed", retry_after, ())
    assert status_of(errors.NotFound("no model"))[2] == _runtime_status(5, "no model", None, ())
