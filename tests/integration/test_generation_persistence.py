"""The daily token budget survives a gateway restart and a kill -9.

The gateway runs as a real subprocess (`qosgate serve`) so it can be killed with SIGKILL
in the middle of its life; the usage ledger (SQLite) is all that carries over.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import free_port, require_model
from gateway_harness import GatewayProcess
from qosgate.adapters.chat_template import ChatTemplate
from qosgate.generation_types import ChatMessage, Role
from qosgate.launcher import LocalTriton
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "persist-key"
BUDGET = 150
QUESTION = "What is the capital of France?"
METADATA = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture
def config_file(triton: LocalTriton, tmp_path: Path) -> Path:
    require_model("smollm2")
    path = tmp_path / "gateway.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
                "metrics_listen": "127.0.0.1:0",
                "openai": {"listen": "127.0.0.1:0", "files_db": str(tmp_path / "openai_files.sqlite3")},
                "usage_db": str(tmp_path / "usage.sqlite3"),
                "tenants": [
                    {"name": "budgeted", "api_keys": [{"key": KEY}], "limits": {"daily_token_budget": BUDGET}}
                ],
            }
        )
    )
    return path


@pytest.fixture
def gateways(config_file: Path) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    yield started
    for gateway in started:
        gateway.stop()


def start_gateway(config_file: Path) -> GatewayProcess:
    """A gateway on a fresh port, with the same state files as the ones before it."""
    raw = yaml.safe_load(config_file.read_text())
    raw["listen"] = f"127.0.0.1:{free_port()}"
    config_file.write_text(yaml.safe_dump(raw))
    return GatewayProcess(config_file, config_file.with_suffix(".log")).start()


def _chat(max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model="smollm2",
        chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role=generation_pb2.ROLE_USER, content=QUESTION)]),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _usage(channel: grpc.Channel) -> admin_pb2.GetUsageResponse:
    return admin_pb2_grpc.AdminServiceStub(channel).GetUsage(
        admin_pb2.GetUsageRequest(), metadata=METADATA, timeout=10
    )


def test_budget_usage_survives_restart_and_kill_9(config_file: Path, gateways: list[GatewayProcess]) -> None:
    prompt_estimate = estimate_prompt_tokens(ChatTemplate("chatml").render([ChatMessage(Role.USER, QUESTION)]))
    first = start_gateway(config_file)
    gateways.append(first)
    with grpc.insecure_channel(first.target) as channel:
        reply = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            _chat(max_tokens=24), metadata=METADATA, timeout=120
        )
        spent = reply.usage.prompt_tokens + reply.usage.completion_tokens
        usage = _usage(channel)
    assert usage.today.prompt_tokens + usage.today.completion_tokens == spent
    assert usage.remaining_daily_tokens == BUDGET - spent
    # A request that a fresh budget would admit but what is left cannot: it tells whether
    # the spent tokens were remembered.
    max_tokens = BUDGET - spent - prompt_estimate + 1
    assert max_tokens >= 1 and prompt_estimate + max_tokens <= BUDGET

    for how in (signal.SIGKILL, signal.SIGTERM):
        gateways[-1].kill(how)
        restarted = start_gateway(config_file)
        gateways.append(restarted)
        with grpc.insecure_channel(restarted.target) as channel:
            after = _usage(channel)
            assert after.today == usage.today, f"usage lost across {signal.Signals(how).name}"
            assert after.remaining_daily_tokens == BUDGET - spent
            with pytest.raises(grpc.RpcError) as refused:
                generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                    _chat(max_tokens), metadata=METADATA, timeout=60
                )
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "daily_token_budget" in refused.value.details()
