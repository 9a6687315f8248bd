"""LocalTriton: a failed load says why. (That a clean stop leaves no process behind is
tested where a vLLM server ends anyway: the last test of test_smollm2.py stops its
one-slot server.)

This starts its own tritonserver (not the session one) because it makes it fail.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from conftest import free_port
from qosgate.launcher import LocalTriton, TritonPorts, TritonStartError

pytestmark = pytest.mark.integration


def _ports() -> TritonPorts:
    return TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())


def test_model_that_fails_to_load_raises_with_the_log_tail(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "repo" / "broken"
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
        textwrap.dedent(
            """
            class TritonPythonModel:
                def initialize(self, args):
                    raise RuntimeError("weights for broken-model-7f3a are missing")
            """
        )
    )
    server = LocalTriton(
        models=["broken"],
        ports=_ports(),
        model_repository=tmp_path / "repo",
        log_path=tmp_path / "triton.log",
    )
    with pytest.raises(TritonStartError) as failed, server:
        pass
    message = str(failed.value)
    assert "exited" in message
    assert "weights for broken-model-7f3a are missing" in message
    assert server.pid is None  # stopped: nothing left to clean up
