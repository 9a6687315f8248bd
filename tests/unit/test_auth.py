"""Identity from metadata, class resolution and the admin and model checks."""

from __future__ import annotations

import hashlib
import logging

import pytest
from qosgate.auth import ConnectionCredentials, TenantDirectory
from qosgate.config import parse_config
from qosgate.errors import InvalidArgument, PermissionDenied, Unauthenticated


@pytest.fixture
def directory() -> TenantDirectory:
    return TenantDirectory(
        parse_config(
            {
                "tenants": [
                    {
                        "name": "acme",
                        "api_keys": [{"key": "acme-1"}, {"key": "acme-2"}],
                        "default_class": "interactive",
                        "max_class": "critical",
                        "weight": 2,
                    },
                    {
                        "name": "globex",
                        "api_keys": [{"sha256": hashlib.sha256(b"globex-1").hexdigest()}],
                        "max_class": "interactive",
                        "models": ["smollm*", "minilm"],
                        "limits": {"requests_per_second": 5},
                    },
                    {"name": "ops", "admin": True, "api_keys": [{"key": "ops-1"}]},
                ]
            }
        )
    )


@pytest.mark.parametrize(
    ("metadata", "tenant"),
    [
        ([("authorization", "Bearer acme-1")], "acme"),
        ([("authorization", "bearer acme-2")], "acme"),
        ([("authorization", "BEARER   acme-2  ")], "acme"),
        ([("authorization", "  Bearer acme-2 ")], "acme"),
        ([("x-api-key", " globex-1\t")], "globex"),
        ([("x-api-key", "globex-1")], "globex"),
        ([("x-api-key", "ops-1"), ("other", "x"), ("other", "y")], "ops"),
        # Both headers naming the same key present one key.
        ([("authorization", "Bearer acme-1"), ("x-api-key", "acme-1")], "acme"),
    ],
)
def test_identify(directory: TenantDirectory, metadata: list[tuple[str, str]], tenant: str) -> None:
    assert directory.identify(metadata).name == tenant


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ([], "missing API key"),
        ([("authorization", "Bearer ")], "missing API key"),
        ([("authorization", "  Bearer  ")], "missing API key"),
        ([("authorization", "")], "missing API key"),
        ([("x-api-key", "   ")], "missing API key"),
        ([("authorization", "Bearer acme-1"), ("x-api-key", " ")], "different keys"),
        ([("authorization", "Basic YWNtZS0xOg==")], "must be 'Bearer <key>'"),
        ([("authorization", "acme-1")], "must be 'Bearer <key>'"),
        ([("authorization", "Bearer nope")], "invalid API key"),
        ([("x-api-key", "ACME-1")], "invalid API key"),
        # Ambiguous credentials are refused whichever comes first, valid key or not.
        ([("authorization", "Bearer nope"), ("authorization", "Bearer acme-1")], "more than one"),
        ([("authorization", "Bearer acme-1"), ("authorization", "Bearer nope")], "more than one"),
        ([("authorization", "Bearer acme-1"), ("authorization", "Bearer acme-1")], "more than one"),
        ([("x-api-key", "acme-1"), ("x-api-key", "globex-1")], "more than one"),
        ([("authorization", "Bearer nope"), ("x-api-key", "acme-1")], "different keys"),
        ([("x-api-key", "acme-1"), ("authorization", "Bearer globex-1")], "different keys"),
        ([("authorization", "Basic YWNtZS0xOg=="), ("x-api-key", "acme-1")], "must be 'Bearer <key>'"),
    ],
)
def test_identify_refuses(
    directory: TenantDirectory, metadata: list[tuple[str, str]], message: str
) -> None:
    with pytest.raises(Unauthenticated, match=message):
        directory.identify(metadata)


def raw(metadata: list[tuple[str, str]]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((name.encode(), value.encode()) for name, value in metadata)


@pytest.mark.parametrize(
    ("metadata", "tenant"),
    [
        ([("authorization", "Bearer acme-1")], "acme"),
        ([("x-api-key", "globex-1")], "globex"),
        ([("authorization", "Bearer acme-1"), ("x-api-key", "acme-1")], "acme"),
    ],
)
def test_identify_on_a_connection_answers_as_identify_every_time(
    directory: TenantDirectory, metadata: list[tuple[str, str]], tenant: str
) -> None:
    connection = ConnectionCredentials()
    assert [directory.identify_on(connection, raw(metadata)).name for _ in range(3)] == [tenant] * 3


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        [("authorization", "Bearer nope")],
        [("authorization", "acme-1")],
        [("x-api-key", "acme-1"), ("x-api-key", "acme-1")],
        [("x-api-key", "acme-1"), ("authorization", "Bearer globex-1")],
    ],
)
def test_identify_on_a_connection_refuses_every_time(
    directory: TenantDirectory, metadata: list[tuple[str, str]]
) -> None:
    connection = ConnectionCredentials()
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            directory.identify_on(connection, raw(metadata))
    assert connection.tenants == {}  # a refusal is not remembered


def test_a_connection_forgets_its_keys_when_the_tenants_are_reloaded(directory: TenantDirectory) -> None:
    connection = ConnectionCredentials()
    acme_1, acme_2 = raw([("x-api-key", "acme-1")]), raw([("x-api-key", "acme-2")])
    assert directory.identify_on(connection, acme_1).name == "acme"
    assert directory.identify_on(connection, acme_2).name == "acme"
    directory.replace(parse_config({"tenants": [{"name": "initech", "api_keys": [{"key": "acme-1"}]}]}))
    # The same connection, the same header bytes: the reloaded tenants answer.
    assert directory.identify_on(connection, acme_1).name == "initech"
    with pytest.raises(Unauthenticated):
        directory.identify_on(connection, acme_2)
    # Keys of one connection are its own: another starts with none of them.
    assert ConnectionCredentials().tenants == {}


def test_a_connection_remembers_a_few_keys_and_still_identifies_the_rest() -> None:
    keys = [f"key-{n}" for n in range(20)]
    directory = TenantDirectory(parse_config({"tenants": [{"name": "many", "api_keys": [{"key": k} for k in keys]}]}))
    connection = ConnectionCredentials()
    assert {directory.identify_on(connection, raw([("x-api-key", k)])).name for k in keys} == {"many"}
    assert 0 < len(connection.tenants) < len(keys)


def test_a_refused_key_appears_in_no_message_or_log(
    directory: TenantDirectory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Unauthenticated) as caught:
        directory.identify([("authorization", "Bearer s3cret-guess")])
    assert "s3cret" not in caught.value.message and "s3cret" not in caplog.text


def test_tenant_fields(directory: TenantDirectory) -> None:
    acme, globex, ops = directory.tenants
    assert (acme.weight, acme.default_class, acme.max_class) == (2, "interactive", "critical")
    assert (globex.default_class, globex.max_class) == ("standard", "interactive")
    assert globex.limits.requests_per_second == 5
    assert ops.admin and not acme.admin


def test_resolve_class(directory: TenantDirectory) -> None:
    acme, globex, _ = directory.tenants
    assert directory.resolve_class(acme, None) == "interactive"
    assert directory.resolve_class(acme, "") == "interactive"
    assert directory.resolve_class(acme, "critical") == "critical"
    assert directory.resolve_class(globex, "batch") == "batch"
    assert directory.resolve_class(globex, "interactive") == "interactive"
    with pytest.raises(PermissionDenied, match="may not use class 'critical'"):
        directory.resolve_class(globex, "critical")
    with pytest.raises(InvalidArgument, match="unknown priority class 'urgent'"):
        directory.resolve_class(acme, "urgent")


def test_models_are_fnmatch_patterns(directory: TenantDirectory) -> None:
    acme, globex, _ = directory.tenants
    assert acme.allows_model("anything")
    assert globex.allows_model("smollm2") and globex.allows_model("minilm")
    assert not globex.allows_model("identity")
    assert not globex.allows_model("minilm2")  # a pattern matches the whole name
    with pytest.raises(PermissionDenied, match="may not use model 'identity'"):
        directory.require_model(globex, "identity")
    directory.require_model(globex, "smollm2_trtllm")


def test_no_model_patterns_allow_nothing() -> None:
    config = parse_config({"tenants": [{"name": "a", "api_keys": [{"key": "k"}], "models": []}]})
    (tenant,) = TenantDirectory(config).tenants
    assert not tenant.allows_model("x")


def test_require_admin(directory: TenantDirectory) -> None:
    acme, _, ops = directory.tenants
    directory.require_admin(ops, "model load")
    with pytest.raises(PermissionDenied, match="model load requires an admin tenant"):
        directory.require_admin(acme, "model load")


def test_replace_swaps_keys_and_tenant_settings(directory: TenantDirectory) -> None:
    before = directory.identify([("x-api-key", "acme-1")])
    directory.replace(
        parse_config(
            {
                "tenants": [
                    {"name": "acme", "api_keys": [{"key": "acme-3"}], "weight": 5, "models": ["minilm"]},
                    {"name": "initech", "api_keys": [{"key": "acme-1"}]},
                ]
            }
        )
    )
    # The old key now names another tenant; the rotated-out key is refused.
    assert directory.identify([("x-api-key", "acme-1")]).name == "initech"
    with pytest.raises(Unauthenticated):
        directory.identify([("x-api-key", "acme-2")])
    with pytest.raises(Unauthenticated):
        directory.identify([("x-api-key", "globex-1")])
    acme = directory.identify([("x-api-key", "acme-3")])
    assert (acme.weight, acme.allows_model("smollm2")) == (5, False)
    assert directory.named("acme") is acme and directory.named("globex") is None
    assert [t.name for t in directory.tenants] == ["acme", "initech"]
    # A request identified before keeps what it was admitted as.
    assert (before.weight, before.allows_model("smollm2")) == (2, True)
