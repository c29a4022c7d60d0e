"""3D parallelism (TP x PP x DP): the layout, the logical state map, and real 3D jobs that lose nodes.

Pure parts over many generated layouts (milliseconds): ranks <-> coordinates are a bijection in
Megatron's order, groups partition the world, replicas sit on data-parallel peers of the same
stage on other nodes, and the stages of the GPT cover the full model exactly once (the tied
output copy aside) with the full model's values. Then real jobs on 4 nodes x 2 workers (TP=2,
PP=2, DP=2) plus spares: the 3D run matches the data-parallel run of the same global batch at
every step, and kills in each phase, a crash restarted in place and a kill during a recovery all
end bitwise equal to the failure-free 3D run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import run

from phoenixft.config import RunConfig
from phoenixft.distributed.topology import Topology
from phoenixft.parallel.layers import TPHandle
from phoenixft.parallel.layout import Layout
from phoenixft.parallel.logical import from_full, segments, to_full
from phoenixft.parallel.stage import StageSpec
from phoenixft.train.gpt import GPT, PRESETS


def test_layout_is_megatron_order_and_groups_partition_the_world() -> None:
    rng = random.Random(7)
    for _ in range(300):
        t, p, d = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        lay = Layout(t * p * d, t, p)
        seen = set()
        for r in range(lay.world):
            c = lay.coord(r)
            assert r == c.tp + c.dp * t + c.pp * t * d == lay.rank(c.pp, c.dp, c.tp)
            seen.add((c.pp, c.dp, c.tp))
            for grp, same in ((lay.dp_group(r), ("pp", "tp")), (lay.tp_group(r), ("pp", "dp")),
                              (lay.pp_group(r), ("dp", "tp"))):
                assert r in grp
                assert all(getattr(lay.coord(x), a) == getattr(c, a) for x in grp for a in same)
        assert len(seen) == lay.world
        for r in (-1, lay.world):  # a rank outside the world is refused, naming the ranks there are
            with pytest.raises(ValueError, match=rf"^rank {r} outside 0\.\.{lay.world - 1}$"):
                lay.coord(r)
        for groups in ([lay.dp_group(r) for r in range(lay.world)], [lay.tp_group(r) for r in range(lay.world)]):
            assert sorted({x for g in groups for x in g}) == list(range(lay.world))
    with pytest.raises(ValueError):
        Layout(6, 4, 1)


def test_each_rank_knows_its_data_parallel_index_and_its_embedding_peers() -> None:
    """dp_rank is the data-parallel coordinate; the embedding group is the first and the last stage at the
    rank's (dp, tp) (one member without pipeline stages); the logical shard id names all three coordinates."""
    rng = random.Random(11)
    for _ in range(300):
        t, p, d = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        lay = Layout(t * p * d, t, p)
        for r in range(lay.world):
            c = lay.coord(r)
            assert lay.dp_rank(r) == c.dp == (r // t) % d
            first, last = lay.rank(0, c.dp, c.tp), lay.rank(p - 1, c.dp, c.tp)
            assert lay.embedding_group(r) == ([first, last] if p > 1 else [first])
            assert lay.shard_name(r) == f"pp{c.pp}.tp{c.tp}.dp{c.dp}of{d}"
    with pytest.raises(ValueError):
        Layout(4, 2, 1).coord(4)
    for world, tp, pp in [(6, 4, 1), (4, -1, 1), (4, 1, 0), (4, 0, 2)]:
        with pytest.raises(ValueError, match=rf"world {world} is not a multiple of tp x pp = {tp} x {pp}"):
            Layout(world, tp, pp)


def test_replicas_on_data_parallel_peers_of_other_nodes() -> None:
    rng = random.Random(11)
    for _ in range(500):
        t, p = rng.randint(1, 3), rng.randint(1, 3)
        d = rng.randint(2, 5)
        g = t * rng.choice([m for m in (1, 2) if d % m == 0])
        nodes = [f"n{i}" for i in range(t * p * d // g)]
        k = rng.randint(1, len(nodes) // p - 1) if len(nodes) // p > 1 else 0
        if not k:
            continue
        topo = Topology(epoch=0, nodes=nodes, workers_per_node=g, replicas=k, resume_step=0, tp=t, pp=p)
        lay = topo.layout
        for r in range(topo.world):
            hs = topo.holders(r)
            assert len(set(hs)) == k
            for j, h in enumerate(hs):
                assert h // g != r // g, "a replica on the owner's own node"
                assert lay.coord(h).stage == lay.coord(r).stage, "a replica on another stage (other sizes)"
                assert topo.sources(h)[j] == r


def test_replica_rounds_whole_racks_away_first_then_the_nearest_nodes() -> None:
    """The ring offsets of the replica rounds over thousands of generated rings: the other racks' first
    nodes first, then the nearest other nodes, each offset once, never 0 (the owner's own node)."""
    rng = random.Random(5)
    for _ in range(3000):
        racks = rng.randint(1, 6)
        n = racks * rng.randint(1, 40)
        k = rng.randint(1, max(1, min(n - 1, 8)))
        if n < 2:
            continue
        topo = Topology(epoch=0, nodes=[f"n{i}" for i in range(n)], workers_per_node=1, replicas=k,
                        resume_step=0, racks=racks)
        offs = topo._offsets()
        block = n // racks
        far = [block * j for j in range(1, racks)]
        assert offs == (far + [o for o in range(1, n) if o not in far])[:k], (n, racks, k)
        assert len(set(offs)) == len(offs) == k and 0 not in offs


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)])
def test_gpt_stages_cover_the_full_model_once(tp: int, pp: int) -> None:
    torch.manual_seed(0)
    full = GPT(PRESETS["tiny"])
    full_flat = torch.cat([q.detach().reshape(-1) for q in full.parameters()])
    covered = torch.zeros(full_flat.numel(), dtype=torch.int64)
    from phoenixft.parallel.gpt import split_gpt

    for p in range(pp):
        for t in range(tp):
            st = split_gpt(full, StageSpec(pp=p, pp_size=pp, tp=t, tp_size=tp, handle=TPHandle(tp, t)))
            segs = segments(st.pieces(), st.full())
            local = torch.cat([q.detach().reshape(-1) for q in st.params()])
            assert torch.equal(from_full(full_flat, segs, local.numel()), local), (p, t)
            # the elements this stage counts in the global gradient norm (TP-replicated ones on tp rank 0
            # only, the tied output copy never): over the whole mesh, every element exactly once
            counted = torch.cat([torch.full((q.numel(),), int(c), dtype=torch.int64)
                                 for q, c in zip(st.params(), st.counted(), strict=True)])
            mine = torch.zeros_like(covered)
            to_full(counted, segs, mine)
            covered += mine
    assert torch.equal(covered, torch.ones_like(covered))


def test_split_refuses_what_does_not_divide(tmp_path: Path) -> None:
    from phoenixft.config import RunConfig
    from phoenixft.errors import UserError

    with pytest.raises(UserError, match="--tp=3"):
        RunConfig(nodes=2, tp=3, spares=0).validate()  # 4 heads do not split 3 ways
    with pytest.raises(UserError, match="--pp=8"):
        RunConfig(nodes=8, pp=8, spares=0).validate()  # 4 layers do not make 8 stages
    with pytest.raises(UserError, match="does not say how its model splits"):
        RunConfig(nodes=2, tp=2, workload="user_workload:workload", spares=0).validate()
    with pytest.raises(UserError, match="--workers-per-node"):
        RunConfig(nodes=2, tp=2, workers_per_node=3, spares=0).validate()


# (the product's micro-batch: the 1e-4 agreement of 3D with data-parallel losses is measured at it)
MESH = {"nodes": 4, "tp": 2, "pp": 2, "steps": 20, "micro_batch": 2}


def test_3d_matches_data_parallel_at_every_step(reference) -> None:  # type: ignore[no-untyped-def]
    """Same model, same global batch (4 microbatches): TP=2 x PP=2 x DP=2 against DP=2 alone."""
    mesh = reference(**MESH)
    dp = reference(nodes=2, microbatches=4, steps=20, micro_batch=2)
    assert len(mesh["loss"]) == len(dp["loss"]) == 20
    for s, (a, b) in enumerate(zip(mesh["loss"], dp["loss"], strict=True), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {s}: 3D loss {a} vs data-parallel {b}"
    assert mesh["final_state_sha256"] != dp["final_state_sha256"]  # not bitwise: other reduction orders


def test_3d_kill_in_each_phase_is_bitwise_invisible(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """One 3D run, four node kills in four phases (a killed node comes back repaired as a spare)."""
    ref = reference(**MESH)
    faults = ["kill:node=1@step=4,phase=forward", "kill:node=2@step=8,phase=backward",
              "kill:node=3@step=12,phase=optimizer", "kill:node=0@step=16,phase=replicate"]
    rep = run(tmp_path, **MESH, spares=1, repair_after=1.0, inject=faults)
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["loss"] == ref["loss"]
    recs = rep["recoveries"]
    assert [r["action"] for r in recs] == ["hotswap"] * 4, recs
    assert all(r["lost_steps"] <= 1 and all(r["invariants"].values()) for r in recs), recs


def test_a_fault_on_nodes_of_two_stages_strikes_them_in_one_instant(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """kill:node=0,2 in a 2-stage pipeline (n0 stage 0, n2 stage 1): the first to reach the fault waits for the
    other before either dies, but stage 1's forward hook ran only once stage 0's activation had come, and
    stage 0 was the one waiting: 10 s later n0 died alone, n2 in the replayed step, two recoveries (the
    second with no fault). The backward phase had the same wait the other way round (the test below)."""
    kw = {**MESH, "steps": 6}
    ref = reference(**kw)
    rep = run(tmp_path, **kw, spares=2, inject=["kill:node=0,2@step=3,phase=forward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["dead"] == ["n0", "n2"] and sorted(rec["promoted"]) == ["s0", "s1"], rec
    assert rec["lost_steps"] <= 1 and all(rec["invariants"].values()), rec  # (1: step 2's replication was late)


def test_the_pipeline_runs_its_phase_hook_before_waiting_on_another_stage() -> None:
    """Stage 0 of 2 (1F1B): its backward hook runs before it waits for microbatch 0's gradient, and stage 1's
    forward hook before it waits for the activation (the fault of a multi-stage kill waits there)."""
    from phoenixft.parallel.pipeline import Pipeline

    class P(Pipeline):  # the transfers, recorded instead of made
        order: list[str]

        def _recv_act(self, batch: object, j: int) -> torch.Tensor:
            self.order.append(f"recv act {j}")
            return torch.ones(1, requires_grad=True)

        def _recv_grad(self, like: torch.Tensor, j: int) -> torch.Tensor:
            self.order.append(f"recv grad {j}")
            return torch.ones(1)

        def _send(self, way: str, t: torch.Tensor) -> None:
            pass

        def hook(self, phase: str, j: int) -> None:
            self.order.append(f"{phase} {j}")

    def fwd(j: int, b: object, inp: torch.Tensor | None) -> torch.Tensor:
        return (torch.ones(1, requires_grad=True) if inp is None else inp) * 2

    def bwd(j: int, out: torch.Tensor, g: torch.Tensor | None) -> None:
        out.backward(torch.ones(1) if g is None else g)

    for p, hook, wait in ((0, "backward 0", "recv grad 0"), (1, "forward 0", "recv act 0")):
        stage = type("S", (), {"first": p == 0, "last": p == 1})
        pipe = P(stage, p, 2, {}, lambda w, what: None, torch.float32)  # type: ignore[arg-type]
        pipe.order = []
        pipe.train(2, lambda j: None, fwd, bwd, before=pipe.hook)
        assert pipe.order.index(hook) < pipe.order.index(wait), pipe.order


@pytest.mark.slow  # (see README, Tests: covered in `make test` by a broader run)
def test_3d_crash_in_place_and_kill_during_recovery(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(**MESH)
    # node 2 (stage 1) dies, and node 1 (stage 0) during that recovery: each stage keeps one data-parallel copy
    faults = ["crash:rank=5@step=5", "kill:node=2@step=11,phase=backward", "kill:node=1@recovery=2"]
    rep = run(tmp_path, **MESH, spares=2, inject=faults)
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    recs = rep["recoveries"]
    assert [r["action"] for r in recs] == ["inplace", "hotswap", "hotswap"], recs
    assert [r["fault"].split(",wait")[0] for r in recs] == faults
    # the recovery interrupted by the second kill never reached its check; the one that replaced it did
    assert all(recs[0]["invariants"].values()) and all(recs[2]["invariants"].values())
    assert recs[2]["resumed_step"] == recs[1]["resumed_step"]


def test_3d_checkpoint_resumes_on_another_layout(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """A persistent checkpoint written by TP=2 x PP=2 x DP=2 resumes data-parallel only (DP=2) and
    trains on as the data-parallel run does; on the same layout it resumes bitwise."""
    persist = str(tmp_path / "ckpt")
    first = run(tmp_path / "a", **{**MESH, "steps": 10}, spares=0, persist_every=5, persist_dir=persist)
    assert first["state"] == "done", first.get("error")
    dp_ref = reference(nodes=2, microbatches=4, steps=20, micro_batch=2)
    dp = run(tmp_path / "b", nodes=2, microbatches=4, steps=20, micro_batch=2, spares=0, resume=persist)
    assert dp["state"] == "done", dp.get("error")
    assert len(dp["loss"]) == 10
    for s, (a, b) in enumerate(zip(dp["loss"], dp_ref["loss"][10:], strict=True), 11):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {s}: resumed {a} vs data-parallel {b}"


@pytest.mark.slow
def test_3d_checkpoint_resumes_bitwise_on_its_layout(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    persist = str(tmp_path / "ckpt")
    run(tmp_path / "a", **{**MESH, "steps": 10}, spares=0, persist_every=5, persist_dir=persist)
    again = run(tmp_path / "b", **MESH, spares=0, resume=persist)
    assert again["final_state_sha256"] == reference(**MESH)["final_state_sha256"]


@pytest.mark.slow
def test_3d_without_spares_waits_for_the_repaired_node(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """A mesh cannot drop a node: with no spare ready it waits for the lost node to come back repaired
    (`--repair-after`) and hot-swaps it in, instead of losing the run."""
    ref = reference(**MESH)
    rep = run(tmp_path, **MESH, spares=0, repair_after=1.0, inject=["kill:node=2@step=7,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["promoted"] and all(rec["invariants"].values()), rec


def test_3d_node_lost_while_the_late_spare_starts_waits_for_it(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """`--spare-arrives-at-step`: the spare the launcher has started but that is not ready yet is waited
    for (a mesh cannot drop a node), not written off ("no spare ready")."""
    ref = reference(nodes=4, pp=2, steps=8)
    rep = run(tmp_path, nodes=4, pp=2, steps=8, spares=0, spare_arrives_at_step=2,
              inject=["kill:node=1@step=3,phase=forward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["promoted"] == ["s0"] and all(rec["invariants"].values()), rec


@pytest.mark.parametrize("kw", [{}, {"repair_after": 70.0, "failure_timeout": 2.0}, {"repair_after": 600.0},
                                {"tp": 2, "pp": 1, "repair_after": 120.0}])
def test_survivors_wait_for_the_next_epoch_while_the_coordinator_waits_for_a_spare(kw: dict[str, float]) -> None:
    """A mesh that lost a node with no spare ready waits (bounded: mesh_spare_wait_s) for the repaired one.
    The survivors' wait for the next epoch must outlast it and the gather before it: with a fixed
    3 x --failure-timeout + 60 s, --repair-after 70 --failure-timeout 2 would make every survivor give up
    after 66 s ("no answer from the control plane for 'topo/1'"), exit, and be restarted in place,
    spending one of its three restarts per wait (a longer repair would lose the run)."""
    cfg = RunConfig(**{"nodes": 4, "pp": 2, "spares": 0, **kw})  # type: ignore[arg-type]
    cfg.validate()
    gather = 3 * cfg.failure_timeout  # the coordinator's gather of the descriptors, at most
    assert cfg.next_epoch_wait_s > gather + cfg.mesh_spare_wait_s
    dp = RunConfig(nodes=4, spares=0, repair_after=kw.get("repair_after", 0.0))  # a data-parallel job shrinks
    assert dp.next_epoch_wait_s == 3 * dp.failure_timeout + 60.0
