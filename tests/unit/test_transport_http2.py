"""The HTTP/2 session (qosgate.transport.http2) against a real nghttp2 client session."""

from __future__ import annotations

import ngh2

from qosgate.transport import http2

HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/p"), (b":authority", b"a")]


def _exchange(client: ngh2.Connection, server: http2.Http2Connection) -> list[http2.Event]:
    events = server.feed(client.data_to_send())
    client.receive_data(server.outgoing())
    return events


def test_sends_on_a_stream_the_caller_reset_send_nothing() -> None:
    """The session knows of a reset as soon as it reads it, the relay only when it handles
    the event (maybe a pass later): its answer to such a call must not raise, and sends
    nothing the caller would get."""
    client = ngh2.Connection(ngh2.Role.CLIENT, ngh2.Configuration())
    client.initiate_connection({})
    server = http2.Http2Connection(server=True, max_concurrent_streams=100)
    _exchange(client, server)
    stream = client.send_request(HEADERS)
    client.send_data(stream, b"request")
    assert any(isinstance(e, http2.RequestReceived) for e in _exchange(client, server))
    client.events()
    client.reset_stream(stream, int(ngh2.ErrorCode.CANCEL))
    events = server.feed(client.data_to_send())  # read, not yet handled by the relay
    server.send_response(stream, [(b":status", b"200")])
    server.send_data(stream, b"response")
    server.send_trailers(stream, [(b"grpc-status", b"0")])
    server.end_stream(stream)
    server.send_response(stream, [(b":status", b"200")], end_stream=True)
    assert [type(e) for e in events] == [http2.StreamReset, http2.StreamClosed]
    client.receive_data(server.outgoing())
    answers = (ngh2.ResponseReceived, ngh2.DataReceived, ngh2.TrailersReceived)
    assert not [e for e in client.events() if isinstance(e, answers)]
    # The connection goes on: a later call is answered.
    later = client.send_request(HEADERS, end_stream=True)
    _exchange(client, server)
    client.events()
    server.send_response(later, [(b":status", b"200")], end_stream=True)
    client.receive_data(server.outgoing())
    assert [e.stream_id for e in client.events() if isinstance(e, ngh2.ResponseReceived)] == [later]


def test_header_values_with_surrounding_whitespace_are_taken_and_trimmed() -> None:
    """RFC 9113 has libnghttp2 reset such a stream; gRPC servers take the value trimmed,
    and so does the relay (the ngh2 build of scripts/build_ngh2.py)."""
    client = ngh2.Connection(ngh2.Role.CLIENT, ngh2.Configuration())
    client.initiate_connection({})
    server = http2.Http2Connection(server=True, max_concurrent_streams=100)
    _exchange(client, server)
    padded = [(b"authorization", b"Bearer "), (b"x-priority", b"  batch\t"), (b"te", b"trailers")]
    stream = client.send_request([*HEADERS, *padded], end_stream=True)
    received = [e for e in _exchange(client, server) if isinstance(e, http2.RequestReceived)]
    assert [e.stream_id for e in received] == [stream]
    assert not [e for e in client.events() if isinstance(e, ngh2.StreamReset)]
    headers = http2.trimmed(received[0].headers)
    assert headers[-3:] == [(b"authorization", b"Bearer"), (b"x-priority", b"batch"), (b"te", b"trailers")]
    # Nothing to trim: the same headers, not a copy.
    assert http2.trimmed(HEADERS) is HEADERS
