"""LocalTriton: a clean stop leaves no process behind; a failed load says why.

These start their own tritonserver (not the session one) because they stop it or make
it fail.
"""

from __future__ import annotations

import os
import pathlib
import textwrap
import time

import psutil
import pytest

from conftest import free_port, require_model
from qosgate.launcher import LocalTriton, TritonPorts, TritonStartError

pytestmark = pytest.mark.integration


def _ports() -> TritonPorts:
    return TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())


def _process_tree(root_pid: int) -> list[psutil.Process]:
    """The server, its descendants and anything else in its process group."""
    root = psutil.Process(root_pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == root_pid:
                found.setdefault(proc.pid, proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return list(found.values())


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_leaves_no_process_behind(tmp_path: pathlib.Path) -> None:
    require_model("smollm2")
    # The last CPU: vLLM, left to itself, binds its compute to the first.
    cpu = max(os.sched_getaffinity(0))
    server = LocalTriton(models=["smollm2"], ports=_ports(), log_path=tmp_path / "triton.log", cpus=[cpu])
    with server:
        assert server.pid is not None
        tree = _process_tree(server.pid)
        names = [_describe(p) for p in tree]
        # vLLM's engine runs in processes of its own: the ones that used to outlive
        # a killed tritonserver.
        assert any("EngineCore" in name for name in names), names
        assert any("triton_python_backend_stub" in name for name in names), names
        # Its worker computes on the CPUs given, and on no other.
        workers = [p for p in tree if "VLLM::Worker" in p.name()]
        assert workers and all(set(p.cpu_affinity()) == {cpu} for p in workers), names
    # multiprocessing's resource tracker ignores SIGTERM and leaves when its parent's pipe
    # closes: give such helpers a bounded moment to see their parents gone.
    deadline = time.monotonic() + 10
    while (leftovers := [_describe(p) for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers == []


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
