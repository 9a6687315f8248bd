"""The isolation bench's pure parts: the gateway's settings taken from config/demo.yaml,
the batch goodput figure and the frontier of latency objectives."""

from __future__ import annotations

import pathlib

import pytest

from bench.load import Outcome
from bench.scenarios.isolation import TOP, Phase, figures, frontier, objective_target
from bench.stack import DEMO_CONFIG, demo_model_policies
from qosgate.config import load_config


def test_the_gateway_gets_what_the_demo_config_ships_for_each_model(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "demo.yaml"
    config.write_text("models:\n  minilm: {max_queued: 7, exclusive_classes: [critical]}\n"
                      "  smollm2: {adapter: vllm}\n  other: {max_queued: 1}\n")
    assert demo_model_policies(["minilm", "smollm2"], config) == {
        "minilm": {"max_queued": 7, "exclusive_classes": ["critical"]}, "smollm2": {"adapter": "vllm"}}


def test_the_shipped_demo_config_has_both_models() -> None:
    shipped = load_config(DEMO_CONFIG).models
    policies = demo_model_policies(["minilm", "smollm2"])
    assert set(policies) == {"minilm", "smollm2"}
    assert policies["minilm"]["max_queued"] == shipped["minilm"].max_queued


def _phase(target: str, load: int, critical_s: list[float], batch_ok: int, model: str = "minilm") -> Phase:
    """A 10 s phase: critical calls of the given latencies, `batch_ok` batch calls done."""
    critical = [Outcome("critical", 1.0, 1.0 + s, "OK") for s in critical_s]
    batch = [Outcome("batch", 1.0, 2.0, "OK") for _ in range(batch_ok)]
    return Phase(model, target, load, (0.0, 10.0), critical, batch)


def _phases() -> list[Phase]:
    return [
        _phase("direct", 0, [0.02], 0), _phase("direct", TOP, [0.4], 1000),
        _phase("qosgate", 0, [0.03], 0), _phase("qosgate", TOP, [0.06], 850),
        _phase(objective_target(None), TOP, [0.09], 900), _phase(objective_target(2.0), TOP, [0.045], 500),
    ]


def test_the_frontier_puts_each_objective_against_triton_direct() -> None:
    points = frontier(_phases(), "minilm")
    assert [p.label for p in points] == ["Triton direct", "qosgate, no latency objective",
                                         "qosgate, critical objective 2x"]
    direct, none, two = points
    assert (direct.latency_ratio, direct.goodput_pct) == pytest.approx((20.0, 100.0))
    # Against the gateway's own unloaded p99 (30 ms), and Triton direct's goodput (100/s).
    assert (none.latency_ratio, none.goodput_pct) == pytest.approx((3.0, 90.0))
    assert (two.latency_ratio, two.goodput_pct) == pytest.approx((1.5, 50.0))
    assert frontier(_phases(), "smollm2") == []


def test_batch_goodput_is_held_against_triton_direct_at_the_top_flood() -> None:
    found = {f.label: f for f in figures(_phases())}
    goodput = found[f"minilm: batch goodput at {TOP}x flood, qosgate / Triton direct"]
    assert goodput.value == pytest.approx(85.0)
    assert goodput.met is True
    assert goodput.reference == "qosgate 85.0, Triton direct 100.0 ok req/s"
    latency = found[f"minilm: critical p99 latency at {TOP}x flood / unloaded"]
    assert latency.value == pytest.approx(2.0)
    assert latency.met is True
