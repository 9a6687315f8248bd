"""The bench's stack of processes: a Triton that dies under a measurement (tritonserver
2.51 crashes now and then under perf_analyzer --streaming) is started again on its ports."""

from __future__ import annotations

import os
import signal
import time

import tritonclient.grpc as grpcclient

from bench.stack import Stack
from tests.conftest import require_model


def test_a_triton_that_died_is_started_again_on_its_ports() -> None:
    require_model("identity")
    with Stack(models=["identity"]) as stack:
        assert stack.restart_dead_tritons() == []  # nothing died: nothing restarted
        triton = stack.triton
        assert triton is not None and triton.pid is not None
        url = stack.triton_url
        os.kill(triton.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 30
        while stack.triton_failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.triton_failure() is not None

        assert stack.restart_dead_tritons() == [f"tritonserver on {url} died (signal 11)"]
        assert stack.triton_failure() is None
        assert stack.triton_url == url
        client = grpcclient.InferenceServerClient(url)
        try:
            assert client.is_model_ready("identity")
        finally:
            client.close()
