"""Config loading: the shipped files load, and each kind of mistake gets its exact message."""

from __future__ import annotations

import pathlib
import re

import pytest
from pydantic import BaseModel
from qosgate import paths
from qosgate.auth import TenantDirectory
from qosgate.cli import main
from qosgate.config import (
    ApiKeyConfig,
    BatchConfig,
    BatchTenantLimits,
    ClientCertConfig,
    ConfigError,
    GatewayConfig,
    JobStoreConfig,
    LimitsConfig,
    ListenerTlsConfig,
    ModelPolicy,
    OpenAIConfig,
    TracingConfig,
    QuotaStoreConfig,
    ResourceLimits,
    RoutingConfig,
    SchedulerConfig,
    TenantConfig,
    UpstreamConfig,
    UpstreamTlsConfig,
    load_config,
    parse_config,
)
from qosgate.scheduler.classes import initial_window, sheddable_classes

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "config"
CLASSES = "(classes: critical, interactive, standard, batch)"

# One fixture per config error, checked against the exact message (file: key path: reason).
EXPECTED_ERRORS = {
    "admin_not_bool": (
        "tenants[0].admin: Input should be a valid boolean, unable to interpret input"
    ),
    "api_key_bad_sha256": "tenants[0].api_keys[0].sha256: must be 64 lower-case hex digits",
    "api_key_both_forms": "tenants[0].api_keys[0]: set exactly one of sha256, key",
    "api_key_empty": "tenants[0].api_keys[0].key: must not be empty",
    "burst_without_rate": "tenants[0].limits.burst: burst requires requests_per_second",
    "burst_zero": "tenants[1].limits.burst: Input should be greater than or equal to 1",
    "default_above_max": (
        "tenants[0].default_class: default class 'critical' is above max_class 'interactive'"
    ),
    "dispatch_window_zero": "models.smollm2.dispatch_window: must be `auto` or an integer >= 1",
    "dispatch_window_word": "models.smollm2.dispatch_window: must be `auto` or an integer >= 1",
    "window_bounds_crossed": "models.smollm2.window_min: must not be above window_max",
    "duplicate_api_key": "tenants[1].api_keys[0]: duplicate API key (also used by tenant 'acme')",
    "duplicate_class": "classes[2]: duplicate class 'standard'",
    "duplicate_tenant": "tenants[1].name: duplicate tenant 'acme'",
    "duplicate_upstream": "upstreams[1].name: duplicate upstream 'local'",
    "empty_classes": "classes: List should have at least 1 item after validation, not 0",
    "floor_shares_too_large": (
        "scheduler: floor shares of the lower classes must sum to less than 1"
    ),
    "exclusive_unknown_class": f"models.minilm.exclusive_classes[1]: unknown class 'gold' {CLASSES}",
    "floor_unknown_class": f"scheduler.floor_share_by_class.gold: unknown class 'gold' {CLASSES}",
    "job_store_bad_url": (
        "job_store.postgres_url: must start with postgresql:// or postgres://"
    ),
    "job_store_password_in_url": (
        "job_store.postgres_url: must not contain a password: name its variable in password_env"
    ),
    "missing_tenant_name": "tenants[0].name: Field required",
    "not_a_mapping": "(root): expected a mapping, got list",
    "sheddable_highest": (
        "scheduler.sheddable_classes[1]: the highest class 'critical' is never sheddable"
    ),
    "unknown_class": f"tenants[0].max_class: unknown class 'gold' {CLASSES}",
    "unknown_key": "tenant: unknown key (did you mean 'tenants'?)",
    "unknown_nested_key": "models.smollm2.dispatch_windw: unknown key (did you mean 'dispatch_window'?)",
    "unknown_key_no_match": (
        "quota_store.flavour: unknown key (known here: backend, key_prefix, lease_s, "
        "on_error, password_env, redis_url, timeout_s)"
    ),
    "weight_not_positive": "tenants[0].weight: Input should be greater than 0",
    "yaml_syntax": "line 4, column 1: invalid YAML: expected ',' or ']', but got '<stream end>'",
}


def test_every_error_fixture_has_an_expected_message() -> None:
    assert sorted(p.stem for p in (FIXTURES / "errors").glob("*.yaml")) == sorted(EXPECTED_ERRORS)


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_config_error_message(name: str) -> None:
    path = FIXTURES / "errors" / f"{name}.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: {EXPECTED_ERRORS[name]}"


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"^/nonexistent/x\.yaml: cannot read: No such file"):
        load_config("/nonexistent/x.yaml")


def test_every_problem_is_reported_one_per_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"listen": 1, "tenants": [{"weight": -1}]}, source="c.yaml")
    assert str(caught.value).splitlines() == [
        "c.yaml: listen: Input should be a valid string",
        "c.yaml: tenants[0].name: Field required",
        "c.yaml: tenants[0].weight: Input should be greater than 0",
    ]


def test_errors_never_echo_a_key() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"tenants": [{"name": "a", "api_keys": [{"key": "s3cret", "x": 1}]}]})
    assert "s3cret" not in str(caught.value)
    config = parse_config({"tenants": [{"name": "a", "api_keys": [{"key": "s3cret"}]}]})
    assert "s3cret" not in repr(config) and "s3cret" not in config.model_dump_json()


def test_issue_example_loads() -> None:
    config = load_config(FIXTURES / "issue_example.yaml")
    acme, ops = config.tenants
    assert (acme.weight, acme.default_class, acme.max_class) == (2, "interactive", "critical")
    assert acme.limits.burst == 100 and acme.limits.max_concurrent == 64
    assert ops.admin and ops.models == ["*"]
    directory = TenantDirectory(config)
    assert directory.identify([("x-api-key", "acme-key")]).name == "acme"


def test_shipped_demo_config() -> None:
    config = load_config(paths.project_root() / "config" / "demo.yaml")
    directory = TenantDirectory(config)
    acme = directory.identify([("authorization", "Bearer demo-acme-key")])
    globex = directory.identify([("authorization", "Bearer demo-globex-key")])
    ops = directory.identify([("x-api-key", "demo-admin-key")])
    assert (acme.name, acme.max_class, acme.weight) == ("acme", "critical", 2)
    assert (globex.name, globex.max_class, globex.admin) == ("globex", "interactive", False)
    assert (ops.name, ops.admin) == ("ops", True)
    assert not globex.allows_model("identity") and acme.allows_model("identity")
    assert config.upstreams[0].url == "127.0.0.1:8001"
    assert {"smollm2", "minilm"} <= set(config.models)
    # The demo keys appear in plain text only where the file says they are demo keys.
    text = (paths.project_root() / "config" / "demo.yaml").read_text()
    assert "DEMO KEY" in text


def test_defaults() -> None:
    config = GatewayConfig()
    assert config.listen == "127.0.0.1:50051"
    assert config.metrics_listen == "127.0.0.1:9464"
    assert config.classes == ["critical", "interactive", "standard", "batch"]
    assert [u.url for u in config.upstreams] == ["127.0.0.1:8001"]
    assert config.model_policy("anything") == config.default_model_policy
    assert sheddable_classes(config) == ["batch", "standard", "interactive"]
    assert config.floor_share("critical") == 0.0 and config.floor_share("batch") == 0.05
    policy = config.default_model_policy
    assert policy.dispatch_window == "auto" and initial_window(policy) == 8
    assert (policy.window_min, policy.window_max, policy.cost_unit) == (2, 256, "request")
    assert config.scheduler.latency_objective == {}
    assert config.scheduler.fair_share == "cost" and config.scheduler.output_token_weight == 2.0
    assert config.limits.max_request_bytes == config.limits.max_response_bytes == 64 << 20
    assert config.limits.max_streams_per_tenant == 32


def test_limits_are_validated_with_their_key_path() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "limits": {"max_request_bytes": 1 << 31, "stream_buffer_bytes": 0},
                "tenants": [{"name": "acme", "limits": {"max_streams": 0}}],
            },
            source="gw.yaml",
        )
    assert sorted(str(caught.value).splitlines()) == [
        "gw.yaml: limits.max_request_bytes: Input should be less than or equal to 2147483647",
        "gw.yaml: limits.stream_buffer_bytes: Input should be greater than or equal to 1024",
        "gw.yaml: tenants[0].limits.max_streams: Input should be greater than or equal to 1",
    ]


def test_class_levels_follow_the_class_list() -> None:
    config = parse_config({"classes": ["gold", "silver", "bronze"]})
    assert [config.class_level(c) for c in ["gold", "silver", "bronze"]] == [1, 2, 3]
    with pytest.raises(KeyError):
        config.class_level("critical")
    # Without a `standard` class, tenants default to the lowest class.
    assert config.gateway_default_class() == "bronze"


def test_tenant_class_defaults() -> None:
    config = parse_config(
        {
            "default_class": "batch",
            "tenants": [
                {"name": "a", "api_keys": [{"key": "ka"}]},
                {"name": "b", "api_keys": [{"key": "kb"}], "default_class": "standard"},
                {"name": "c", "api_keys": [{"key": "kc"}], "max_class": "critical"},
            ],
        }
    )
    a, b, c = TenantDirectory(config).tenants
    assert (a.default_class, a.max_class) == ("batch", "batch")
    assert (b.default_class, b.max_class) == ("standard", "standard")
    assert (c.default_class, c.max_class) == ("batch", "critical")


def test_check_config_command(capsys: pytest.CaptureFixture[str]) -> None:
    demo = paths.project_root() / "config" / "demo.yaml"
    assert main(["check-config", str(demo)]) == 0
    out = capsys.readouterr().out
    summary = (
        "3 tenants (1 admin), 4 classes, 3 model policies, 1 upstreams, listen 127.0.0.1:50051"
    )
    assert out == f"{demo}: ok: {summary}\n"
    bad = FIXTURES / "errors" / "burst_zero.yaml"
    assert main(["check-config", str(bad)]) != 0
    err = capsys.readouterr().err
    assert err == f"{bad}: tenants[1].limits.burst: Input should be greater than or equal to 1\n"


def test_configuration_reference_documents_every_config_key() -> None:
    reference = (paths.project_root() / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)`", reference, flags=re.MULTILINE))
    models: list[type[BaseModel]] = [
        GatewayConfig,
        BatchConfig,
        BatchTenantLimits,
        TracingConfig,
        UpstreamConfig,
        SchedulerConfig,
        ModelPolicy,
        TenantConfig,
        LimitsConfig,
        QuotaStoreConfig,
        JobStoreConfig,
        ResourceLimits,
        OpenAIConfig,
    ]
    keys = {name for model in models for name in model.model_fields}
    keys |= {f"api_keys[].{name}" for name in ApiKeyConfig.model_fields}
    keys |= {f"client_certs[].{name}" for name in ClientCertConfig.model_fields}
    keys |= {f"tls.{name}" for model in (ListenerTlsConfig, UpstreamTlsConfig) for name in model.model_fields}
    keys |= {f"routing.{name}" for name in RoutingConfig.model_fields}
    assert keys - documented == set()


def test_reload_takes_the_new_tenants_and_names_keys_needing_restart() -> None:
    running = parse_config({"tenants": [{"name": "acme", "api_keys": [{"key": "k1"}]}]})
    edited = parse_config(
        {
            "listen": "127.0.0.1:6000",
            "scheduler": {"max_queue_length": 7},
            "tenants": [{"name": "globex", "api_keys": [{"key": "k2"}], "max_class": "critical"}],
        }
    )
    merged = running.with_tenants_of(edited)
    assert [t.name for t in merged.tenants] == ["globex"]
    assert merged.listen == running.listen and merged.scheduler == running.scheduler
    assert running.keys_needing_restart(edited) == ["listen", "scheduler"]
    assert running.keys_needing_restart(running.with_tenants_of(edited)) == []


def test_reload_refuses_tenants_that_do_not_fit_the_running_config() -> None:
    running = parse_config(
        {
            "tenants": [{"name": "acme", "api_keys": [{"key": "k1"}]}],
            "batch": {"tenants": {"acme": {"max_queued_items": 5}}},
        }
    )
    # Valid on its own (its own classes, no batch override), but not with what runs now.
    edited = parse_config(
        {
            "classes": ["gold", "bronze"],
            "tenants": [{"name": "globex", "api_keys": [{"key": "k2"}], "default_class": "gold"}],
        }
    )
    with pytest.raises(ConfigError) as refused:
        running.with_tenants_of(edited)
    assert str(refused.value).splitlines() == [
        f"tenants[0].default_class: unknown class 'gold' {CLASSES}",
        "batch.tenants.acme: unknown tenant 'acme'",
    ]
