"""The gateway's relay (the KServe data path) across two upstreams: each ModelInfer goes to
the upstream the pool's routing picks, and once more to another when the first answers
UNAVAILABLE before any response.

Upstream `b` is a gRPC server that says it is a live Triton with `identity` ready and
fails every ModelInfer UNAVAILABLE, as a Triton does while its model is not ready; `a` is
the real Triton. Every call through the gateway must succeed, served by `a`. What `b`
receives shows what the gateway sends a Triton: the caller's headers, less its credentials.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from tritonclient.grpc import service_pb2

from conftest import free_port, require_model
from gateway_harness import ACME_KEY, GatewayThread, bearer, gateway_config, identity_request

pytestmark = pytest.mark.integration

SERVICE = "inference.GRPCInferenceService"


class UnavailableReplica:
    """A gRPC server that is live, lists identity as ready, and refuses ModelInfer UNAVAILABLE."""

    def __init__(self) -> None:
        self.port = free_port()
        self.infers = 0
        self.metadata: list[dict[str, str | bytes]] = []  # of each ModelInfer received
        self._lock = threading.Lock()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        identity = (lambda raw: raw, lambda raw: raw)
        handlers = {
            "ServerLive": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: service_pb2.ServerLiveResponse(live=True).SerializeToString(), *identity
            ),
            "RepositoryIndex": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: service_pb2.RepositoryIndexResponse(
                    models=[service_pb2.RepositoryIndexResponse.ModelIndex(name="identity", state="READY")]
                ).SerializeToString(),
                *identity,
            ),
            "ModelInfer": grpc.unary_unary_rpc_method_handler(self._infer, *identity),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    def _infer(self, _request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.infers += 1
            self.metadata.append(dict(context.invocation_metadata()))
        context.abort(grpc.StatusCode.UNAVAILABLE, "model 'identity' is not ready here")
        raise AssertionError("unreachable")

    def __enter__(self) -> UnavailableReplica:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)


@pytest.fixture(scope="module")
def replica_b() -> Iterator[UnavailableReplica]:
    with UnavailableReplica() as replica:
        yield replica


@pytest.fixture(scope="module")
def gateway(triton, replica_b: UnavailableReplica) -> Iterator[GatewayThread]:
    require_model("identity")
    upstreams = [
        {"name": "a", "url": triton.ports.grpc_url},
        {"name": "b", "url": f"127.0.0.1:{replica_b.port}"},
    ]
    with GatewayThread(gateway_config(triton.ports.grpc_url, upstreams=upstreams)) as running:
        deadline = time.monotonic() + 30
        while not all(u.live for u in running.gateway.pool.upstreams):
            assert time.monotonic() < deadline, "both upstreams never became live"
            time.sleep(0.1)
        yield running


def metric(gateway: GatewayThread, name: str, **labels: str) -> float:
    return gateway.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_call_refused_unavailable_before_responding_goes_to_the_other_upstream(
    gateway: GatewayThread, replica_b: UnavailableReplica
) -> None:
    with grpc.insecure_channel(gateway.url) as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        metadata = tuple(bearer(ACME_KEY).items())
        for i in range(8):
            raw = infer(identity_request(f"r{i}").SerializeToString(), metadata=metadata, timeout=30)
            assert service_pb2.ModelInferResponse.FromString(raw).id == f"r{i}"
    # Equal loads take turns, so b was picked first for some calls: each went on to a.
    assert replica_b.infers >= 1
    retried = metric(gateway, "qosgate_failovers_total", model="identity", upstream="b", result="retried")
    assert retried == replica_b.infers


@pytest.mark.parametrize("credentials", [bearer(ACME_KEY), {"x-api-key": ACME_KEY}])
def test_the_callers_credentials_stay_at_the_gateway(
    gateway: GatewayThread, replica_b: UnavailableReplica, credentials: dict[str, str]
) -> None:
    """Triton gets the caller's other headers, never its key (an upstream link may be plaintext)."""
    received = len(replica_b.metadata)
    with grpc.insecure_channel(gateway.url) as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        metadata = (*credentials.items(), ("x-team", "blue"))
        # Equal loads take turns: some of these go to b first.
        for i in range(4):
            infer(identity_request(f"c{i}").SerializeToString(), metadata=metadata, timeout=30)
    seen = replica_b.metadata[received:]
    assert seen, "no call reached b"
    for headers in seen:
        assert headers.get("x-team") == "blue", headers
        assert "authorization" not in headers and "x-api-key" not in headers, headers
        assert ACME_KEY not in repr(headers)
