"""Upstream health on a real tritonserver: a model's load or unload touches only that model,
and a Triton killed and restarted is served again within 2 s of its own readiness (the
HTTP readiness probe following it, the liveness probe never failing).

Regression tests of issue 10's findings: an admin unloading and reloading one model made
every other tenant's calls fail `UNAVAILABLE: no healthy Triton upstream` (the gateway
read Triton's ServerReady, false while any model loads or unloads); and after a Triton
restart the gateway took 5-19 s to notice (gRPC's default reconnect backoff).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import free_port, kill_triton, require_model, started_then_killed
from gateway_harness import ACME_KEY, ADMIN_KEY, GatewayThread, bearer, gateway_config
from qosgate.launcher import LocalTriton, TritonPorts

pytestmark = pytest.mark.integration

CYCLED = "identity"  # the admin unloads and reloads it
CALLED = "minilm"  # the other tenant calls it all along
CYCLES = 3
SERVING = health_pb2.HealthCheckResponse.SERVING
ACME = tuple(bearer(ACME_KEY).items())


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true after {timeout_s:.0f}s: {condition}")
        time.sleep(every_s)


def identity_request(value: float = 1.5) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.array([value], dtype=np.float32).tobytes())
    return request


def identity_served(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> bool:
    return stub.ModelInfer(identity_request(), metadata=ACME, timeout=5).model_name == "identity"


def health_of(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest(service="")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


@dataclass
class Tally:
    """Calls a tenant made while the admin worked, and the failures among them."""

    calls: int = 0
    failures: list[str] = field(default_factory=list)
    health: set[int] = field(default_factory=set)


def call_until(stop: threading.Event, gateway: GatewayThread, tally: Tally) -> None:
    texts = np.array([[b"a model loads next door"]], dtype=np.object_)
    with (
        grpcclient.InferenceServerClient(gateway.url) as client,
        grpc.insecure_channel(gateway.url) as channel,
    ):
        while not stop.is_set():
            tensor = grpcclient.InferInput("text", list(texts.shape), "BYTES")
            tensor.set_data_from_numpy(texts)
            try:
                result = client.infer(CALLED, [tensor], headers=bearer(ACME_KEY), client_timeout=30)
                if result.as_numpy("embedding").shape != (1, 384):
                    tally.failures.append(f"embedding of shape {result.as_numpy('embedding').shape}")
                tally.health.add(health_of(channel))
            except InferenceServerException as e:
                tally.failures.append(f"{e.status()}: {e.message()}")
            except Exception as e:  # whatever it is, the caller counts it and goes on
                tally.failures.append(repr(e))
            tally.calls += 1


def repository_state(
    client: grpcclient.InferenceServerClient, model: str, headers: dict[str, str]
) -> str:
    index = client.get_model_repository_index(headers=headers, as_json=True)
    return next((m.get("state", "") for m in index.get("models", []) if m["name"] == model), "")


@pytest.fixture(scope="module")
def cycling_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """A Triton of this module's own: the test unloads one of its models, which must not
    depend on (or disturb) what other modules did with the session's shared Triton."""
    require_model(CYCLED)
    require_model(CALLED)
    ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
    log = tmp_path_factory.mktemp("cycling-triton") / "tritonserver.log"
    with started_then_killed(LocalTriton(models=[CYCLED, CALLED], ports=ports, log_path=log)) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(cycling_triton: LocalTriton) -> Iterator[GatewayThread]:
    with GatewayThread(gateway_config(cycling_triton.ports.grpc_url)) as running:
        yield running


def test_loading_and_unloading_a_model_leaves_other_models_serving(
    cycling_triton: LocalTriton, gateway: GatewayThread
) -> None:
    triton = cycling_triton
    admin = bearer(ADMIN_KEY)
    tally = Tally()
    stop = threading.Event()
    caller = threading.Thread(target=call_until, args=(stop, gateway, tally), daemon=True)
    with (
        grpcclient.InferenceServerClient(gateway.url) as through_gateway,
        grpc.insecure_channel(gateway.url) as gateway_channel,
        grpc.insecure_channel(triton.ports.grpc_url) as triton_channel,
    ):
        gateway_stub = service_pb2_grpc.GRPCInferenceServiceStub(gateway_channel)
        triton_stub = service_pb2_grpc.GRPCInferenceServiceStub(triton_channel)
        caller.start()
        try:
            for _ in range(CYCLES):
                # The admin's own RPCs go through the gateway while a model is in transition.
                through_gateway.unload_model(CYCLED, headers=admin)
                wait_for(lambda: repository_state(through_gateway, CYCLED, admin) == "UNAVAILABLE")
                # A call to the unloaded model gets what Triton itself says, not "no upstream".
                answers = []
                for stub, metadata in ((gateway_stub, ACME), (triton_stub, None)):
                    with pytest.raises(grpc.RpcError) as caught:
                        stub.ModelInfer(identity_request(), metadata=metadata, timeout=10)
                    answers.append((caught.value.code(), caught.value.details()))
                assert answers[0] == answers[1]
                assert answers[0][0] == grpc.StatusCode.NOT_FOUND
                through_gateway.load_model(CYCLED, headers=admin)
                assert through_gateway.is_model_ready(CYCLED, headers=admin)
                # Served as soon as Triton has it ready again.
                assert identity_served(gateway_stub)
        finally:
            stop.set()
            caller.join(timeout=60)
            # Leave the session's Triton as it was found, whatever failed.
            if not triton_stub.ModelReady(service_pb2.ModelReadyRequest(name=CYCLED), timeout=10).ready:
                load = service_pb2.RepositoryModelLoadRequest(model_name=CYCLED)
                triton_stub.RepositoryModelLoad(load, timeout=120)
    print(
        f"\n{CALLED} calls during {CYCLES} {CYCLED} unload/load cycles: {tally.calls}, "
        f"failures: {len(tally.failures)}"
    )
    assert tally.failures == []
    assert tally.calls >= 2 * CYCLES  # the tenant really called all along
    assert tally.health == {SERVING}


def first_success(attempt: Callable[[], bool], timeout_s: float) -> float:
    """The monotonic time at which `attempt` first returned true, polled every 20 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if attempt():
                return time.monotonic()
        except grpc.RpcError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"no success in {timeout_s:.0f}s")


def triton_ready(url: str) -> bool:
    # A fresh channel each time: no reconnect backoff of its own can delay the answer.
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=0.5).ready


def probe(gateway: GatewayThread, path: str) -> int:
    """The status a kubelet's HTTP probe of `path` on the metrics port gets."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.gateway.metrics_port}{path}", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_triton_killed_and_restarted_is_served_again_within_2s_of_its_readiness(tmp_path) -> None:
    require_model("identity")
    ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
    server = LocalTriton(models=["identity"], ports=ports, log_path=tmp_path / "triton.log")
    try:
        with server, GatewayThread(
            gateway_config(ports.grpc_url), health_check_interval_s=1.0  # the production default
        ) as gateway, grpc.insecure_channel(gateway.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert identity_served(stub)
            assert health_of(channel) == SERVING

            assert probe(gateway, "/readyz") == probe(gateway, "/healthz") == 200
            kill_triton(server)
            wait_for(lambda: health_of(channel) != SERVING, timeout_s=30)
            # Not ready without a live Triton, yet alive: a Triton outage restarts no gateway.
            assert (probe(gateway, "/readyz"), probe(gateway, "/healthz")) == (503, 200)
            # Long enough down that gRPC's default backoff would have grown past 2 s.
            time.sleep(4)
            server.start()  # the same ports

            ready_at: list[float] = []
            watcher = threading.Thread(
                target=lambda: ready_at.append(first_success(lambda: triton_ready(ports.grpc_url), 120))
            )
            watcher.start()
            serving_at = first_success(lambda: health_of(channel) == SERVING, 120)
            served_at = first_success(lambda: identity_served(stub), 120)
            watcher.join(timeout=130)
            serving_gap, served_gap = serving_at - ready_at[0], served_at - ready_at[0]
            print(
                f"\nfrom Triton ready to gateway SERVING: {serving_gap:.2f} s, "
                f"to the first call served: {served_gap:.2f} s"
            )
            assert serving_gap <= 2.0
            assert served_gap <= 2.0
            assert probe(gateway, "/readyz") == 200
    finally:
        server.stop()
