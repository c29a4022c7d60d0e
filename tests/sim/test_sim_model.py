"""Analytic model tests against the seed review's own numbers (worked example, Eq. 6, paper)."""

from __future__ import annotations

import math

import pytest

from phoenixft.sim import model
from phoenixft.sim.experiments import paper_accountings, shard_loss_table, worked_example


def test_worked_example_eta_matches_review() -> None:
    res = worked_example(trajectories=0)
    a = res["analytic"]
    assert a["expected_replay_steps"] == 49.5
    assert a["checkpoint_restart"]["replay_s"] == pytest.approx(990.0)
    assert a["checkpoint_restart"]["disruption_s"] == pytest.approx(1595.0)
    assert a["hotswap"]["disruption_s"] == pytest.approx(40.0)
    assert round(a["checkpoint_restart"]["eta"], 3) == 0.404
    assert round(a["hotswap"]["eta"], 3) == 0.964
    assert a["disruption_ratio"] == pytest.approx(1595 / 40)


def test_equations_directly() -> None:
    assert model.expected_replay_steps(100) == 49.5
    assert model.expected_replay_steps(100, half_interval=True) == 50.0
    assert model.failure_rate(1080.0) == pytest.approx(1 / 1080)
    assert model.efficiency(1080.0, 1595.0) == pytest.approx(1080 / 2675)
    assert model.system_mttf(1.08e8, 100_000) == pytest.approx(1080.0)
    with pytest.raises(ValueError):
        model.expected_replay_steps(0)
    with pytest.raises(ValueError):
        model.phoenix_disruption(0, 30, 20, 1.5)


def test_shard_loss_matches_review() -> None:
    per_step, cum = model.shard_loss_independent(128, 1e-6, 1, 100_000)
    assert per_step == pytest.approx(1.28e-10, rel=1e-12)
    assert cum == pytest.approx(1.28e-5, rel=1e-12)
    _, cum2 = model.shard_loss_independent(128, 1e-6, 2, 100_000)
    assert cum2 == pytest.approx(1.28e-11, rel=1e-12)
    _, c1 = model.shard_loss_correlated(128, 1e-4, 1, 100_000)
    _, c2 = model.shard_loss_correlated(128, 1e-4, 2, 100_000)
    assert c1 == pytest.approx(0.128, rel=1e-12)
    assert c2 == pytest.approx(1.28e-5, rel=1e-12)


def test_shard_loss_table_rows() -> None:
    rows = {(r["case"], r["k"]): r for r in shard_loss_table()["rows"]}
    assert rows[("independent", 1)]["per_step"] == pytest.approx(1.28e-10)
    assert rows[("correlated", 1)]["cumulative_union_bound"] == pytest.approx(0.128)
    # the exact 1-(1-P)^n is below the union bound, visibly so only when the bound is large
    assert rows[("correlated", 1)]["cumulative_exact"] == pytest.approx(1 - math.exp(-0.128), rel=1e-3)
    assert rows[("correlated", 2)]["cumulative_exact"] == pytest.approx(1.28e-5, rel=1e-4)


def test_paper_arithmetic_and_which_accounting_reproduces_18_8x() -> None:
    rows = {r["accounting"]: r for r in paper_accountings()}
    seed = rows["restart + replay per failure (the review's description)"]
    # (150 + 18*2.08) + (150 + 2366*2.08) = 5258.72 s against 32.6 + 29.8 = 62.4 s
    assert seed["checkpoint_restart_s"] == pytest.approx(5258.72)
    assert seed["hotswap_s"] == pytest.approx(62.4)
    assert seed["ratio"] == pytest.approx(84.27, abs=0.01)
    assert rows["restart only, no replay"]["ratio"] == pytest.approx(300 / 62.4)
    # None of the natural accountings gives 18.8x; 18.8x needs 1173 s of checkpoint-restart time.
    natural = [r for k, r in rows.items() if k != "what 18.8x would need"]
    assert not any(r["reproduces_paper"] for r in natural)
    need = rows["what 18.8x would need"]
    assert need["checkpoint_restart_s"] == pytest.approx(1173.12)
    assert need["hotswap_fraction"] == pytest.approx(0.0532, abs=1e-4)


def test_exact_segment_formula_limits() -> None:
    # failures vanishingly rare: ETTR -> work / (work + commit)
    assert model.segment_ettr_exact(100.0, 5.0, 600.0, 1e12) == pytest.approx(100 / 105, rel=1e-6)
    # to first order in 1/M it is the uniform-replay picture: W/(W+C) * (1 - (R + (W+C)/2)/M)
    w, c, r, m = 200.0, 5.0, 60.0, 1e6
    approx = w / (w + c) * (1 - (r + (w + c) / 2) / m)
    assert model.segment_ettr_exact(w, c, r, m) == pytest.approx(approx, abs=1e-6)


def test_young_daly_close_to_exact_optimum() -> None:
    choice = model.optimal_interval(t_step_s=20.0, ckpt_s=8.9, restart_s=600.0, mttf_s=1080.0 * 100)
    assert abs(choice.daly_steps - choice.best_steps) <= 2
    assert choice.best_ettr >= choice.daly_ettr >= choice.young_ettr - 1e-3
    assert choice.best_ettr - choice.daly_ettr < 1e-3
    assert model.young_interval_s(8.9, 1080.0) == pytest.approx(math.sqrt(2 * 8.9 * 1080))
    assert model.daly_interval_s(5000.0, 1000.0) == 1000.0
