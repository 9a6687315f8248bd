"""The relay's ModelInfer policy in process: which headers it reads, and where it routes.

A Gateway built from a config (no network: its upstreams are marked live by hand, and the
relay's connection pools, which the decision names, are never started)."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from qosgate.app import Gateway
from qosgate.config import parse_config
from qosgate.relay.infer_policy import InferAdmissionPolicy
from qosgate.transport.peer import Flusher
from qosgate.relay.policy import CallEnd, CallHead, Forward
from qosgate.transport.status import Refuse
from qosgate.upstream.connections import ConnectionPool as Connections

KEY = "k" * 24
PATH = b"/inference.GRPCInferenceService/ModelInfer"
UPSTREAMS = ("t0", "t1", "t2")
PERMISSION_DENIED, UNAUTHENTICATED = 7, 16


def _policy() -> InferAdmissionPolicy:
    config = parse_config(
        {
            "upstreams": [{"name": name, "url": f"127.0.0.1:{i + 1}"} for i, name in enumerate(UPSTREAMS)],
            "tenants": [{"name": "a", "api_keys": [{"key": KEY}], "max_class": "standard"}],
            "models": {
                "identity": {
                    "dispatch_window": 64,
                    "routing": {"policy": "prefix_affinity", "session_header": "X-Session-Id"},
                }
            },
        },
        source="test",
    )
    gateway = Gateway(config, serve_metrics=False)
    for upstream in gateway.pool.upstreams:
        upstream.live = True
        upstream.connections = Connections(Flusher(), upstream.url)  # named, never started
    return InferAdmissionPolicy(
        edge=gateway.edge, heap=gateway.heap, max_request_fields=config.limits.max_request_fields
    )


def _head(*headers: tuple[bytes, bytes]) -> CallHead:
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(bytes(16))
    base = [(b":method", b"POST"), (b":path", PATH), (b"content-type", b"application/grpc")]
    return CallHead(PATH, [*base, *headers], request.SerializeToString(), None)


def _decide(policy: InferAdmissionPolicy, *headers: tuple[bytes, bytes]) -> Forward | Refuse:
    decision = policy(_head(*headers))
    assert isinstance(decision, Forward | Refuse), decision  # decided at once: nothing waits
    if isinstance(decision, Forward):
        assert decision.on_finish is not None
        decision.on_finish(CallEnd(0, None, 1, 1))
    return decision


async def test_calls_of_one_session_go_to_one_upstream() -> None:
    policy = _policy()
    places: dict[str, set[object]] = {}
    # Five sessions over three replicas: taking turns would move each from one to the next.
    for session in ("s-1", "s-2", "s-3", "s-4", "s-5") * 3:
        decision = _decide(policy, (b"x-api-key", KEY.encode()), (b"x-session-id", session.encode()))
        assert isinstance(decision, Forward)
        places.setdefault(session, set()).add(decision.upstream)
    assert all(len(upstreams) == 1 for upstreams in places.values()), places
    assert len(set().union(*places.values())) > 1  # and sessions spread over the replicas


async def test_credentials_and_class_are_read_from_their_headers() -> None:
    policy = _policy()
    bearer = (b"authorization", b"Bearer " + KEY.encode())
    assert isinstance(_decide(policy, bearer), Forward)
    assert isinstance(_decide(policy, (b"x-api-key", KEY.encode())), Forward)
    for refused in ((), ((b"x-api-key", b"x" * 24),), (bearer, (b"x-api-key", b"x" * 24))):
        decision = _decide(policy, *refused)
        assert isinstance(decision, Refuse) and decision.status == UNAUTHENTICATED, decision
    # A class above the tenant's max is refused; its own class is not.
    above = _decide(policy, bearer, (b"x-priority", b"critical"))
    assert isinstance(above, Refuse) and above.status == PERMISSION_DENIED, above
    assert isinstance(_decide(policy, bearer, (b"x-priority", b"standard")), Forward)
