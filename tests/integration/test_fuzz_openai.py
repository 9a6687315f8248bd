"""Property-based fuzzing of every route of the OpenAI-compatible HTTP API, through a real
gateway in front of a real Triton (the HTTP counterpart of test_fuzz_rpcs.py).

Each route gets batches of requests of four kinds: bytes that are no JSON, valid bodies
with fields set to hostile JSON values (huge, negative and fractional numbers, NaN,
unpaired surrogates, wrong types, deep nesting), multipart uploads broken in the ways
parsers trip on, and headers that are oversized or padded. What must hold for every
request:

- never a 5xx, and every 4xx carries an OpenAI error object (`{"error": {"message",
  "type", ...}}`), whatever rejected the request (a route, the HTTP parser, the body
  parser, the domain, Triton);
- without a valid key, 401 on every route before the body is read;
- no traceback in the gateway's log, and a valid call is served after each batch.

The fuzzing tenant may use the identity model only, so no case reaches the LLM.
"""

from __future__ import annotations

import collections
import gzip
import json
import logging
import socket
import zlib
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require_model
from gateway_harness import GatewayThread, TracebackCollector, gateway_config

pytestmark = pytest.mark.integration

FUZZ_KEY = "test-openai-fuzz-key"
AUTH = {"authorization": f"Bearer {FUZZ_KEY}"}
EXAMPLES_PER_ROUTE = 40
TIMEOUT_S = 20.0
# aiohttp's default bound on one header line (max_field_size).
PARSER_FIELD_LIMIT = 8190

# Valid bodies to start from, per JSON route.
SEEDS: dict[str, dict[str, Any]] = {
    "/chat/completions": {"model": "identity", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/completions": {"model": "identity", "prompt": "hi", "max_tokens": 1},
    "/embeddings": {"model": "identity", "input": ["a", "b"]},
    "/batches": {"input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
}
# Every other route, with its method; `{id}` is fuzzed.
OTHER_ROUTES = [
    ("GET", "/models"),
    ("GET", "/models/{id}"),
    ("GET", "/files"),
    ("GET", "/files/{id}"),
    ("DELETE", "/files/{id}"),
    ("GET", "/files/{id}/content"),
    ("GET", "/batches"),
    ("GET", "/batches/{id}"),
    ("POST", "/batches/{id}/cancel"),
]
FIELDS = [
    "model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "n", "stream", "stream_options", "service_tier", "encoding_format", "dimensions",
    "user", "metadata", "logit_bias", "response_format", "endpoint", "completion_window", "input_file_id",
]  # fmt: skip
# JSON values a careless or hostile caller sends; numbers past every integer type included.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 10**12, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "identity", "smollm2", "minilm", "no-such-model", "user", "base64", "float", "24h"]),
    st.text(max_size=16),
    st.integers(1_000, 100_000).map(lambda n: "m" * n),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS + ["role", "content", "type", "text"]), inner, max_size=4)),
    max_leaves=12,
)
# Texts json.dumps cannot write: put in as raw JSON.
RAW_VALUES = [
    '"\\ud800"',  # an unpaired surrogate
    '"a\\udfffb"',
    "1" * 5000,  # past Python's int digit limit
    "1e999",  # infinity as a literal
    "-0",
    "[" * 5000 + "]" * 5000,  # deeper than any parser's recursion
    '{"a":' * 3000 + "1" + "}" * 3000,
]


@st.composite
def json_bodies(draw: st.DrawFn, route: str) -> bytes:
    """The route's valid body with some fields replaced, added or removed."""
    body = dict(SEEDS[route])
    raw_fields: dict[str, str] = {}
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS + list(body)))
        action = draw(st.sampled_from(["set", "set", "raw", "delete"]))
        if action == "delete":
            body.pop(field, None)
        elif action == "raw":
            raw_fields[field] = draw(st.sampled_from(RAW_VALUES))
        else:
            body[field] = draw(VALUES)
    text = json.dumps(body, allow_nan=True)
    for field, raw in raw_fields.items():
        body.pop(field, None)
        text = text[:-1] + (", " if len(text) > 2 else "") + f'"{field}": {raw}' + "}"
    return text.encode()


def raw_bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"null", b"[]", b"{}", b'"x"', b"{not json", b"\xff\xfe{}", *(r.encode() for r in RAW_VALUES)]),
    )


@st.composite
def multipart_uploads(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    """A POST /v1/files body and its content-type, broken or not."""
    boundary = draw(st.sampled_from(["b0undary", "", "x" * 100, "a b", '"quoted"']))
    content_type = draw(
        st.sampled_from(
            [
                f"multipart/form-data; boundary={boundary}",
                "multipart/form-data",  # no boundary at all
                "multipart/form-data; boundary=",
                "multipart/mixed; boundary=b0undary",
                "application/json",
                "multipart/form-data; boundary=b0undary; charset=no-such-charset",
            ]
        )
    )
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": SEEDS["/embeddings"]})
    parts = []
    for name, value in draw(
        st.lists(
            st.sampled_from([("purpose", "batch"), ("purpose", "fine-tune"), ("file", line), ("file", "\xff"), ("other", "x")]),
            max_size=4,
        )
    ):
        disposition = draw(
            st.sampled_from(
                [
                    f'form-data; name="{name}"; filename="in.jsonl"',
                    f'form-data; name="{name}"',
                    "form-data",
                    f"form-data; name={name}; filename*=UTF-8''%FF%FE",
                    "attachment",
                ]
            )
        )
        parts.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n{value}\r\n")
    body = "".join(parts) + draw(st.sampled_from([f"--{boundary}--\r\n", "", f"--{boundary}", "--"]))
    raw = body.encode("utf-8", "surrogateescape")
    cut = draw(st.one_of(st.none(), st.integers(0, max(len(raw), 1))))
    return {"content-type": content_type}, raw if cut is None else raw[:cut]


HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-priority": st.sampled_from(["", "critical", "batch", "gold", "x" * 9000]),
        "x-session-id": st.sampled_from(["", "s", "y" * 20_000]),
        "timeout": st.sampled_from(["", "1", "0.5", "-1", "nan", "inf", "1e999", "abc", "9" * 400]),
        "x-stainless-timeout": st.sampled_from(["", "600", "-5", "x"]),
        # Bodies that do not decode as their encoding says (none of them is compressed).
        "content-encoding": st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x-unknown"]),
    },
)

# Statuses seen by route; failures of the batch running now.
SEEN: collections.defaultdict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
FAILURES: list[str] = []
# aiohttp logs a request its parser refused, with a traceback: that must not happen either.
TRACEBACKS = TracebackCollector(("qosgate", "aiohttp"))


@pytest.fixture(scope="module")
def gateway(triton) -> Iterator[GatewayThread]:
    config = gateway_config(
        triton.ports.grpc_url,
        tenants=[{"name": "fuzz", "api_keys": [{"key": FUZZ_KEY}], "models": ["identity"]}],
        openai={"listen": "127.0.0.1:0", "max_body_bytes": 256 * 1024, "max_file_bytes": 64 * 1024},
    )
    logging.getLogger().addHandler(TRACEBACKS)
    try:
        with GatewayThread(config) as running:
            yield running.wait_ready()
    finally:
        logging.getLogger().removeHandler(TRACEBACKS)


@pytest.fixture(scope="module")
def http(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.openai_url, timeout=TIMEOUT_S) as client:
        yield client


def _check(route: str, response: httpx.Response, *, expect: int | None = None) -> None:
    SEEN[route][response.status_code] += 1
    what = f"{response.request.method} {route} -> {response.status_code}: {response.text[:300]!r}"
    if expect is not None and response.status_code != expect:
        FAILURES.append(f"expected {expect}: {what}")
        return
    if response.status_code >= 500:
        FAILURES.append(what)
    elif response.status_code >= 400:
        try:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            FAILURES.append(f"not an OpenAI error object: {what}")


def _send(http: httpx.Client, method: str, route: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """One request; a streamed answer is read to its end (an error may come as an event)."""
    with http.stream(method, route, content=body if method == "POST" else None, headers=headers) as response:
        response.read()
    return response


def _unauthenticated(
    http: httpx.Client, method: str, route: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    """Whatever the body, a caller without a valid key learns nothing but 401 (unless its
    headers are over the HTTP parser's limit: then nothing of it is read at all)."""
    oversized = any(len(value) > PARSER_FIELD_LIMIT for value in headers.values())
    # (HTTP/1.1 has no padded header values: the client library refuses to send them.)
    for credentials in ({}, {"authorization": "Bearer"}, {"authorization": "Bearer wrong"}, {"x-api-key": ""}):
        _check(route, _send(http, method, path, body, {**headers, **credentials}), expect=None if oversized else 401)


def _still_serving(http: httpx.Client) -> None:
    response = http.get("/models", headers=AUTH)
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == ["identity"]


def _run(http: httpx.Client, method: str, route: str, body: bytes, headers: dict[str, str], path: str = "") -> None:
    """One case on `route` (sent to `path`, the route with its parameters filled in)."""
    FAILURES.clear()
    TRACEBACKS.records.clear()
    _check(route, _send(http, method, path or route, body, {**headers, **AUTH}))
    _unauthenticated(http, method, route, path or route, body, headers)
    assert not FAILURES, "\n".join(FAILURES)
    assert not TRACEBACKS.records, [r.getMessage() for r in TRACEBACKS.records]
    _still_serving(http)


FUZZ = settings(
    max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("route", sorted(SEEDS))
def test_fuzz_json_routes(http: httpx.Client, route: str) -> None:
    require_model("identity")

    @FUZZ
    @given(st.one_of(json_bodies(route), raw_bodies()), HEADERS)
    def cases(body: bytes, headers: dict[str, str]) -> None:
        _run(http, "POST", route, body, {"content-type": "application/json", **headers})

    cases()


# aiohttp's multipart parser warns about a filename* it cannot decode, or a
# Content-Disposition it cannot parse, then goes on: what the gateway answers such an
# upload is what is checked, not aiohttp's warning.
@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionParam")
@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionHeader")
def test_fuzz_file_uploads(http: httpx.Client) -> None:
    require_model("identity")

    @FUZZ
    @given(multipart_uploads(), HEADERS)
    def cases(upload: tuple[dict[str, str], bytes], headers: dict[str, str]) -> None:
        content_type, body = upload
        _run(http, "POST", "/files", body, {**headers, **content_type})

    cases()


@pytest.mark.parametrize(("method", "route"), OTHER_ROUTES)
def test_fuzz_other_routes(http: httpx.Client, method: str, route: str) -> None:
    require_model("identity")
    ids = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["batch_x", "file-x", "identity", "x" * 5000]))
    queries = st.fixed_dictionaries(
        {},
        optional={
            "limit": st.sampled_from(["", "0", "1", "101", "-1", "x", "9" * 30]),
            "after": st.text(max_size=20),
            "order": st.sampled_from(["", "asc", "desc", "ASC", "x"]),
            "purpose": st.text(max_size=20),
        },
    )

    @FUZZ
    @given(ids, queries, raw_bodies(), HEADERS)
    def cases(item: str, query: dict[str, str], body: bytes, headers: dict[str, str]) -> None:
        path = route.replace("{id}", urllib.parse.quote(item, safe=""))
        _run(http, method, route, body, headers, f"{path}?{urllib.parse.urlencode(query)}" if query else path)

    cases()


@pytest.mark.parametrize("size", [10_000, 100_000])
def test_oversized_headers_are_openai_errors(http: httpx.Client, size: int) -> None:
    FAILURES.clear()
    for headers in ({"authorization": "Bearer " + "k" * size}, {**AUTH, "x-custom": "v" * size}):
        _check("/chat/completions", _send(http, "POST", "/chat/completions", json.dumps(SEEDS["/chat/completions"]).encode(), headers))
    many = {**AUTH, **{f"x-h{i}": "v" for i in range(300)}}
    _check("/models", _send(http, "GET", "/models", b"", many))
    assert not FAILURES, "\n".join(FAILURES)
    _still_serving(http)


def test_bodies_are_refused_by_what_their_headers_declare(gateway: GatewayThread, http: httpx.Client) -> None:
    """A gzip or deflate body that decodes is read as the plain one; one that does not (or
    holds more than its stream), or that inflates past the limit, or a declared length over
    it (answered before any of the body is sent) is a 400 OpenAI error; another encoding,
    or any on an upload, a 415."""
    FAILURES.clear()
    json_type = {**AUTH, "content-type": "application/json"}
    body = json.dumps(SEEDS["/embeddings"]).encode()
    plain = _send(http, "POST", "/embeddings", body, json_type)
    # (A gzip body of two members, RFC 1952, is one body.)
    halves = gzip.compress(body[:10]) + gzip.compress(body[10:])
    for encoding, packed in (("gzip", gzip.compress(body)), ("gzip", halves), ("deflate", zlib.compress(body))):
        answer = _send(http, "POST", "/embeddings", packed, {**json_type, "content-encoding": encoding})
        assert (answer.status_code, answer.json()) == (plain.status_code, plain.json()), encoding
    bomb = gzip.compress(b" " * (1 << 20))  # 1 MiB of spaces: past the 256 KiB limit, in 1 kB
    for case, expect in (("not gzip", 400), (bomb, 400), (gzip.compress(body)[:-9], 400), (gzip.compress(body) + b"junk", 400)):
        raw = case.encode() if isinstance(case, str) else case
        _check("/embeddings", _send(http, "POST", "/embeddings", raw, {**json_type, "content-encoding": "gzip"}), expect=expect)
    _check("/embeddings", _send(http, "POST", "/embeddings", body, {**json_type, "content-encoding": "br"}), expect=415)
    _check("/files", _send(http, "POST", "/files", b"x", {**AUTH, "content-type": "multipart/form-data; boundary=b", "content-encoding": "gzip"}), expect=415)
    assert not FAILURES, "\n".join(FAILURES)
    port = urllib.parse.urlsplit(gateway.openai_url).port
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            f"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nauthorization: {AUTH['authorization']}\r\n"
            f"content-type: application/json\r\ncontent-length: {10**10}\r\n\r\n".encode()
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 400 ") and b"larger than" in head, head[:300]
    # An upload too: its reader would wait for all the bytes declared.
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            f"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: {AUTH['authorization']}\r\n"
            f"content-type: multipart/form-data; boundary=bb\r\ncontent-length: {10**10}\r\n\r\n"
            '--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 400 ") and b"larger than" in head, head[:300]
    # A body that stops part-way is waited for as long as the request's timeout, then 408.
    for route, content_type, part in (
        ("/v1/embeddings", "application/json", '{"model": "identity", '),
        ("/v1/files", "multipart/form-data; boundary=bb", '--bb\r\nContent-Disposition: form-data; name="purpose"\r\n'),
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            sock.sendall(
                f"POST {route} HTTP/1.1\r\nhost: x\r\nauthorization: {AUTH['authorization']}\r\ntimeout: 1\r\n"
                f"content-type: {content_type}\r\ncontent-length: 1000\r\n\r\n{part}".encode()
            )
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 408 ") and b"did not arrive" in head, (route, head[:300])
    _still_serving(http)


def test_a_client_waiting_for_100_continue_is_refused_before_it_sends_its_body(
    gateway: GatewayThread, http: httpx.Client
) -> None:
    """`Expect: 100-continue` (curl's large uploads, .NET's and Java's HTTP clients): the
    client is told to send its body only once the caller is identified; without a valid
    key, with a bad timeout header or declaring a body over the route's limit, it gets the
    OpenAI error instead, having sent none of its body."""
    port = urllib.parse.urlsplit(gateway.openai_url).port
    body = json.dumps(SEEDS["/embeddings"]).encode()

    def ask(route: str, headers: dict[str, str], expect: str = "100-continue",
            length: int = len(body)) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nhost: x\r\n{lines}content-type: application/json\r\n"
            f"content-length: {length}\r\nexpect: {expect}\r\n\r\n".encode()
        )
        return sock, sock.recv(65536)

    for route in ("/v1/embeddings", "/v1/files", "/v1/batches"):
        for headers, status in (
            ({}, 401),
            ({"authorization": "Bearer not-a-key"}, 401),
            ({**AUTH, "timeout": "soon"}, 400),
        ):
            sock, head = ask(route, headers)
            with sock:
                assert head.startswith(f"HTTP/1.1 {status} ".encode()), (route, headers, head[:300])
                assert json.loads(head.partition(b"\r\n\r\n")[2])["error"]["message"], head
    for route, limit in (("/v1/embeddings", 256 * 1024), ("/v1/files", 64 * 1024 * 2)):
        sock, head = ask(route, AUTH, length=limit + 1)
        with sock:
            assert head.startswith(b"HTTP/1.1 400 ") and b"larger than" in head, (route, head[:300])
    sock, head = ask("/v1/embeddings", AUTH, expect="something-else")
    with sock:
        assert head.startswith(b"HTTP/1.1 417 ") and b"100-continue" in head, head[:300]
    # With a valid key: 100 Continue, and the body sent then is answered as without Expect.
    plain = _send(http, "POST", "/embeddings", body, {**AUTH, "content-type": "application/json"})
    sock, head = ask("/v1/embeddings", AUTH)
    with sock:
        assert head == b"HTTP/1.1 100 Continue\r\n\r\n", head[:300]
        sock.sendall(body)
        answer = sock.recv(65536)
        while len(answer.partition(b"\r\n\r\n")[2]) < len(plain.content):
            answer += sock.recv(65536)
    assert answer.startswith(f"HTTP/1.1 {plain.status_code} ".encode()), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == plain.json()


def test_fuzz_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The statuses seen, for the record; the cases ran in the tests above."""
    with capsys.disabled():
        for route, statuses in sorted(SEEN.items()):
            print(f"\n{route[:60]}: {dict(sorted(statuses.items()))}", end="")
        print()
