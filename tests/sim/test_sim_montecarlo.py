"""Monte Carlo simulator tests: convergence to closed forms, accounting, policies, features.

Expected values come from closed forms written out in ``closed_forms.py`` (Daly's segment model)
or in the test itself (binomial probabilities of exponential / Weibull gaps, ring combinatorics),
never from ``phoenixft.sim.model``; confidence intervals are computed here too (delta method),
not with ``phoenixft.sim.stats``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from closed_forms import Z95, ettr, pooled_ratio_ci

from phoenixft.sim.montecarlo import CAUSES, MCResult, _expected_dead_chains, simulate
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


def _closure(r: MCResult) -> float:
    total = r.useful_s + sum(r.lost[c] for c in CAUSES)
    return float(np.max(np.abs(total - r.wall_s)))


@pytest.mark.parametrize("k", [100, 5])
def test_checkpoint_restart_converges_to_exact_ettr(k: int) -> None:
    # expected: Daly's segment model (closed_forms.ettr) with the inputs of EXACT written here:
    # K steps of 20 s, a 5 s checkpoint write, a 600 s restart, system MTTF (64 x 1080 s) / 64 nodes
    exact = ettr(k * 20.0, 5.0, 600.0, 1080.0)
    r = simulate(EXACT, "checkpoint-restart", ckpt_every=k, trajectories=1000, seed=11)
    mean, half = pooled_ratio_ci(r.useful_s, r.wall_s)
    assert abs(mean - exact) <= half, (mean, half, exact)
    assert half < 0.005 * exact  # the interval is narrow enough to mean something
    assert r.unfinished == 0


def test_hotswap_converges_to_exact_ettr() -> None:
    # per-step protection is the segment model with one 20 s step per segment, no commit cost and
    # a 30 s hot-swap as the recovery: 20 / (1080 e^{30/1080} (e^{20/1080} - 1)) = 0.96363
    exact = 20.0 / (1080.0 * math.exp(30.0 / 1080.0) * math.expm1(20.0 / 1080.0))
    assert exact == pytest.approx(0.96363, abs=1e-5)
    r = simulate(EXACT, "phoenix", trajectories=1000, seed=11)
    mean, half = pooled_ratio_ci(r.useful_s, r.wall_s)
    assert abs(mean - exact) <= half, (mean, half, exact)
    assert half < 0.001
    # ... and the review's Eq. (4) with phi = 0.5, 1080 / (1080 + 30 + 10), is within 1e-3 of it
    assert abs(1080.0 / 1120.0 - exact) < 1e-3


def test_mc_z_scores_over_seeds() -> None:
    exact = ettr(100 * 20.0, 5.0, 600.0, 1080.0)  # Daly's segment model, as above
    for seed in (1, 2, 3):
        r = simulate(EXACT, "cr", ckpt_every=100, trajectories=300, seed=seed)
        mean, half = pooled_ratio_ci(r.useful_s, r.wall_s)
        assert abs((mean - exact) / (half / Z95)) < 3.5


def test_failure_gaps_match_exponential_and_weibull_closed_forms() -> None:
    """Each failure starts a 30 s hot-swap; the next failure interrupts it exactly when the gap to
    it is under 30 s. Gaps are independent draws, so the fraction of interrupted recoveries is a
    binomial proportion whose expectation is the gap distribution's CDF at 30 s:
    exponential, mean 1080 s:            1 - exp(-30/1080)                       = 0.02740
    Weibull shape 0.5 with mean 1080 s:  scale 1080 / Gamma(1 + 1/0.5) = 540 s,
                                         1 - exp(-(30/540) ** 0.5)                = 0.20998
    """
    cases = {
        "exponential": (EXACT, 1.0 - math.exp(-30.0 / 1080.0)),
        "weibull": (
            EXACT.with_(arrival="weibull", weibull_shape=0.5),
            1.0 - math.exp(-((30.0 / (1080.0 / math.gamma(3.0))) ** 0.5)),
        ),
    }
    assert cases["exponential"][1] == pytest.approx(0.02740, abs=1e-5)
    assert cases["weibull"][1] == pytest.approx(0.20998, abs=1e-5)
    for name, (sc, p) in cases.items():
        r = simulate(sc, "phoenix", trajectories=300, seed=9)
        n = int(r.failures.sum())
        frac = r.interrupted.sum() / n
        half = Z95 * math.sqrt(p * (1 - p) / n)  # binomial 95% interval
        assert abs(frac - p) <= half, (name, frac, p, half, n)
        assert half < 0.05 * p
    # the exponential process is a Poisson process of rate 1/1080 s: by Wald's identity and the
    # memoryless residual, E[failures] = E[wall] / 1080 exactly, so sum(failures) / sum(wall) -> 1/1080
    r = simulate(EXACT, "phoenix", trajectories=300, seed=9)
    rate, half = pooled_ratio_ci(r.failures, r.wall_s)
    assert abs(rate - 1 / 1080.0) <= half, (rate, half)
    assert half < 0.02 / 1080.0


def test_ring_shard_loss_matches_enumeration() -> None:
    """Unaware placement puts a shard's k+1 holders on consecutive ring nodes; with m failed nodes
    (uniform over the subsets of that size) the expected number of shards with every holder failed
    is counted here by enumerating every subset of a 7-node ring."""
    n = 7
    for replicas in (1, 2, 3):
        r = replicas + 1
        sc = Scenario(gpus=n, gpus_per_node=1, replicas=replicas, placement="unaware")
        for m in range(n + 1):
            dead = [
                sum(all((i + j) % n in failed for j in range(r)) for i in range(n))
                for failed in map(set, itertools.combinations(range(n), m))
            ]
            expected = sum(dead) / len(dead)
            got = float(_expected_dead_chains(np.array([m]), np.array([0]), sc)[0])
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), (replicas, m)


def test_aware_placement_shard_loss_matches_enumeration() -> None:
    """Aware placement puts a shard's k+1 holders in k+1 distinct domains (each holder any node of
    its domain); d whole domains fail together and m further nodes fail among the nodes of the
    other domains. The expected number of shards with every holder failed is counted here by
    enumerating every placement, every set of d domains and every set of m nodes, on 8 nodes in 4
    domains of 2. (With m = 0 it is the hypergeometric 8 C(d, k+1) / C(4, k+1), checked too.)"""
    n, g = 8, 2
    domains = [list(range(i * g, (i + 1) * g)) for i in range(n // g)]
    for replicas in (1, 2):
        r = replicas + 1
        sc = Scenario(gpus=n, gpus_per_node=1, domain_size=g, replicas=replicas, placement="aware")
        assert sc.domains == len(domains) == 4
        placements = [
            holders
            for doms in itertools.combinations(range(len(domains)), r)
            for holders in itertools.product(*(domains[i] for i in doms))
        ]
        for d in range(len(domains) + 1):
            for m in range(n - d * g + 1):
                lost, cases = 0, 0
                for down in itertools.combinations(range(len(domains)), d):
                    dead_nodes = {x for i in down for x in domains[i]}
                    rest = [x for x in range(n) if x not in dead_nodes]
                    for failed in itertools.combinations(rest, m):
                        dead = dead_nodes | set(failed)
                        lost += sum(all(h in dead for h in hs) for hs in placements)
                        cases += len(placements)
                expected = n * lost / cases
                if m == 0:
                    assert expected == pytest.approx(n * math.comb(d, r) / math.comb(4, r), rel=1e-12)
                got = float(_expected_dead_chains(np.array([m]), np.array([d]), sc)[0])
                assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), (replicas, d, m)


def test_shard_loss_rate_on_a_three_node_ring() -> None:
    """Three nodes, one replica each (ring: shards on {0,1}, {1,2}, {2,0}): any two nodes down at
    once hold both copies of some shard. A failure opens a 100 s recovery; the next gap is under
    100 s with probability q = 1 - exp(-100/300) (system MTTF 300 s); that second failure loses a
    shard for certain and turns the recovery into a 100 s restart from the persistent checkpoint,
    during which further failures cannot lose more. Per chain of failures there is one loss with
    probability q, and 1 / (1 - q) failures on average, so losses per failure = q (1 - q)."""
    q = 1.0 - math.exp(-100.0 / 300.0)
    expected = q * (1.0 - q)
    assert expected == pytest.approx(0.20311, abs=1e-5)
    sc = Scenario(
        gpus=3,
        gpus_per_node=1,
        steps=2000,
        step_s=10.0,
        gpu_mttf_s=900.0,
        spares=1,
        provision_s=0.0,
        hotswap_s=100.0,
        restart_s=100.0,
        replicas=1,
        placement="unaware",
        persist_every=1,
        persist_s=0.0,
    )
    r = simulate(sc, "phoenix", trajectories=300, seed=6)
    assert r.unfinished == 0
    rate, half = pooled_ratio_ci(r.shard_losses, r.failures)
    assert abs(rate - expected) <= half, (rate, half, expected)
    assert half < 0.05 * expected


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


def test_a_mesh_shrink_drops_whole_replicas_and_runs_slower_while_shrunk() -> None:
    """A TP x PP mesh drops the lost node's whole data-parallel replica (replica_nodes = PP nodes): the same
    failures cost more degraded time than a data-parallel shrink of one node, the wall time still decomposes
    exactly, and a mesh of one replica never drops it (it waits for the repair)."""
    sc = Scenario(gpus=16, gpus_per_node=1, steps=3000, step_s=10.0, gpu_mttf_s=16 * 20_000.0, provision_s=5000.0,
                  shrink_s=5.0, inplace_s=5.0, persist_every=0, replicas=3, spares=0)
    dp = simulate(sc, "phoenix", trajectories=200, seed=4)
    mesh = simulate(sc.with_(replica_nodes=4), "phoenix", trajectories=200, seed=4)
    for r in (dp, mesh):
        assert r.unfinished == 0 and _closure(r) < 1e-6 * float(r.wall_s.max())
    assert mesh.lost["degraded"].mean() > 2.0 * dp.lost["degraded"].mean() > 0
    one = simulate(sc.with_(replica_nodes=16), "phoenix", trajectories=50, seed=4)
    assert one.lost["degraded"].sum() == 0.0 and one.lost["spare_wait"].sum() > 0.0
    with pytest.raises(ValueError, match="replica_nodes"):
        sc.with_(replica_nodes=3)


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
