"""Monte Carlo simulator tests: convergence to the exact model, accounting, policies, features."""

from __future__ import annotations

import numpy as np
import pytest

from phoenixft.sim import model
from phoenixft.sim.montecarlo import CAUSES, simulate
from phoenixft.sim.scenario import Scenario

# A cluster where the analytic segment model is exact: exponential failures, all permanent,
# a spare always ready, no correlated failures, and shard loss impossible (k = 3 replicas,
# never four nodes down in one recovery window in practice).
EXACT = Scenario(
    gpus=64,
    gpus_per_node=1,
    steps=20_000,
    step_s=20.0,
    gpu_mttf_s=64 * 1080.0,
    spares=1,
    provision_s=0.0,
    restart_s=600.0,
    ckpt_s=5.0,
    hotswap_s=30.0,
    replicas=3,
    persist_every=0,
)


def _closure(r) -> float:
    total = r.useful_s + sum(r.lost[c] for c in CAUSES)
    return float(np.max(np.abs(total - r.wall_s)))


@pytest.mark.parametrize("k", [100, 5])
def test_checkpoint_restart_converges_to_exact_ettr(k: int) -> None:
    r = simulate(EXACT, "checkpoint-restart", ckpt_every=k, trajectories=1000, seed=11)
    exact = model.segment_ettr_exact(k * 20.0, 5.0, 600.0, 1080.0)
    est = r.ettr_pooled()
    assert est.contains(exact), (est, exact)
    assert est.hi - est.lo < 0.01 * exact
    assert r.unfinished == 0


def test_hotswap_converges_to_exact_ettr() -> None:
    r = simulate(EXACT, "phoenix", trajectories=1000, seed=11)
    exact = model.segment_ettr_exact(20.0, 0.0, 30.0, 1080.0)
    assert r.ettr_pooled().contains(exact), (r.ettr_pooled(), exact)
    assert r.ettr_ci().contains(exact)
    # ... and Eq. (4) with phi = 0.5 is within 1e-3 of it here
    assert abs(model.efficiency(1080.0, 30.0 + 10.0) - exact) < 1e-3


def test_mc_z_scores_over_seeds() -> None:
    exact = model.segment_ettr_exact(100 * 20.0, 5.0, 600.0, 1080.0)
    for seed in (1, 2, 3):
        est = simulate(EXACT, "cr", ckpt_every=100, trajectories=300, seed=seed).ettr_pooled()
        z = (est.mean - exact) / ((est.hi - est.lo) / (2 * 1.96))
        assert abs(z) < 3.5


def test_wall_time_decomposes_exactly_into_useful_plus_causes() -> None:
    sc = Scenario(
        gpus=256,
        gpus_per_node=8,
        steps=5000,
        step_s=10.0,
        gpu_mttf_s=32 * 3 * 3600.0 * 8,
        transient_frac=0.4,
        domain_size=4,
        domain_mttf_s=2 * 86400.0,
        spares=1,
        provision_s=1800.0,
        restart_s=300.0,
        ckpt_s=4.0,
        hotswap_s=20.0,
        inplace_s=10.0,
        shrink_s=15.0,
        overhead_ratio=1.02,
        persist_every=300,
        persist_s=4.0,
        placement="unaware",
    )
    for pol in ("checkpoint-restart", "phoenix", "inplace", "shrink"):
        r = simulate(sc, pol, ckpt_every=50, trajectories=200, seed=3)
        assert r.unfinished == 0
        assert _closure(r) < 1e-6 * float(r.wall_s.max())
        assert np.allclose(r.useful_s, sc.steps * sc.step_s)
        assert (r.ettr > 0).all() and (r.ettr <= 1).all()
        s = r.summary()
        assert set(s["lost_per_failure_s"]) >= {"restart", "replay", "hotswap", "interrupted"}
        assert s["ettr"]["ci95_lo"] <= s["ettr"]["mean"] <= s["ettr"]["ci95_hi"]


def test_no_failures_means_only_overheads() -> None:
    sc = EXACT.with_(gpu_mttf_s=1e30, overhead_ratio=1.05, persist_every=1000, persist_s=7.0)
    cr = simulate(sc, "cr", ckpt_every=100, trajectories=5, seed=0)
    assert (cr.failures == 0).all()
    assert cr.wall_s == pytest.approx(np.full(5, 20_000 * 20.0 + 200 * 5.0))
    hs = simulate(sc, "phoenix", trajectories=5, seed=0)
    assert hs.wall_s == pytest.approx(np.full(5, 20_000 * 20.0 * 1.05 + 20 * 7.0))


def test_common_random_numbers_across_policies() -> None:
    sc = EXACT.with_(steps=2000)
    a = simulate(sc, "cr", ckpt_every=10, trajectories=50, seed=5, record_episodes=True)
    b = simulate(sc, "phoenix", trajectories=50, seed=5, record_episodes=True)
    # same failure process: checkpoint-restart runs longer, so it sees at least as many failures
    assert (a.failures >= b.failures).mean() > 0.9
    assert a.episode_samples is not None and b.episode_samples is not None


def test_transient_failures_use_inplace_and_no_spare() -> None:
    sc = EXACT.with_(transient_frac=1.0, spares=0, provision_s=1e6, inplace_s=5.0)
    r = simulate(sc, "phoenix", trajectories=100, seed=1)
    assert r.per_failure("spare_wait").mean == 0.0
    assert r.lost["hotswap"].sum() == 0.0
    assert r.per_failure("inplace").mean == pytest.approx(5.0, rel=0.05)


def test_empty_pool_waits_for_provisioning() -> None:
    sc = EXACT.with_(spares=0, provision_s=100.0, steps=2000)
    r = simulate(sc, "phoenix", trajectories=200, seed=2, record_episodes=True)
    # with phoenix falling back to shrink, nothing waits; with no_spare=wait each failure waits
    assert r.lost["spare_wait"].sum() == 0.0
    assert r.lost["shrink"].sum() > 0.0
    w = simulate(sc.with_(no_spare="wait"), "phoenix", trajectories=200, seed=2)
    # every recovery episode waits the provisioning delay once (failures that strike during a
    # recovery join the episode, so per failure it is a little less)
    assert w.lost["spare_wait"].sum() / w.episodes.sum() == pytest.approx(100.0, rel=1e-6)
    assert w.per_failure("spare_wait").mean < 100.0
    c = simulate(sc, "cr", ckpt_every=10, trajectories=200, seed=2)
    assert c.per_failure("spare_wait").mean > 50.0


def test_shrink_slows_steps_and_nodes_rejoin() -> None:
    sc = Scenario(
        gpus=8,
        gpus_per_node=1,
        steps=3000,
        step_s=10.0,
        gpu_mttf_s=8 * 20_000.0,
        provision_s=5000.0,
        shrink_s=5.0,
        inplace_s=5.0,
        persist_every=0,
        replicas=7,
    )
    r = simulate(sc, "shrink", trajectories=200, seed=4)
    assert r.lost["degraded"].mean() > 0
    assert r.unfinished == 0
    assert _closure(r) < 1e-6 * float(r.wall_s.max())


def test_unaware_placement_loses_shards_on_domain_events() -> None:
    base = Scenario(
        gpus=128,
        gpus_per_node=8,
        steps=5000,
        step_s=20.0,
        gpu_mttf_s=1e30,
        domain_size=4,
        domain_mttf_s=4 * 86400.0,
        restart_s=600.0,
        hotswap_s=30.0,
        persist_every=500,
    )
    unaware = simulate(base.with_(placement="unaware"), "phoenix", trajectories=200, seed=0)
    aware = simulate(base.with_(placement="aware"), "phoenix", trajectories=200, seed=0)
    assert unaware.domain_events.sum() > 0
    assert unaware.shard_losses.sum() >= 0.9 * unaware.domain_events.sum()
    assert aware.shard_losses.sum() <= 0.05 * aware.domain_events.sum()
    assert unaware.lost["fallback"].sum() > aware.lost["fallback"].sum()


def test_weibull_arrivals_keep_the_mean_and_are_burstier() -> None:
    sc = EXACT.with_(gpu_mttf_s=1e30, domain_mttf_s=1e30)
    sc_exp = EXACT.with_(steps=20_000)
    sc_w = sc_exp.with_(arrival="weibull", weibull_shape=0.5)
    e = simulate(sc_exp, "phoenix", trajectories=300, seed=9)
    w = simulate(sc_w, "phoenix", trajectories=300, seed=9)
    # same mean inter-arrival: failures per unit of wall time agree within 5%
    rate_e = e.failures.sum() / e.wall_s.sum()
    rate_w = w.failures.sum() / w.wall_s.sum()
    assert rate_w == pytest.approx(rate_e, rel=0.05)
    # bursts: more failures land inside a recovery
    assert w.interrupted.sum() > e.interrupted.sum()
    assert sc.system_mttf_s > 1e20


def test_horizon_stops_hopeless_runs() -> None:
    sc = EXACT.with_(gpu_mttf_s=64 * 100.0, steps=500)
    r = simulate(sc, "cr", ckpt_every=100, trajectories=10, seed=0, horizon_factor=3.0)
    assert r.unfinished == 10
    assert (r.ettr < 0.4).all()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        simulate(EXACT, "cr", trajectories=10)
    with pytest.raises(ValueError):
        simulate(EXACT, "nope", trajectories=10)
    with pytest.raises(ValueError):
        Scenario(gpus=8, transient_frac=1.5)


def test_stalled_runs_stop_at_the_horizon_quickly() -> None:
    # demand for spares far above supply, bursty arrivals, unaware placement: every run stalls
    sc = Scenario(
        gpus=4096,
        steps=2000,
        gpu_mttf_s=4096 * 600.0,
        spares=1,
        provision_s=36_000.0,
        no_spare="wait",
        placement="unaware",
        domain_mttf_s=1e6,
        arrival="weibull",
        weibull_shape=0.6,
    )
    assert sc.spares_needed > 10
    r = simulate(sc, "phoenix", trajectories=20, seed=0, horizon_factor=5.0)
    assert r.unfinished == 20
    assert r.runtime_s < 20.0
