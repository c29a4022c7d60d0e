"""A (TP, PP, DP) mesh with no spare ready: it drops the lost node's whole data-parallel replica, keeps its
global batch, and grows back when spares are ready.

Real jobs, real SIGKILLs: the survivors keep their stage, the state of each stage is repartitioned over its
surviving data-parallel ranks from the copies they hold, the healthy nodes of the dropped replica wait as
spares and are grown back in (a whole column, one node per stage). The reduction over fewer data-parallel
ranks groups the same per-sample sums differently, so the loss is compared with the failure-free run within
SHRINK_REL_TOL at every step (the largest deviation is printed); two runs of one fault schedule are bitwise
equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run

from phoenixft.faults.chaos import SHRINK_REL_TOL

MESH = {"nodes": 4, "tp": 2, "pp": 2, "micro_batch": 2}
PIPE3 = {"nodes": 6, "pp": 2, "micro_batch": 2}  # tp=1: three data-parallel replicas of a 2-stage pipeline


def deviation(rep: dict[str, Any], ref: dict[str, Any]) -> list[float]:
    """The relative deviation of the loss from the failure-free run's, per step (asserted within the tolerance)."""
    assert len(rep["loss"]) == len(ref["loss"])
    devs = [abs(a - b) / abs(b) for a, b in zip(rep["loss"], ref["loss"], strict=True)]
    worst = max(range(len(devs)), key=devs.__getitem__)
    print(f"largest relative loss deviation {devs[worst]:.3g} at step {worst + 1}; per step: "
          + " ".join(f"{d:.1e}" for d in devs))
    assert devs[worst] <= SHRINK_REL_TOL, f"step {worst + 1}: {rep['loss'][worst]} vs {ref['loss'][worst]}"
    return devs


def shrink_record(rec: dict[str, Any], dead: str, released: list[str], world: int) -> None:
    assert rec["action"] == "shrink" and rec["dead"] == [dead] and rec["dropped"] == [dead], rec
    assert rec["released"] == released and rec["world"] == world and rec["promoted"] == [], rec
    assert rec["lost_steps"] <= 1 and all(rec["invariants"].values()), rec


def test_mesh_drops_a_replica_keeps_the_global_batch_and_grows_back(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """TP=2 x PP=2 x DP=2, no spare: n1 (stage 0 of replica 1) is killed, n3 (stage 1 of replica 1) is released,
    n0 and n2 train on as DP=1 with the whole global batch; the spare that arrives later and n3 make a whole
    column again, and the job grows back to DP=2 at a step boundary."""
    kw = {**MESH, "steps": 24}
    ref = reference(**kw)
    # the crash at step 18 holds its step until the job is whole again (wait=60): the late spare's start and the
    # grow happen before the run ends, however fast the steps are; then it is restarted in place in the full mesh
    rep = run(tmp_path, **kw, spares=0, spare_arrives_at_step=8,
              inject=["kill:node=1@step=5,phase=backward", "crash:rank=0@step=18,wait=60"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["steps_completed"] == 24
    shrink, grow, crash = rep["recoveries"]
    assert crash["action"] == "inplace" and all(crash["invariants"].values()), crash
    shrink_record(shrink, "n1", ["n3"], 4)
    assert grow["action"] == "grow" and sorted(grow["promoted"]) == ["n3", "s0"] and grow["world"] == 8, grow
    assert grow["lost_steps"] == 0, grow
    # the crash holds step 18 until the job is whole: when the grow lands at step 17's boundary, the crash strikes
    # the grow epoch's first step, and the grow completes in the crash's epoch (whose invariants are checked above)
    assert all(grow["invariants"].values()) or grow["completed_in_epoch"] == crash["epoch"], grow
    deviation(rep, ref)


@pytest.mark.parametrize("phase", [pytest.param("forward", marks=pytest.mark.slow), "backward", "optimizer",
                                   pytest.param("replicate", marks=pytest.mark.slow)])
def test_mesh_shrinks_for_a_kill_in_every_phase(tmp_path: Path, reference, phase: str) -> None:  # type: ignore[no-untyped-def]
    """PP=2 x DP=3 (tp=1), no spare: a node killed in each phase of a step; its replica leaves, the others train
    on with the same global batch, within the tolerance of the failure-free run."""
    kw = {**PIPE3, "steps": 10}
    ref = reference(**kw)
    rep = run(tmp_path, **kw, spares=0, inject=[f"kill:node=1@step=5,phase={phase}"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    shrink_record(rec, "n1", ["n4"], 4)
    deviation(rep, ref)


def test_losses_while_shrunk_use_the_released_node_then_drop_another_replica(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """PP=2 x DP=3 (tp=1), no spare: n1 lost, its replica leaves (n4, stage 1, released); n2 lost while shrunk: the
    released n4 is the spare that takes its slot (rebuilt for stage 0, its state from peers); n4 lost: no spare is
    left, so its replica leaves too (n5 released) and the last one trains on: DP 3 -> 2 -> 2 -> 1."""
    kw = {**PIPE3, "steps": 18}
    ref = reference(**kw)
    rep = run(tmp_path, **kw, spares=0, inject=["kill:node=1@step=4,phase=backward",
                                                "kill:node=1@step=9,phase=optimizer",
                                                "kill:node=1@step=14,phase=forward"])
    assert rep["state"] == "done", rep.get("error")
    first, swap, last = rep["recoveries"]
    shrink_record(first, "n1", ["n4"], 4)
    assert swap["action"] == "hotswap" and swap["dead"] == ["n2"] and swap["promoted"] == ["n4"], swap
    assert swap["lost_steps"] <= 1 and all(swap["invariants"].values()), swap
    shrink_record(last, "n4", ["n5"], 2)
    deviation(rep, ref)


@pytest.mark.slow  # (three runs' worth: the reference, a shrink, a recovery of the recovery)
def test_a_kill_during_the_repartition_of_a_shrink(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """PP=2 x DP=3 with two replicas per shard: n1 lost (its replica leaves, n4 released), and n2 killed while the
    survivors repartition the state. The repartition did not complete, so the next epoch plans from the layout the
    state is still in (DP=3), the released n4 takes n2's slot, and the state comes from the copies n0, n3, n5
    hold."""
    kw = {**PIPE3, "steps": 10, "replicas": 2}
    ref = reference(**kw)
    rep = run(tmp_path, **kw, spares=0, inject=["kill:node=1@step=4,phase=backward", "kill:node=1@recovery=1"])
    assert rep["state"] == "done", rep.get("error")
    first, second = rep["recoveries"]
    assert first["action"] == "shrink" and first["released"] == ["n4"] and first["completed_in_epoch"] == 2, first
    assert second["action"] == "hotswap" and second["dead"] == ["n2"] and second["promoted"] == ["n4"], second
    assert all(second["invariants"].values()) and second["resumed_step"] == first["resumed_step"], second
    deviation(rep, ref)


def test_a_shrunk_run_is_bitwise_reproducible(tmp_path: Path) -> None:
    """The same fault schedule twice: the same recovery step (a kill in the optimizer phase: every shard's
    previous step is replicated before the reduction), the same losses and the same final state, bit for bit."""
    kw = {**MESH, "steps": 10}
    runs = [run(tmp_path / x, **kw, spares=0, inject=["kill:node=1@step=4,phase=optimizer"]) for x in "ab"]
    for rep in runs:
        assert rep["state"] == "done", rep.get("error")
        (rec,) = rep["recoveries"]
        shrink_record(rec, "n1", ["n3"], 4)
    a, b = runs
    assert a["recoveries"][0]["resumed_step"] == b["recoveries"][0]["resumed_step"] == 3
    assert a["loss"] == b["loss"] and a["final_state_sha256"] == b["final_state_sha256"]
