"""The fairness bench's pure parts: shares against weights, the window sweep's figures,
token service from streams, and the two-gateway figures."""

from __future__ import annotations

import pytest

from bench.load import Outcome
from bench.scenarios.fairness import (
    WEIGHTS,
    Served,
    Sweep,
    TokenRun,
    gateway_figures,
    served_calls,
    service_events,
    y_over_x,
)


def _served(label: str, service: dict[str, float], seconds: float = 10.0,
            weights: dict[str, float] = WEIGHTS) -> Served:
    return Served(label, dict(weights), service, seconds, sum(service.values()))


def test_shares_exactly_at_the_weights_deviate_by_nothing() -> None:
    served = _served("auto", {"light": 100.0, "medium": 200.0, "heavy": 400.0})
    assert served.worst_deviation_pct() == pytest.approx(0.0)
    assert served.jain() == pytest.approx(1.0)
    assert served.imbalance() == pytest.approx(1.0)
    assert served.rate() == pytest.approx(70.0)


def test_the_worst_deviation_is_relative_to_the_tenants_own_share() -> None:
    # Shares 0.25 / 0.25 / 0.5 against 1/7, 2/7, 4/7: light is 75% over its share.
    served = _served("window 128", {"light": 200.0, "medium": 200.0, "heavy": 400.0})
    assert served.shares() == pytest.approx({"light": 0.25, "medium": 0.25, "heavy": 0.5})
    assert served.worst_deviation_pct() == pytest.approx(75.0)
    # Weight-normalised shares 1.75, 0.875, 0.875.
    assert served.jain() == pytest.approx(3.5 ** 2 / (3 * (1.75 ** 2 + 2 * 0.875 ** 2)))
    assert served.imbalance() == pytest.approx(2.0)


def test_only_the_tenants_weighed_count() -> None:
    stopped = _served("heavy stopped", {"light": 100.0, "medium": 200.0, "heavy": 999.0},
                      weights={"light": 1.0, "medium": 2.0})
    assert stopped.shares() == pytest.approx({"light": 1 / 3, "medium": 2 / 3})
    assert stopped.worst_deviation_pct() == pytest.approx(0.0)


def test_served_calls_counts_what_ended_inside_the_window() -> None:
    outcomes = {
        "x": [Outcome("x", 0.0, 0.5, "OK"), Outcome("x", 0.5, 1.5, "OK"), Outcome("x", 1.0, 2.5, "OK"),
              Outcome("x", 1.2, 1.8, "UNAVAILABLE")],
        "y": [Outcome("y", 0.9, 1.1, "OK"), Outcome("y", 1.9, 3.0, "OK")],
    }
    served = served_calls("run", {"x": 1.0, "y": 1.0}, outcomes, 1.0, 3.0)
    assert served.service == {"x": 2.0, "y": 1.0}  # y's second call ended at the window's end
    assert (served.failed, served.work, served.seconds) == (1, 3.0, 2.0)


def test_the_sweep_holds_auto_against_the_fastest_fixed_window() -> None:
    exact = {"light": 100.0, "medium": 200.0, "heavy": 400.0}
    sweep = Sweep(
        "minilm",
        auto=[_served("auto, first run", exact, seconds=10.0),
              _served("auto, last run", {"light": 105.0, "medium": 200.0, "heavy": 395.0}, seconds=7.0)],
        fixed={8: _served("window 8", exact, seconds=20.0),  # 35 calls/s
               32: _served("window 32", {"light": 300.0, "medium": 300.0, "heavy": 400.0}, seconds=10.0),
               128: _served("window 128", exact, seconds=8.0)},  # 87.5 calls/s
    )
    assert [s.label for s in sweep.runs()] == ["auto, first run", "window 8", "window 32", "window 128",
                                               "auto, last run"]
    assert sweep.best_fixed()[0] == 32
    deviation, jain, throughput = sweep.figures()
    # light's 105 of 700 against 1/7: 5% over; the mean with the first run's 0%.
    assert deviation.value == pytest.approx(2.5)
    assert deviation.met is True
    assert jain.value == pytest.approx((1.0 + sweep.auto[1].jain()) / 2)
    # Auto's mean rate (70 and 100 calls/s) over window 32's 100 calls/s.
    assert throughput.value == pytest.approx(85.0)
    assert throughput.met is False
    assert "best fixed window 32: 100.0 calls/s" in throughput.reference


def test_token_service_counts_chunks_as_they_came_and_the_prompt_at_the_end() -> None:
    # 3 chunks seen, usage says 10 prompt + 5 completion: 2 tokens the chunks missed.
    outcome = Outcome("long", 0.0, 4.0, "OK", token_times=[1.0, 2.0, 3.0], tokens=15, prompt_tokens=10)
    assert service_events(outcome) == [(1.0, 2.0), (2.0, 2.0), (3.0, 2.0), (4.0, 10.0 + 2.0 * 2)]
    cut = Outcome("long", 0.0, 4.0, "DEADLINE_EXCEEDED", token_times=[1.0])
    assert service_events(cut) == [(1.0, 2.0)]


def test_a_token_run_serves_what_fell_inside_its_window() -> None:
    run = TokenRun("fair_share cost", (10.0, 20.0),
                   {"long": [(9.0, 50.0), (11.0, 2.0), (12.0, 2.0), (19.0, 30.0)],
                    "short": [(10.0, 2.0), (15.0, 20.0), (20.0, 2.0)]},
                   token_times=[9.0, 10.0, 11.0, 12.0, 20.0])
    served = run.served({"long": 1.0, "short": 1.0})
    assert served.service == {"long": 34.0, "short": 22.0}
    assert (served.work, served.unit, served.rate()) == (3, "tokens", 0.3)
    # Running difference long - short: -2, 0, 2, -18, 12: its range is 30.
    assert run.max_gap("long", "short") == pytest.approx(30.0)
    assert run.cumulative("short") == ([0.0, 0.0, 5.0], [0.0, 2.0, 22.0])


def test_the_two_gateway_ratio_bounds_both_ways() -> None:
    shared = _served("shared", {"x": 200.0, "y": 100.0}, weights={"x": 1.0, "y": 1.0})
    unshared = _served("not shared", {"x": 100.0, "y": 300.0}, weights={"x": 1.0, "y": 1.0})
    weighted = _served("1:4", {"x": 30.0, "y": 70.0}, weights={"x": 1.0, "y": 4.0})
    ratio, deviation = gateway_figures(shared, unshared, weighted)
    assert ratio.value == pytest.approx(2.0)  # y got half of x's: as far off as twice
    assert ratio.met is False
    assert ratio.reference == ("y/x 0.50 (x 200, y 100 calls, 0 failed), 30.0 calls/s; gateways not sharing "
                               "Redis: y/x 3.00 (x 100, y 300 calls, 0 failed), 40.0 calls/s")
    assert deviation.value == pytest.approx(50.0)  # x's 0.3 against 0.2
    assert y_over_x(weighted) == pytest.approx(70.0 / 4 / 30.0)  # per unit of weight
