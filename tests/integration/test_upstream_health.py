"""Upstream health on a real tritonserver: a model's load or unload touches only that model.

Regression test of issue 10's finding: an admin unloading and reloading one model made
every other tenant's calls fail `UNAVAILABLE: no healthy Triton upstream` (the gateway
read Triton's ServerReady, false while any model loads or unloads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import require_model
from gateway_harness import ACME_KEY, ADMIN_KEY, GatewayThread, bearer, gateway_config

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
def gateway(triton) -> Iterator[GatewayThread]:
    with GatewayThread(gateway_config(triton.ports.grpc_url)) as running:
        yield running


def test_loading_and_unloading_a_model_leaves_other_models_serving(triton, gateway) -> None:
    require_model(CYCLED)
    require_model(CALLED)
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
