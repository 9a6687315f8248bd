"""The vLLM backend's engine on a CPU: one process (vLLM's `uni` executor) and where its
threads compute (backends/vllm/model.py's one_process_cpu_engine, pure logic)."""

from __future__ import annotations

import importlib.util
import sys
import types
from types import ModuleType

import pytest

from qosgate import paths


def _backend() -> ModuleType:
    # The backend runs in Triton's python stub, which provides triton_python_backend_utils;
    # the functions under test do not use it, so an empty module stands in while it loads.
    path = paths.project_root() / "backends" / "vllm" / "model.py"
    spec = importlib.util.spec_from_file_location("qosgate_vllm_backend", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    stand_ins = {"triton_python_backend_utils": types.ModuleType("triton_python_backend_utils"), spec.name: module}
    with pytest.MonkeyPatch.context() as patch:
        for name, stand_in in stand_ins.items():
            patch.setitem(sys.modules, name, stand_in)
        spec.loader.exec_module(module)
    return module


BACKEND = _backend()
UNI = {"distributed_executor_backend": "uni"}
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def no_smt(cpu: int) -> int:
    return cpu


def smt_pairs(cpu: int) -> int:  # logical CPUs 2k and 2k+1 share a core
    return cpu - cpu % 2


@pytest.mark.parametrize(
    ("allowed", "core_of", "bound"),
    [
        ([0, 1], no_smt, [0]),  # the last core is left to Triton and a gateway beside it
        ([0, 1, 2, 3, 4, 5, 6, 7], no_smt, [0, 1, 2, 3, 4, 5, 6]),
        ([0, 1, 2, 3, 4, 5, 6, 7], smt_pairs, [0, 2, 4]),  # one logical CPU per core
        ([5], no_smt, [5]),  # one CPU: the engine's
        ([3, 9], no_smt, [3]),
    ],
)
def test_auto_binds_one_cpu_per_core_less_the_last(allowed: list[int], core_of, bound: list[int]) -> None:
    settings, env, cpus = BACKEND.one_process_cpu_engine({"model": "m"}, {}, allowed, core_of)
    assert settings == {"model": "m", **UNI}
    assert cpus == bound
    assert env == {**ONE_PROCESS, "OMP_NUM_THREADS": str(len(bound)), "GOMP_CPU_AFFINITY": " ".join(map(str, bound))}


@pytest.mark.parametrize(
    ("mask", "bound"),
    [("1", [1]), ("0-3,8", [0, 1, 2, 3, 8]), ("6,2", [6, 2])],
)
def test_a_cpu_list_binds_the_engine_to_those_cpus(mask: str, bound: list[int]) -> None:
    _, env, cpus = BACKEND.one_process_cpu_engine({}, {"VLLM_CPU_OMP_THREADS_BIND": mask}, [0, 1], no_smt)
    assert cpus == bound
    assert env["OMP_NUM_THREADS"] == str(len(bound))
    assert env["GOMP_CPU_AFFINITY"].split() == [str(cpu) for cpu in bound]


def test_nobind_leaves_the_engine_free() -> None:
    settings, env, cpus = BACKEND.one_process_cpu_engine({}, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, [0, 1])
    assert (settings, env, cpus) == (UNI, ONE_PROCESS, [])


@pytest.mark.parametrize(
    "settings",
    [
        {"distributed_executor_backend": "mp"},
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
    ],
)
def test_an_executor_or_several_ranks_in_model_json_keep_vllms_choice(settings: dict) -> None:
    assert BACKEND.one_process_cpu_engine(settings, {}, [0, 1]) == (settings, {}, [])


@pytest.mark.parametrize("mask", ["0-3|4-7", "all", "1,,2", ""])
def test_a_mask_that_is_no_cpu_list_is_an_error(mask: str) -> None:
    with pytest.raises(ValueError):
        BACKEND.one_process_cpu_engine({}, {"VLLM_CPU_OMP_THREADS_BIND": mask}, [0, 1])
