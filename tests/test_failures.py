"""Failure classes beyond a clean SIGKILL: crashes, hangs, multiple and cascading failures, NaN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import processes_with, run


def test_worker_crash_is_restarted_in_place(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=1, steps=12, inject=["crash:rank=1@step=6,phase=backward"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert (rec["class"], rec["action"]) == ("transient", "inplace")
    assert rec["promoted"] == [] and rec["dead"] == [] and rec["restarted"] == ["n1.0"]  # spare pool unchanged
    assert all(rec["invariants"].values()) and rec["lost_steps"] <= 1


def test_hung_node_is_detected_fenced_and_swapped(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=1, steps=12, failure_timeout=2.0, inject=["hang:node=2@step=6"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["dead"] == ["n2"] and rec["promoted"] == ["s0"]
    assert rec["fenced"] == ["n2"] and rec["unresponsive"] == ["n2"], rec
    assert processes_with(rep["run_id"]) == []  # the stopped node was fenced (killed), not left behind


def test_two_nodes_in_one_step_with_two_replicas(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=2, replicas=2, steps=12, inject=["kill:node=1,2@step=6,phase=backward"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["dead"] == ["n1", "n2"] and sorted(rec["promoted"]) == ["s0", "s1"]


def test_rack_failure_with_rack_aware_replicas(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    # nodes 0 and 1 share rack 0; with --racks 2 their replicas live in rack 1, so one replica suffices
    rep = run(tmp_path, nodes=4, spares=2, replicas=1, racks=2, steps=12, inject=["kill:rack=0@step=6,phase=optimizer"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["dead"] == ["n0", "n1"]
    (f,) = rep["faults"]  # one record for the rack, naming every node it struck
    assert sorted(f["nodes"]) == ["n0", "n1"] and rec["faults"] == [f["spec"]], f


def test_a_rack_fault_strikes_its_rack_once_even_after_a_shrink_renumbers_the_racks(tmp_path: Path) -> None:
    # no spares: the rack's two nodes are dropped, the job shrinks to 2 nodes whose slots fall in
    # "rack 1" again when the step is replayed; the fault must not strike them (it struck n1 too)
    rep = run(tmp_path, nodes=4, spares=0, racks=2, steps=8, inject=["kill:rack=1@step=4,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    assert rec["dead"] == ["n2", "n3"] and rec["action"] == "shrink"
    struck = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted(e["node"] for e in struck if e["kind"] == "fault") == ["n2", "n3"]


def test_owner_and_replica_lost_stops_with_named_shards(tmp_path: Path) -> None:
    # without racks, node 1 keeps node 0's replica: both die in one step
    rep = run(tmp_path, nodes=4, spares=2, replicas=1, steps=12, inject=["kill:node=0,1@step=6,phase=backward"])
    assert rep["state"] == "failed"
    assert "lost shards: pp0.tp0.dp0of4" in rep["error"]


def test_spare_killed_during_its_own_transfer(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=2, steps=12, inject=["kill:node=1@step=6", "kill:node=1@recovery=1"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    first, second = rep["recoveries"]
    assert first["promoted"] == ["s0"] and second["dead"] == ["s0"] and second["promoted"] == ["s1"]
    assert first["completed_in_epoch"] == 2 and all(second["invariants"].values())


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phoenixft", "run", "--quiet", *args], capture_output=True,
                          text=True, timeout=180, env=env)


def test_nan_loss_stops_cleanly(tmp_path: Path) -> None:
    p = _cli("--nodes", "2", "--spares", "0", "--steps", "10", "--inject", "nan:step=5", "--run-dir", str(tmp_path))
    assert p.returncode != 0
    reasons = [ln for ln in p.stderr.splitlines() if ln.startswith("!! run failed")]
    assert len(reasons) == 1 and "loss of step 5 is nan" in reasons[0], p.stderr
    assert "Traceback" not in p.stderr


def test_exception_in_user_code_stops_cleanly(tmp_path: Path) -> None:
    here = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = _cli("--nodes", "2", "--spares", "1", "--steps", "10", "--workload", "user_workload:broken_workload",
             "--run-dir", str(tmp_path), env=env)
    assert p.returncode != 0
    reasons = [ln for ln in p.stderr.splitlines() if ln.startswith("!! run failed")]
    assert len(reasons) == 1 and "ValueError: shapes do not line up" in reasons[0], p.stderr
