"""A user's own training script under `phoenixft launch` (phoenixft.init() and its Job): the script keeps its
loop, model, optimizer, scheduler and loader; phoenixft protects every step and recovers every failure inside
the running processes. Real processes, real SIGKILLs, the final state hash compared with the failure-free run.

The script is the shipped example, examples/ddp_script_phoenixft.py (DDP, AdamW, a cosine schedule,
gradient clipping, a DataLoader with a DistributedSampler, dropout: the step's generators matter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run

from phoenixft.cli.cmd_launch import SCRIPT_STEPS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_script_phoenixft.py"
PLAIN = ROOT / "examples" / "ddp_script.py"
STEPS = 16


def launch(tmp: Path, script: Path = EXAMPLE, args: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    kw.setdefault("nodes", 2)
    kw.setdefault("spares", 1)
    return run(tmp, script=str(script), script_args=["--steps", str(STEPS), *(args or [])], steps=SCRIPT_STEPS, **kw)


_ref: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The failure-free run of the example (2 nodes, a spare)."""
    if "clean" not in _ref:
        rep = launch(tmp_path_factory.mktemp("clean"))
        assert rep["state"] == "done", rep["state"]
        assert rep["steps_completed"] == STEPS and rep["recoveries"] == [], rep["recoveries"]
        _ref["clean"] = rep
    return _ref["clean"]


def test_a_clean_run_is_deterministic_and_reports_the_scripts_loss(tmp_path: Path, clean: dict[str, Any]) -> None:
    again = launch(tmp_path)
    assert again["final_state_sha256"] == clean["final_state_sha256"]
    assert len(clean["loss"]) == STEPS and clean["loss"][0] > clean["loss"][-1], clean["loss"]  # (job.log(loss=))


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", "replicate"])
def test_a_node_killed_in_any_phase_is_hot_swapped_bitwise(tmp_path: Path, clean: dict[str, Any], phase: str) -> None:
    rep = launch(tmp_path, inject=[f"kill:node=1@step=7,phase={phase}"])
    assert rep["state"] == "done", rep["state"]
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    (rec,) = rep["recoveries"]
    assert rec["dead"] == ["n1"] and rec["promoted"] == ["s0"] and rec["lost_steps"] <= 1, rec
    assert all(rec["invariants"][k] for k in ("I1", "I2", "I3", "I4")), rec["invariants"]
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


def test_a_crashed_worker_restarts_in_place_bitwise(tmp_path: Path, clean: dict[str, Any]) -> None:
    """The worker process of rank 0 dies (its node stays): its agent restarts it in place, the script runs again
    from its top, `phoenixft.init()` reports what the worker kept in shared memory, and the run goes on."""
    rep = launch(tmp_path, inject=["crash:rank=0@step=9"])
    assert rep["state"] == "done", rep["state"]
    assert [r["action"] for r in rep["recoveries"]] == ["inplace"], rep["recoveries"]
    assert rep["recoveries"][0]["promoted"] == [], rep["recoveries"]
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


@pytest.mark.parametrize("fault,action", [("crash:rank=0@step=8,phase=copy", "inplace"),
                                          ("kill:node=0@step=8,phase=copy", "hotswap")])
def test_a_worker_that_dies_before_its_parameters_copy_committed_keeps_its_own_shard(
        tmp_path: Path, clean: dict[str, Any], fault: str, action: str) -> None:
    """Rank 0 dies between its snapshot's two commits (phase=copy: step 8's own side committed, the copy of its
    parameters and optimizer state not yet). Restarted in place, the worker holds its own shard of step 8 but not
    the parameters of 8: it keeps its shard and gets only the parameters from a peer (no rank is ever its own
    transfer source). Its node killed, the spare gets both. Either way the run ends as the failure-free one."""
    rep = launch(tmp_path, inject=[fault])
    assert rep["state"] == "done", rep["state"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == action and rec["lost_steps"] <= 1 and all(rec["invariants"].values()), rec
    assert rec["bytes_moved"] > 0, rec  # (the parameters of step 8, from a peer)
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


def test_an_error_in_the_script_stops_the_run_with_its_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad_script.py"
    bad.write_text(EXAMPLE.read_text().replace("loss.backward()", "loss.backward()\n        if step == 4:\n"
                                               "            raise ValueError('a bug in my loop')"))
    rep = launch(tmp_path / "run", script=bad)
    assert rep["state"].startswith("failed"), rep["state"]
    blob = json.dumps(rep)
    assert "a bug in my loop" in blob and "bad_script.py" in blob, rep.get("error")


def test_the_converted_script_runs_unprotected_with_python(tmp_path: Path) -> None:
    """The same script outside phoenixft (`python script.py`): phoenixft.init() gives an unprotected job."""
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_converted_example_differs_from_the_plain_one_by_few_lines() -> None:
    out = subprocess.run(["diff", str(PLAIN), str(EXAMPLE)], capture_output=True, text=True)
    changed = [ln for ln in out.stdout.splitlines() if ln.startswith(">")]
    assert 0 < len(changed) <= 15, out.stdout


def test_four_ranks_hot_swap_bitwise_whatever_ddps_buckets(tmp_path: Path) -> None:
    """With four data-parallel ranks the order of a gradient sum matters in the last bits; the job's DDP sums every
    bucket in rank order, so the first step after the swap (a new DDP, its buckets as a new DDP lays them out)
    sums as the failure-free run did."""
    clean = launch(tmp_path / "clean", nodes=4)
    rep = launch(tmp_path / "kill", nodes=4, inject=["kill:node=2@step=9,phase=backward"])
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


def test_owner_and_replica_lost_falls_back_to_the_persistent_tier_bitwise(tmp_path: Path) -> None:
    clean = launch(tmp_path / "clean", nodes=4, spares=2)
    rep = launch(tmp_path / "kill", nodes=4, spares=2, persist_every=4, persist_dir=str(tmp_path / "ckpt"),
                 inject=["kill:node=0,1@step=10,phase=backward"])
    assert rep["state"] == "done", rep["state"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "persistent" and rec["resumed_step"] in (4, 8), rec
    assert rep["final_state_sha256"] == clean["final_state_sha256"]



@pytest.mark.parametrize("body, says", [
    ('print("a script that forgot phoenixft.init()")\n', "ended without calling phoenixft.init()"),
    ('import phoenixft\nraise ValueError("a bad config value")\n', "ValueError: a bad config value"),
    ('import phoenixft\njob = phoenixft.init()\nprint({}["missing"])\n', "KeyError"),
])
def test_a_script_that_cannot_train_ends_the_run_saying_why(tmp_path: Path, body: str, says: str) -> None:
    script = tmp_path / "broken.py"
    script.write_text(body)
    rep = launch(tmp_path / "run", script=script, spares=0)
    assert rep["state"].startswith("failed"), rep["state"]
    assert says in json.dumps(rep), rep.get("error")
    assert "broken.py" in json.dumps(rep)
