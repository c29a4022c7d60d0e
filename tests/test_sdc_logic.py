"""The pure logic of silent-data-corruption detection (phoenixft.sdc.logic), over many generated cases:
fingerprints see every single flipped bit and add up over aligned cuts; the divergence check names
exactly the members whose copy differs; the verdict of a replay names the one bad node (or says it
cannot); the spike score ignores scale and flags what lies far above its window."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from phoenixft.sdc.logic import Computation, SpikeGuard, add_fp, diverged, fingerprint, judge


def _flip(t: torch.Tensor, i: int, bit: int) -> torch.Tensor:
    out = t.clone()
    w = out.view({4: torch.int32, 2: torch.int16}[out.element_size()])
    bits = out.element_size() * 8
    mask = 1 << bit
    if mask >= 1 << (bits - 1):
        mask -= 1 << bits
    w[i] = int(w[i]) ^ mask
    return out


def test_every_single_bit_flip_changes_the_fingerprint() -> None:
    rng = random.Random(7)
    for case in range(600):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        n = rng.choice([1, 3, 64, 127, 1000, 4096])
        g = torch.Generator().manual_seed(case)
        t = (torch.randn(n, generator=g) * 10 ** rng.uniform(-6, 3)).to(dtype)
        if rng.random() < 0.2:
            t[: n // 2] = 0
        off = rng.randrange(0, 5)  # a view that does not start on an 8-byte boundary
        base = torch.cat([torch.zeros(off, dtype=dtype), t])[off:]
        i, bit = rng.randrange(n), rng.randrange(t.element_size() * 8)
        assert fingerprint(_flip(base, i, bit)) != fingerprint(base), (case, dtype, n, off, i, bit)
        assert fingerprint(base) == fingerprint(base.clone() if off == 0 else base)  # deterministic


def test_fingerprints_add_up_over_aligned_cuts() -> None:
    rng = random.Random(3)
    for case in range(300):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        per_word = 8 // torch.tensor([], dtype=dtype).element_size()
        n = per_word * rng.randint(1, 500) + rng.randrange(per_word)
        t = torch.randn(n, generator=torch.Generator().manual_seed(case)).to(dtype)
        cuts = sorted({0, n, *(per_word * rng.randrange(n // per_word + 1) for _ in range(rng.randint(0, 6)))})
        whole = (0, 0)
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            whole = add_fp(whole, fingerprint(t[lo:hi]))
        assert whole == fingerprint(t), (case, cuts)


def test_diverged_names_exactly_the_members_that_differ() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        m, d = rng.randint(1, 9), rng.randint(1, 6)
        good = [(rng.randrange(1 << 40), rng.randrange(1 << 40)) for _ in range(d)]
        bad = set(rng.sample(range(m), rng.randint(0, m)))
        copies = [[(g[0] + (1 << rng.randrange(40)) * (i in bad and j == (i % d)), g[1]) for j, g in enumerate(good)]
                  for i in range(m)]
        assert diverged(copies, good) == sorted(bad)  # against the owners' reference: always exact
        plain = diverged(copies)
        if 2 * len(bad) < m:  # fewer than half are bad: the majority alone names them all
            assert plain == sorted(bad)
        elif m == 2 and len(bad) == 1:  # two members, one differs: no majority, a reference is needed
            assert plain is None


def _scenario(rng: random.Random, nodes: int, culprit: int | None, persistent: bool, audit: bool) -> list[Computation]:
    """Slot i computed first by node i; replayed (or audited) by node i-1; rerun by node i. The culprit's
    first computation is wrong, and with `persistent` every one of its computations (each wrong alike
    when it recomputes the same slot)."""
    right = {i: (rng.randrange(1 << 60), i) for i in range(nodes)}

    def by(node: int, slot: int, first: bool) -> tuple[int, ...]:
        if node == culprit and (first or persistent):
            return (right[slot][0] ^ (1 << 17), right[slot][1])
        return right[slot]

    comps = []
    for i in range(nodes):
        comps.append(Computation(slot=(0, 0, i), fp=by(i, i, True), node=f"n{i}", kind="original"))
        j = (i + 1) % nodes  # node i replays slot i+1
        comps.append(Computation(slot=(0, 0, j), fp=by(i, j, False), node=f"n{i}", kind="audit" if audit else "replay"))
        comps.append(Computation(slot=(0, 0, i), fp=by(i, i, False), node=f"n{i}", kind="rerun"))
    rng.shuffle(comps)
    return comps


def test_the_replay_names_the_one_node_that_computed_wrong() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        nodes = rng.randint(2, 8)
        culprit = rng.choice([None, rng.randrange(nodes)])
        persistent = rng.random() < 0.5
        v = judge(_scenario(rng, nodes, culprit, persistent, rng.random() < 0.5))
        if culprit is None:
            assert v.equal and v.label == "genuine"
            continue
        assert not v.equal
        if persistent and nodes == 2:  # two nodes, each consistent with itself: nobody can tell which is right
            assert v.culprit is None and v.label == "undetermined" and sorted(v.candidates) == ["n0", "n1"]
            continue
        assert v.culprit == f"n{culprit}", (nodes, culprit, persistent, v)
        assert v.label == ("persistent" if persistent else "transient")


def test_the_spike_score_ignores_the_unit_and_flags_far_outliers() -> None:
    rng = random.Random(9)
    for _ in range(500):
        base = [rng.gauss(0, 1) for _ in range(rng.randint(8, 40))]
        a, b = 10 ** rng.uniform(-4, 4), 0.0  # (a shift moves the relative floor: 0.1% of the median)
        g1, g2 = SpikeGuard(threshold=8, window=64), SpikeGuard(threshold=8, window=64)
        g1.observe({"x": None})
        for x in base:
            g1.observe({"x": x})
            g2.observe({"x": a * x + b})
        probe = rng.gauss(0, 3)
        assert math.isclose(g1.score("x", probe), g2.score("x", a * probe + b), rel_tol=1e-6, abs_tol=1e-6)
        assert g1.suspect({"x": max(base) + 1000 * (max(base) - min(base))}) is not None
        assert g1.suspect({"x": float("nan")}) == "x is nan" and g1.suspect({"x": math.inf}) == "x is inf"
        assert g1.suspect({"x": sorted(base)[len(base) // 2]}) is None  # the median itself


def test_the_guard_waits_for_history_and_forgets_at_reset() -> None:
    g = SpikeGuard(threshold=5, window=4, min_history=3)
    for x in (1.0, 1.1):
        g.observe({"loss": x})
    assert g.suspect({"loss": 1e9}) is None  # too little history to judge a value
    g.observe({"loss": 0.9})
    assert g.suspect({"loss": 1e9}) is not None
    for x in (5.0, 5.1, 4.9, 5.0):  # the window keeps the last 4 only
        g.observe({"loss": x})
    assert g.history["loss"] == [5.0, 5.1, 4.9, 5.0] and g.suspect({"loss": 5.05}) is None
    assert g.score("loss", 9.9) > 5 and g.suspect({"loss": 9.9}) is None  # far out, but not twice the median
    assert g.suspect({"loss": 10.5}) is not None
    g.reset()
    assert g.suspect({"loss": 1e9}) is None
    assert SpikeGuard(threshold=0).suspect({"loss": 1e30}) is None  # 0: only non-finite values


def test_a_sampled_audit_needs_a_third_node_to_decide() -> None:
    """Slot 2 computed by n2 (right), audited by a persistently bad n1 (wrong) and rerun by n2: n1 and n2
    each explain it until a third node computes slot 2; then n1, wrong twice, is persistent."""
    good, bad = (5, 5), (7, 5)
    comps = [Computation((0, 0, 2), good, "n2", "original"), Computation((0, 0, 2), bad, "n1", "audit"),
             Computation((0, 0, 2), good, "n2", "rerun"), Computation((0, 0, 1), (9, 9), "n1", "original")]
    v = judge(comps)
    assert v.culprit is None and v.candidates == ["n1", "n2"] and v.label == "undetermined"
    comps += [Computation((0, 0, 2), good, "n0", "replay"), Computation((0, 0, 0), (1, 1), "n0", "original"),
              Computation((0, 0, 0), (2, 1), "n1", "replay")]
    v = judge(comps)
    assert (v.culprit, v.label, v.slots) == ("n1", "persistent", [(0, 0, 0), (0, 0, 2)])


def test_the_honest_limits_of_a_sampled_audit_name_the_steps_and_the_checkpoint(tmp_path: Path) -> None:
    from phoenixft.config import RunConfig
    from phoenixft.sdc.report import _limits

    for st in (5, 10, 15):
        (tmp_path / f"step_{st:08d}").mkdir()
        (tmp_path / f"step_{st:08d}" / "MANIFEST.json").write_text("{}")
    cfg = RunConfig(sdc_audit="sample", persist_every=5, persist_dir=str(tmp_path))
    log = [{"kind": "sdc_audit", "step": s, "nodes": ["n0", "n1" if s == 12 else "n2"]} for s in (4, 8, 12, 16)]
    verdicts = [{"step": 20, "node": "n1", "verdict": "persistent",
                 "reason": "the sample audit's recomputation differs"},
                {"step": 3, "node": "n2", "verdict": "transient", "reason": "loss 1e9 is 99 robust deviations above"}]
    (lim,) = _limits(cfg, log, verdicts)  # (a spike's verdict has no audit to be honest about)
    assert lim == {"node": "n1", "first_failed_audit": 20, "last_passed_audit": 12,
                   "steps_that_may_be_affected": [13, 19], "resume_from_checkpoint_before": 13,
                   "checkpoint": str(tmp_path / "step_00000010")}
    assert _limits(cfg.replace(sdc_audit="full"), log, verdicts) == []


def test_check_costs_per_step_are_amortised_means_with_the_median_beside() -> None:
    """A sampled audit every 10 steps costs a tenth of one audit per step (its median is 0: most steps run none);
    the share of the step is amortised too."""
    from phoenixft.sdc.report import _costs

    steps = [{"step": s, "dt": 0.1, "sdc_params_s": 0.001, "sdc_guard_s": 0.0005,
              "sdc_audit_s": 0.05 if s % 10 == 0 else 0.0} for s in range(1, 101)]
    c = _costs(steps)
    assert c["audit_s"] == pytest.approx(0.005) and c["audit_median_s"] == 0.0
    assert c["params_s"] == pytest.approx(0.001) and c["params_median_s"] == pytest.approx(0.001)
    assert c["total_s"] == pytest.approx(0.0065) and c["share_of_step"] == pytest.approx(0.065)
