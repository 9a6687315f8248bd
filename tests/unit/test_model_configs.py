"""Every Triton model config in the repository parses against Triton's own schema.

Configs are found by glob, so a new model is checked without touching this file. A
template (docker/) is filled first with the sample values documented beside it, by the
same code a deployer runs (docker/fill_templates.py).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from types import ModuleType
from urllib.parse import urlsplit

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from qosgate import paths
from qosgate.config import load_config

ROOT = paths.project_root()
TREES = (ROOT / "model_repository", ROOT / "docker")
VALUES_FILE = "values.example.json"

CONFIGS = sorted(p for tree in TREES for p in tree.rglob("config.pbtxt"))
MODEL_JSONS = sorted(p for tree in TREES for p in tree.rglob("*/[0-9]*/model.json"))
MODEL_PYS = sorted(p for tree in TREES for p in tree.rglob("*/[0-9]*/model.py"))


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _fill_templates() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fill_templates", ROOT / "docker/fill_templates.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILL = _fill_templates()


def sample_values(config: pathlib.Path) -> dict[str, object]:
    """The documented sample values of the template set a config belongs to (may be none)."""
    for folder in config.parents:
        candidate = folder / VALUES_FILE
        if candidate.exists():
            return json.loads(candidate.read_text())
        if folder == ROOT:
            break
    return {}


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def load(config: pathlib.Path) -> model_config_pb2.ModelConfig:
    return parse(FILL.fill(config.read_text(), sample_values(config)))


def test_the_glob_finds_the_models_we_ship() -> None:
    found = {_relative(p.parent) for p in CONFIGS}
    assert {
        "model_repository/minilm",
        "model_repository/identity",
        "docker/models/vllm/llama31_8b_instruct",
        "docker/models/trtllm/ensemble",
        "docker/models/trtllm/tensorrt_llm",
    } <= found


@pytest.mark.parametrize("config", CONFIGS, ids=_relative)
def test_config_parses_and_is_named_after_its_folder(config: pathlib.Path) -> None:
    model = load(config)
    # Triton takes the folder name when `name` is absent, and refuses a different one.
    assert model.name in ("", config.parent.name)
    assert model.backend or model.platform, "a config must say which backend runs it"
    for tensor in [*model.input, *model.output]:
        assert tensor.data_type != model_config_pb2.TYPE_INVALID, tensor.name
        assert list(tensor.dims), f"{tensor.name} has no dims"


@pytest.mark.parametrize("config", CONFIGS, ids=_relative)
def test_every_placeholder_has_a_sample_value(config: pathlib.Path) -> None:
    missing = FILL.placeholders(config.read_text()) - sample_values(config).keys()
    assert not missing, f"document sample values for {sorted(missing)} in {VALUES_FILE}"


@pytest.mark.parametrize("model_json", MODEL_JSONS, ids=_relative)
def test_model_json_is_an_engine_argument_object(model_json: pathlib.Path) -> None:
    settings = json.loads(model_json.read_text())
    assert isinstance(settings, dict)
    assert isinstance(settings.get("model"), str) and settings["model"]


@pytest.mark.parametrize("model_py", MODEL_PYS, ids=_relative)
def test_python_model_compiles(model_py: pathlib.Path) -> None:
    compile(model_py.read_text(), str(model_py), "exec")


def test_a_typo_fails_the_check() -> None:
    with pytest.raises(text_format.ParseError, match="dynamic_batchin"):
        parse('name: "minilm"\nbackend: "python"\ndynamic_batchin { }\n')
    with pytest.raises(text_format.ParseError):
        parse('input [ { name: "text" data_type: TYPE_STRNG dims: [ 1 ] } ]')


def test_a_template_value_left_out_fails_the_check() -> None:
    with pytest.raises(KeyError, match="engine_dir"):
        FILL.fill('parameters { key: "p" value { string_value: "${engine_dir}" } }', {})


def test_fill_writes_booleans_as_pbtxt_literals() -> None:
    model = parse(FILL.fill("model_transaction_policy { decoupled: ${d} }", {"d": True}))
    assert model.model_transaction_policy.decoupled is True


def test_fill_repository_refuses_values_no_template_uses(tmp_path: pathlib.Path) -> None:
    template = ROOT / "docker/models/trtllm"
    values = {**sample_values(template / "ensemble/config.pbtxt"), "engine_dri": "/typo"}
    with pytest.raises(SystemExit, match="engine_dri"):
        FILL.fill_repository(template, values, tmp_path / "out")


def test_fill_repository_produces_a_loadable_layout(tmp_path: pathlib.Path) -> None:
    template = ROOT / "docker/models/trtllm"
    out = tmp_path / "trtllm"
    FILL.fill_repository(template, sample_values(template / "ensemble/config.pbtxt"), out)
    for config in out.rglob("config.pbtxt"):
        assert "${" not in config.read_text()
        parse(config.read_text())
        # Triton needs at least one version folder per model, ensembles included.
        assert any(p.is_dir() and p.name.isdigit() for p in config.parent.iterdir()), config


# Chosen by text, not by parsing: a broken config must fail its own test, not collection.
ENSEMBLES = [p for p in CONFIGS if 'platform: "ensemble"' in p.read_text()]


@pytest.mark.parametrize("config", ENSEMBLES, ids=_relative)
def test_ensemble_steps_fit_the_models_they_call(config: pathlib.Path) -> None:
    ensemble = load(config)
    # Tensors available so far, with their types: the ensemble's inputs, then each
    # step's outputs in order.
    available = {t.name: t.data_type for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        step_config = config.parent.parent / step.model_name / "config.pbtxt"
        assert step_config.exists(), f"step model {step.model_name} not in the repository"
        model = load(step_config)
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t.data_type for t in model.output}
        for key, source in step.input_map.items():
            assert key in inputs, f"{step.model_name} has no input {key}"
            assert source in available, f"{source} is not produced before {step.model_name}"
            assert available[source] == inputs[key].data_type, f"{source} -> {key}: type differs"
        required = {name for name, t in inputs.items() if not t.optional}
        assert required <= set(step.input_map), f"{step.model_name} misses {required - set(step.input_map)}"
        for key, target in step.output_map.items():
            assert key in outputs, f"{step.model_name} has no output {key}"
            available[target] = outputs[key]
    for tensor in ensemble.output:
        assert available.get(tensor.name) == tensor.data_type, f"output {tensor.name} not produced"


def test_minilm_has_one_priority_level_per_gateway_class() -> None:
    batching = load(ROOT / "model_repository/minilm/config.pbtxt").dynamic_batching
    assert batching.priority_levels == 4
    assert 1 <= batching.default_priority_level <= 4
    assert set(batching.priority_queue_policy) == {1, 2, 3, 4}
    for level, policy in batching.priority_queue_policy.items():
        assert policy.max_queue_size > 0, level
        assert policy.default_timeout_microseconds > 0, level
        # The gateway turns each caller's deadline into Triton's per-request timeout.
        assert policy.allow_timeout_override, level
    # Higher classes get shorter backstop timeouts and shorter queues.
    ordered = [batching.priority_queue_policy[level] for level in (1, 2, 3, 4)]
    assert [p.default_timeout_microseconds for p in ordered] == sorted(
        p.default_timeout_microseconds for p in ordered
    )
    assert [p.max_queue_size for p in ordered] == sorted(p.max_queue_size for p in ordered)


# docker/ cannot be built here (no docker engine): check what can be parsed.
COMPOSE = ROOT / "docker/docker-compose.yml"


def test_compose_runs_triton_gateway_redis_and_postgres_from_files_that_exist() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    assert set(compose["services"]) == {"triton", "gateway", "redis", "postgres"}
    for service in compose["services"].values():
        build = service.get("build")
        if build:
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            # `SOURCE:TARGET[:ro]`; with `${VAR:-default}` the default must exist.
            source = re.match(r"\$\{\w+:-([^}]*)\}|([^:]*)", volume).group(1, 2)
            path = source[0] or source[1]
            if path.startswith("."):
                assert (COMPOSE.parent / path).exists(), volume
    # Tenants must not reach Triton, Redis or PostgreSQL around the gateway.
    for internal in ("triton", "redis", "postgres"):
        assert "ports" not in compose["services"][internal]


def test_compose_gateway_config_is_valid() -> None:
    config = load_config(ROOT / "docker/gateway.yaml")
    assert [u.url for u in config.upstreams] == ["triton:8001"]
    assert "llama31_8b_instruct" in config.models and "ensemble" in config.models


def test_compose_gateway_keeps_jobs_in_the_compose_postgres() -> None:
    store = load_config(ROOT / "docker/gateway.yaml").job_store
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    postgres, gateway = services["postgres"], services["gateway"]
    url = urlsplit(store.postgres_url)
    assert store.backend == "postgres" and url.hostname == "postgres"
    assert str(url.port) in postgres["expose"]
    env = postgres["environment"]
    assert (url.username, url.path.lstrip("/")) == (env["POSTGRES_USER"], env["POSTGRES_DB"])
    assert store.password_env is not None
    assert gateway["environment"][store.password_env] == env["POSTGRES_PASSWORD"]
    assert "postgres" in gateway["depends_on"]


def _adapter_request(adapter_name: str):
    """What the gateway's adapter sends to a model, with every optional setting used."""
    from qosgate.generation_types import GenerationRequest, Sampling
    from qosgate.adapters.trtllm import TrtLlmEnsembleAdapter
    from qosgate.adapters.vllm import VllmAdapter

    adapter = {"trtllm": TrtLlmEnsembleAdapter, "vllm": VllmAdapter}[adapter_name]()
    sampling = Sampling(max_tokens=8, temperature=0.5, top_p=0.9, top_k=40, seed=1, stop=("\n",))
    request = GenerationRequest(model="m", prompt="Hi", sampling=sampling, stream=True)
    return adapter.encode(request, request_id="r")


@pytest.mark.parametrize(
    ("config", "adapter_name"),
    [
        ("docker/models/trtllm/ensemble/config.pbtxt", "trtllm"),
        ("docker/models/vllm/llama31_8b_instruct/config.pbtxt", "vllm"),
    ],
)
def test_gpu_model_accepts_what_the_gateway_adapter_sends(config: str, adapter_name: str) -> None:
    model = load(ROOT / config)
    inputs = {t.name: t for t in model.input}
    sent = _adapter_request(adapter_name)
    for tensor in sent.inputs:
        assert tensor.name in inputs, f"{config} has no input {tensor.name}"
        expected = model_config_pb2.DataType.Name(inputs[tensor.name].data_type)
        # KServe names STRING tensors BYTES; the rest share the suffix (TYPE_FP32 ~ FP32).
        assert expected.removeprefix("TYPE_").replace("STRING", "BYTES") == tensor.datatype
    required = {name for name, t in inputs.items() if not t.optional}
    assert required <= {t.name for t in sent.inputs}
