"""No spare left: shrink with a constant global batch; a spare arrives later: grow back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run


def _close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b)
    for s, (x, y) in enumerate(zip(a, b, strict=True), 1):
        assert abs(x - y) <= rel * abs(y), f"step {s}: {x} vs {y}"


def test_shrink_keeps_the_trajectory(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12, microbatches=6)
    rep = run(tmp_path, nodes=3, spares=0, steps=12, microbatches=6, inject=["kill:node=1@step=6,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["steps_completed"] == 12
    (rec,) = rep["recoveries"]
    assert rec["action"] == "shrink" and rec["promoted"] == [] and all(rec["invariants"].values())
    # the same samples every step; only the reduction order differs (2 ranks instead of 3)
    _close(rep["loss"], ref["loss"], 1e-4)


@pytest.mark.slow
def test_shrink_then_grow_back(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=30, microbatches=6)
    rep = run(tmp_path, nodes=3, spares=0, steps=30, microbatches=6, spare_arrives_at_step=4,
              inject=["kill:node=1@step=3,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    shrink, grow = rep["recoveries"]
    assert shrink["action"] == "shrink" and grow["action"] == "grow" and grow["promoted"] == ["s0"]
    assert all(grow["invariants"].values())
    _close(rep["loss"], ref["loss"], 1e-4)


def test_gated_faults_hold_only_until_the_job_is_whole(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """`,wait=S` with no spares and --repair-after (what `phoenixft chaos --spares 0` draws): a job
    without spares is whole at full size, so the first kill fires at once (it does not wait its full 60 s
    for a warm spare that cannot exist); the second, due in a phase a one-node job never reaches
    (replicate), is held before its step until the repaired node is grown back in, then fires (it is
    not skipped). Holding happens before the step on every rank: no collective times out meanwhile."""
    ref = reference(nodes=2, steps=10, microbatches=2)
    rep = run(tmp_path, nodes=2, spares=0, steps=10, microbatches=2, repair_after=1.0,
              inject=["kill:node=1@step=3,phase=backward,wait=60", "kill:node=1@step=5,phase=replicate,wait=60"])
    assert rep["state"] == "done", rep.get("error")
    ev = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines() if x.strip()]
    start = min(e["t"] for e in ev if e.get("kind") == "epoch")
    fired = {e["spec"]: e for e in ev if e.get("kind") == "fault"}
    assert len(fired) == 2, f"faults fired: {sorted(fired)}"
    first = fired["kill:node=1@step=3,phase=backward,wait=60"]
    assert first["t"] - start < 20.0, f"the first kill was held {first['t'] - start:.1f}s for nothing"
    actions = [r["action"] for r in rep["recoveries"]]
    assert actions[:3] == ["shrink", "grow", "shrink"], actions
    assert all(r["class"] != "transient" for r in rep["recoveries"]), "a held step timed a collective out"
    assert all(all(r["invariants"].values()) for r in rep["recoveries"])
    _close(rep["loss"], ref["loss"], 1e-4)


def test_kill_during_a_grow_fires_and_is_recovered(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """`kill:node=I@recovery=N` fires in a reshard (here the grow that brings the repaired node back)
    as in a hot-swap's transfer: on every recovery path, not only the hot-swap."""
    ref = reference(nodes=3, steps=16, microbatches=6)
    # the crash at step 12 holds its step until the job is whole again (wait=60): the repairs and both
    # grows happen before the run ends, however fast the steps are
    rep = run(tmp_path, nodes=3, spares=0, steps=16, microbatches=6, repair_after=1.0,
              inject=["kill:node=1@step=3,phase=optimizer", "kill:node=0@recovery=2",
                      "crash:rank=1@step=12,wait=60"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["faults_not_fired"] == [] and len(rep["faults"]) == 3
    grow = [r for r in rep["recoveries"] if r["epoch"] == 2]
    assert grow and grow[0]["action"] == "grow", [(r["epoch"], r["action"]) for r in rep["recoveries"]]
    assert rep["faults"][1]["recovery"] == 2
    # the grow was cut short by the kill: its state was still in the 2-node layout, and the next epoch
    # repartitioned from that one (not every shard of the 3-node layout declared lost)
    assert grow[0]["completed_in_epoch"] > 2
    assert all(all(r["invariants"].values()) for r in rep["recoveries"] if r["completed_in_epoch"] == r["epoch"])
    _close(rep["loss"], ref["loss"], 1e-4)


def test_a_fault_that_never_fires_is_reported(tmp_path: Path) -> None:
    spec = "kill:node=1@step=4"  # slot 1 is gone by then: the job shrank at step 2, and no spare comes back
    rep = run(tmp_path, nodes=2, spares=0, steps=5, inject=["kill:node=1@step=2", spec])
    assert rep["state"] == "done" and len(rep["faults"]) == 1 and rep["faults_not_fired"] == [spec]
