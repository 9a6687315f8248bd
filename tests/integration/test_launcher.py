"""LocalTriton: a failed load says why, and so does one that never ends. (That a clean stop leaves no process behind is
tested where a vLLM server ends anyway: the last test of test_smollm2.py stops its
one-slot server.)

This starts its own tritonserver (not the session one) because it makes it fail.
"""

from __future__ import annotations

import os
import pathlib
import textwrap

import pytest

from conftest import free_port
from qosgate.launcher import LocalTriton, TritonPorts, TritonStartError, TritonStartTimeout

pytestmark = pytest.mark.integration


def _ports() -> TritonPorts:
    return TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())


def _server_of(tmp_path: pathlib.Path, name: str, initialize: str) -> LocalTriton:
    """A tritonserver (not started) of one python-backend model whose initialize runs
    `initialize`."""
    model = tmp_path / "repo" / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        textwrap.dedent(
            """
            backend: "python"
            max_batch_size: 0
            input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
            output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
            """
        )
    )
    (model / "1" / "model.py").write_text(
        "import time\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
        f"        {initialize}\n"
    )
    return LocalTriton(models=[name], ports=_ports(), model_repository=model.parent, log_path=tmp_path / "triton.log")


def test_model_that_fails_to_load_raises_with_the_log_tail(tmp_path: pathlib.Path) -> None:
    server = _server_of(tmp_path, "broken", 'raise RuntimeError("weights for broken-model-7f3a are missing")')
    with pytest.raises(TritonStartError) as failed, server:
        pass
    message = str(failed.value)
    assert "exited" in message
    assert "weights for broken-model-7f3a are missing" in message
    assert server.pid is None  # stopped: nothing left to clean up


def test_a_load_that_never_ends_times_out_with_the_log_tail_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    server = _server_of(tmp_path, "stuck", 'print("loading stuck-model-51c2", flush=True); time.sleep(3600)')
    server.start()
    group = server.pid
    assert group is not None
    with pytest.raises(TritonStartTimeout) as failed:
        server.wait_ready(timeout=6)
    message = str(failed.value)
    assert "not ready after 6s" in message
    assert "loading stuck-model-51c2" in message  # what it was doing, from its log
    assert server.pid is None
    with pytest.raises(ProcessLookupError):  # its stub, stuck in initialize, too
        os.killpg(group, 0)
