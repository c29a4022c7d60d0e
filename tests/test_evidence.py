"""I2 and I4 from evidence recorded before the failure (recovery/evidence.py): the comparison over generated
evidence and installs against an oracle, data-parallel peers that disagree on their parameters, and the
restore's last step over real ping-pong halves in mapped files, where a restore that installs the previous
step or another rank's shard (headers saying otherwise) stops with "invariant I4/I2 failed" naming the
shard and the step."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from conftest import TwoPassGather

from phoenixft.coordinator.publish import published
from phoenixft.distributed.topology import Topology
from phoenixft.protect.snapshot import PingPong, checksum
from phoenixft.recovery.evidence import (
    NO_EVIDENCE,
    NO_MATCH,
    Seen,
    installed_seen,
    match_opt,
    params_checksums,
    plan_evidence,
    rank_evidence,
    seen_after_restore,
)
from phoenixft.recovery.invariants import check_invariants, failure_message
from phoenixft.recovery.planner import Descriptor, PlanInput, plan_recovery


def _check_all(topo: Topology, r: int, seens: list[Seen]) -> list[tuple[dict[str, bool], str]]:
    """check_invariants on every rank of a job whose headers all say the right thing (the state a restore
    writes whatever it installed): only the evidence can tell."""
    g = TwoPassGather()
    wait = lambda work, what: None  # noqa: E731
    w = topo.world

    def one(i: int) -> tuple[dict[str, bool], str]:
        return check_invariants(g, topo, i, r, r, [r], (i, w), True, wait, seens[i])

    for i in range(w):
        one(i)
    g.full = torch.cat(g.rows)
    return [one(i) for i in range(w)]


def _topo(nodes: int, r: int) -> Topology:
    return Topology(epoch=2, nodes=[f"n{i}" for i in range(nodes)], workers_per_node=1, replicas=1, resume_step=r)


def test_installed_bytes_are_identified_by_shard_and_step_over_generated_evidence() -> None:
    rng = random.Random(7)
    seen_kinds = {"ok": 0, "prev": 0, "other": 0, "none": 0}
    for _ in range(500):
        world, r = rng.randint(2, 6), rng.randint(1, 40)
        steps = [r - 1, r] + ([r + 1] if rng.random() < 0.3 else [])
        crcs = rng.sample(range(1, 1 << 62), world * len(steps) + 1)
        ev = {"step": r, "opt": {str(i): {str(s): crcs[i * len(steps) + k] for k, s in enumerate(steps)}
                                 for i in range(world)}, "params": {}}
        topo = _topo(world, r)
        truth = []
        seens = []
        for i in range(world):
            kind = rng.choice(["ok", "ok", "prev", "other", "none"])
            seen_kinds[kind] += 1
            j = rng.choice([x for x in range(world) if x != i])
            crc = {"ok": ev["opt"][str(i)][str(r)], "prev": ev["opt"][str(i)][str(r - 1)],
                   "other": ev["opt"][str(j)][str(r)], "none": crcs[-1]}[kind]
            s, st = match_opt(ev, crc, i, r)
            assert (s, st) == {"ok": (i, r), "prev": (i, r - 1), "other": (j, r), "none": (NO_MATCH, NO_MATCH)}[kind]
            # as a worker sees it: its own part first, the whole table read only when that matches nothing
            reads: list[dict[str, Any]] = []

            def whole(table: dict[str, Any] = ev, reads: list[dict[str, Any]] = reads) -> dict[str, Any]:
                reads.append(table)
                return table

            got = seen_after_restore(rank_evidence(ev, i, "pp0.tp0"), crc, 0, i, "pp0.tp0", r, whole)
            assert (got.opt_shard, got.opt_step) == (s, st) and len(reads) == (kind in ("other", "none")), kind
            seens.append(Seen(opt_shard=s, opt_step=st, param_step=NO_EVIDENCE, param_crc=0))
            truth.append(kind)
        want_i2 = [i for i, k in enumerate(truth) if k in ("other", "none")]
        want_i4 = [i for i, k in enumerate(truth) if k == "prev"]
        for inv, detail in _check_all(topo, r, seens):
            assert inv == {"I1": True, "I2": not want_i2, "I3": True, "I4": not want_i4}, (truth, detail)
            for i in want_i4:
                assert f"rank {i} ({topo.shard_name(i)}, step {r}) installed the optimizer state of " \
                       f"{topo.shard_name(i)} at step {r - 1}" in detail
    assert all(n > 50 for n in seen_kinds.values()), seen_kinds


def test_a_data_parallel_peer_with_other_parameters_breaks_i4() -> None:
    topo = _topo(4, 9)
    seens = [Seen(param_crc=c) for c in (11, 11, 22, 11)]
    for inv, detail in _check_all(topo, 9, seens):
        assert inv["I4"] is False and "I4 fails on ranks [2]" in detail
    tie = [Seen(param_crc=c) for c in (11, 11, 22, 22)]
    for _inv, detail in _check_all(topo, 9, tie):
        assert "I4 fails on ranks [0, 1, 2, 3]" in detail
    for inv, _ in _check_all(topo, 9, [Seen(param_crc=5)] * 4):
        assert all(inv.values())


def test_parameters_of_another_step_than_recorded_break_i4() -> None:
    topo = _topo(2, 9)
    seens = [Seen(param_step=9, param_crc=3), Seen(param_step=8, param_crc=3)]
    for inv, detail in _check_all(topo, 9, seens):
        assert not inv["I4"] and inv["I2"] and "rank 1 (pp0.tp0.dp1of2, step 9) installed the parameters of step 8" \
            in detail


# -- the restore's last step over real halves ------------------------------------------------------------


def _evidence_by_definition(pi: PlanInput, r: int, decoded: dict[int, int]) -> dict[str, Any]:
    """The optimizer evidence as the module docstring defines it, shard by shard over every descriptor: the
    owner's committed checksum first, then the holders' replica headers by worker id (own state before
    replicas), a copy some receiver found bad or a zero checksum never; a rebuilt shard's recorded one last."""
    bad = {(s, st, w) for d in pi.descs.values() for s, st, w in d.bad_sources}
    opt: dict[str, dict[str, int]] = {}
    for i in range(pi.old.world):
        name, owner = pi.old.shard_name(i), f"{pi.old.node_of_rank(i)}.{i % pi.old.workers_per_node}"
        order = ([owner] if owner in pi.descs else []) + [w for w in sorted(pi.descs) if w != owner]
        ev: dict[str, int] = {}
        for src in ("own", "holdings"):
            for w in order:
                for st, crc in getattr(pi.descs[w], src).get(name, {}).items():
                    if (name, st, w) not in bad and crc != 0:
                        ev.setdefault(str(st), crc)
        if i in decoded:
            ev.setdefault(str(r), decoded[i])
        opt[str(i)] = ev
    return opt


def test_the_plans_evidence_matches_its_definition_over_generated_descriptors() -> None:
    """Copies of one (shard, step) that disagree (a stale header, a corrupt replica), bad sources, zero
    checksums, rebuilt shards, missing owners: the evidence the planner records takes each shard's checksum
    from the source its definition names, over 2,000 generated jobs."""
    rng = random.Random(11)
    for case in range(2000):
        n, g = rng.randint(2, 6), rng.choice([1, 2, 4])
        old = Topology(epoch=1, nodes=[f"n{i}" for i in range(n)], workers_per_node=g, replicas=1, resume_step=0)
        r = rng.randint(2, 9)
        descs: dict[str, Descriptor] = {}
        wids = [f"n{i}.{j}" for i in range(n) for j in range(g) if rng.random() < 0.8]
        for w in wids:
            d = Descriptor(wid=w)
            for _ in range(rng.randint(0, 4)):
                shard = old.shard_name(rng.randrange(old.world))
                src = d.own if rng.random() < 0.4 else d.holdings
                for st in rng.sample([r - 2, r - 1, r], rng.randint(1, 3)):
                    src.setdefault(shard, {})[st] = rng.choice([0, rng.randrange(1, 6), rng.randrange(1, 1 << 32)])
            descs[w] = d
        for w in wids:
            if rng.random() < 0.2:
                src_w = rng.choice(wids)
                for shard, steps in [*descs[src_w].own.items(), *descs[src_w].holdings.items()]:
                    descs[w].bad_sources += [(shard, st, src_w) for st in steps if rng.random() < 0.5]
        decoded = {i: rng.randrange(1, 1 << 32) for i in range(old.world) if rng.random() < 0.2}
        pi = PlanInput(old=old, dead=set(), restarted=set(), descs=descs, pool=[], target_nodes=n, replicas=1,
                       racks=1)
        ev = plan_evidence(pi, r, decoded)
        assert ev["step"] == r and ev["opt"] == _evidence_by_definition(pi, r, decoded), case


def _state(tmp: Path, name: str, n: int, steps: dict[int, torch.Tensor], shard: tuple[int, int]) -> PingPong:
    """A rank's optimizer shard in mapped files, with committed halves of `steps` (payload rows x n)."""
    st = PingPong(2, n, str(tmp / name))
    for half, (s, rows) in enumerate(sorted(steps.items())):
        st.begin_write(half)
        st.data[half].copy_(rows)
        st.commit(half, s, checksum(st.payload(half)), shard)
    return st


def _job(tmp: Path, r: int) -> tuple[Topology, list[PingPong], list[Any]]:
    """Two ranks that committed steps r-1 and r, their flat parameters, and the plan of a restart in place
    made from their descriptors (the evidence the coordinator gathers)."""
    gen = torch.Generator().manual_seed(r)
    n = 64
    states, flats, descs = [], [], {}
    old = Topology(epoch=1, nodes=["n0", "n1"], workers_per_node=1, replicas=1, resume_step=r - 1)
    params = {s: torch.randn(n, generator=gen) for s in (r - 1, r)}
    for i in range(2):
        st = _state(tmp, f"rank{i}", n, {s: torch.randn(2, n, generator=gen) for s in (r - 1, r)}, (i, 2))
        flat = SimpleNamespace(bufs=[params[r - 1].clone(), params[r].clone()], live=1, numel=n,
                               device=torch.device("cpu"), buf_step=[r - 1, r])
        flat.params_view = (lambda f: lambda which=None: f.bufs[f.live if which is None else which][: f.numel])(flat)
        d = Descriptor(wid=f"n{i}.0", params=[r - 1, r], params_crc=params_checksums(flat))
        for h in (0, 1):
            d.own.setdefault(old.shard_name(i), {})[st.step_of(h)] = st.known_crc(h)
        states.append(st)
        flats.append(flat)
        descs[d.wid] = d
    plan = plan_recovery(PlanInput(old=old, dead=set(), restarted={"n1.0"}, descs=descs, pool=[], target_nodes=2,
                                   replicas=1, racks=1))
    assert plan.ok and plan.topo is not None and plan.resume_step == r
    return plan.topo, states, flats


def _install_as(st: PingPong, rows: torch.Tensor, r: int, shard: tuple[int, int]) -> None:
    """What a faulty restore does: commit `rows` as step r of `shard`, headers and checksum consistent."""
    half = st.staging()
    st.begin_write(half)
    st.data[half].copy_(rows)
    st.commit(half, r, checksum(st.payload(half)), shard)
    st.header[1 - half, 2] = 0


def _verdict(topo: Topology, states: list[PingPong], flats: list[Any], r: int) -> list[tuple[dict[str, bool], str]]:
    ev = topo.meta["evidence"]  # (published beside the topology: each rank reads its part, the table if need be)
    assert "evidence" not in published(topo).meta and published(topo).nodes == topo.nodes
    seens = [installed_seen(SimpleNamespace(state=st, flat=f), topo, i, r,
                            rank_evidence(ev, i, topo.layout.coord(i).name()), lambda: ev)
             for i, (st, f) in enumerate(zip(states, flats, strict=True))]
    return _check_all(topo, r, seens)


def test_a_correct_restore_passes_on_the_evidence(tmp_path: Path) -> None:
    topo, states, flats = _job(tmp_path, 12)
    assert topo.meta["evidence"]["step"] == 12 and set(topo.meta["evidence"]["opt"]) == {"0", "1"}
    for inv, detail in _verdict(topo, states, flats, 12):
        assert all(inv.values()), detail


def test_evidence_gone_from_the_store_fails_i2_and_i4_instead_of_skipping_them(tmp_path: Path) -> None:
    """The topology the workers read says (signed) that evidence was published; a rank whose part is missing
    or does not verify (a stranger deleted or overwrote `evidence/<e>/<rank>`) identifies nothing: its I2 and
    I4 fail, naming the key, rather than passing on the headers alone."""
    topo, states, flats = _job(tmp_path, 12)
    seen_by_workers = published(topo)
    assert seen_by_workers.meta["evidence_step"] == 12 and "evidence" not in seen_by_workers.meta
    ev = topo.meta["evidence"]
    seens = [installed_seen(SimpleNamespace(state=st, flat=f), seen_by_workers, i, 12,
                            None if i == 1 else rank_evidence(ev, i, topo.layout.coord(i).name()), lambda: ev)
             for i, (st, f) in enumerate(zip(states, flats, strict=True))]
    for inv, detail in _check_all(seen_by_workers, 12, seens):
        assert inv == {"I1": True, "I2": False, "I3": True, "I4": False}, detail
        assert "I2 fails on ranks [1]" in detail and "I4 fails on ranks [1]" in detail, detail
        assert f"(evidence/{topo.epoch}/1) is missing or does not verify" in detail, detail
    # a plan that published no evidence (a world that changed size) is checked on its headers, as before
    plain = installed_seen(SimpleNamespace(state=states[1], flat=flats[1]), _topo(2, 12), 1, 12, None)
    assert (plain.opt_shard, plain.opt_step, plain.param_step) == (NO_EVIDENCE, NO_EVIDENCE, NO_EVIDENCE)


def test_a_restore_that_installs_the_previous_step_stops_with_i4(tmp_path: Path) -> None:
    r = 12
    topo, states, flats = _job(tmp_path, r)
    prev = states[1].data[states[1].half_with(r - 1)].clone()
    _install_as(states[1], prev, r, (1, 2))  # the header says step r, shard 1
    for inv, detail in _verdict(topo, states, flats, r):
        assert inv == {"I1": True, "I2": True, "I3": True, "I4": False}, detail
        msg = failure_message(inv, detail, topo.epoch, r)
        assert msg.startswith(f"invariant I4 failed after recovery to epoch {topo.epoch} to step {r}")
        assert f"rank 1 (pp0.tp0.dp1of2, step {r}) installed the optimizer state of pp0.tp0.dp1of2 at step {r - 1}" \
            in msg


def test_a_restore_that_installs_another_ranks_shard_stops_with_i2(tmp_path: Path) -> None:
    r = 12
    topo, states, flats = _job(tmp_path, r)
    other = states[0].data[states[0].half_with(r)].clone()
    _install_as(states[1], other, r, (1, 2))
    for inv, detail in _verdict(topo, states, flats, r):
        assert inv == {"I1": True, "I2": False, "I3": True, "I4": True}, detail
        msg = failure_message(inv, detail, topo.epoch, r)
        assert msg.startswith("invariant I2 failed") and \
            f"rank 1 (pp0.tp0.dp1of2, step {r}) installed the optimizer state of pp0.tp0.dp0of2 at step {r}" in msg


def test_a_header_that_claims_the_right_checksum_over_other_bytes_is_refused_by_the_evidence(tmp_path: Path) -> None:
    """A restore that installs bytes other than the resume step's (the previous step's, or one bit off) under a
    header that claims exactly the checksum the evidence recorded for (shard, r): the evidence hashes the
    installed bytes, so the header's claim cannot make them pass."""
    r = 12
    for damage in ("previous", "one_bit"):
        (tmp_path / damage).mkdir()
        topo, states, flats = _job(tmp_path / damage, r)
        st = states[1]
        right = st.known_crc(st.half_with(r))
        assert topo.meta["evidence"]["opt"]["1"][str(r)] == right
        rows = st.data[st.half_with(r - 1 if damage == "previous" else r)].clone()
        if damage == "one_bit":
            rows.view(torch.int32)[1, 5] ^= 1 << 20
        half = st.staging()
        st.begin_write(half)
        st.data[half].copy_(rows)
        st.commit(half, r, right, (1, 2))  # the header: step r, shard 1, the recorded checksum of step r
        st.header[1 - half, 2] = 0
        assert st.crc_of(half) == right and checksum(st.payload(half)) != right
        for inv, detail in _verdict(topo, states, flats, r):
            # bytes of another step break I4; bytes that match no recorded checksum are no shard's: I2
            want = {"I1": True, "I2": damage == "previous", "I3": True, "I4": damage == "one_bit"}
            assert inv == want, (damage, detail)
            said = (f"installed the optimizer state of pp0.tp0.dp1of2 at step {r - 1}" if damage == "previous"
                    else "its optimizer state matches no checksum committed before the failure")
            assert f"rank 1 (pp0.tp0.dp1of2, step {r})" in detail and said in detail, (damage, detail)


def test_previous_step_parameters_break_i4_even_when_every_peer_agrees(tmp_path: Path) -> None:
    r = 12
    topo, states, flats = _job(tmp_path, r)
    for f in flats:  # every rank rolled its parameters back one step too far, tagged as r
        f.live = 0
    for inv, detail in _verdict(topo, states, flats, r):
        assert not inv["I4"] and inv["I2"] and f"installed the parameters of step {r - 1}" in detail


# -- a whole run whose restore installs the wrong state ---------------------------------------------------


def _run_mutated(tmp_path: Path, monkeypatch: Any, mode: str) -> dict[str, Any]:
    """A 2-node run with a spare, node 1 killed in step 6's forward (the survivor's halves hold steps 5
    and 4), with rank 0's restore mutated (tests/mutate_restore/sitecustomize.py)."""
    from conftest import run

    here = Path(__file__).parent / "mutate_restore"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PHOENIXFT_TEST_MUTATE_RESTORE", mode)
    return run(tmp_path, nodes=2, spares=1, steps=8, inject=["kill:node=1@step=6,phase=forward"])


def test_a_run_whose_restore_installs_the_previous_step_stops_on_i4(tmp_path: Path, monkeypatch: Any) -> None:
    rep = _run_mutated(tmp_path, monkeypatch, "previous")
    assert rep["state"] == "failed", rep.get("error")
    # the resume step is 5, or 4 when the kill came before step 5's replica was committed; the mutated
    # restore installs the survivor's other half, which holds the other of the two steps
    m = re.search(r"invariant I4 failed after recovery to epoch 1 to step (\d+) .*rank 0 \(pp0\.tp0\.dp0of2, step "
                  r"(\d+)\) installed the optimizer state of pp0\.tp0\.dp0of2 at step (\d+)", rep["error"])
    assert m, rep["error"]
    resumed, claimed, installed = map(int, m.groups())
    assert resumed == claimed in (4, 5) and installed == 9 - resumed, rep["error"]


def test_a_run_whose_restore_installs_another_shard_stops_on_i2(tmp_path: Path, monkeypatch: Any) -> None:
    rep = _run_mutated(tmp_path, monkeypatch, "other_shard")
    assert rep["state"] == "failed", rep.get("error")
    m = re.search(r"invariant I2 failed after recovery to epoch 1 to step (\d+) .*rank 0 \(pp0\.tp0\.dp0of2, step "
                  r"(\d+)\) installed the optimizer state of pp0\.tp0\.dp1of2 at step (\d+)", rep["error"])
    assert m, rep["error"]
    resumed, claimed, installed = map(int, m.groups())
    assert resumed == claimed == installed and resumed in (4, 5), rep["error"]
