"""The report's attribution of faults to recoveries (report.build_report), on a store written the way
the coordinator and the workers write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, sealed
from phoenixft.observe.report import build_report


class DictStore:
    """The job's keys as its processes write them: sealed with the run key (controlplane.sealed), but for the
    topologies and the final state (signed apart)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        sealed.bind("t" * 32, "rid")

    def set(self, key: str, value: Any) -> None:
        if key.startswith("topo/") and isinstance(value, dict):  # a whole topology: the fields a test leaves out
            value = {"epoch": int(key.split("/")[1]), "workers_per_node": 1, "replicas": 1, "resume_step": 0, **value}
        raw = value if isinstance(value, str) else json.dumps(value)
        self.kv[key] = raw.encode() if key.startswith(("topo/", keys.FINAL)) else sealed.seal(key, raw)

    def check(self, ks: list[str]) -> bool:
        return all(k in self.kv for k in ks)

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def get_nowait(self, key: str) -> bytes | None:
        return self.kv.get(key)

    def exists_many(self, ks: list[str], serializable: bool = False) -> list[bool]:
        return [k in self.kv for k in ks]

    def multi_get(self, ks: list[str]) -> list[bytes]:
        return [self.kv[k] for k in ks]

    def multi_get_nowait(self, ks: list[str]) -> list[bytes | None]:
        return [self.kv.get(k) for k in ks]


def _job(tmp: Path, faults: list[dict[str, Any]], recoveries: list[dict[str, Any]], nodes: int = 3) -> dict[str, Any]:
    cfg = RunConfig(nodes=nodes, spares=2, steps=8, inject=[f["spec"] for f in faults])
    st = DictStore()
    for s in range(1, 9):
        st.set(keys.step(s), {"step": s, "loss": 1.0 / s, "dt": 0.1})
    st.set(keys.PROGRESS, "8")
    st.set(keys.FINAL, {"step": 8, "sha256": "ab"})
    for i, f in enumerate(faults):
        st.set(keys.fault(i), {"index": i, "kind": "fault", **f})
    names = [f"n{i}" for i in range(nodes)]
    for e, r in enumerate(recoveries, start=1):
        st.set(keys.recovery(e), {"t_start": r["t"], "t_first_report": r["t"], "t_decided": r["t"] + 0.01,
                                  "dead": [], "fenced": [], "unresponsive": [], "restarted": [], "promoted": [],
                                  "resume_step": 3, "max_committed": 3, "class": "permanent", "action": "hot-swap",
                                  **{k: v for k, v in r.items() if k != "t"}})
        st.set(keys.topo(e), {"nodes": names})
        for n in names:
            st.set(keys.join(e, f"{n}.0"), {"t": r["t"] + 0.02, "rank": names.index(n), "reconfigure_s": 0.01,
                                            "invariants": {k: True for k in ("I1", "I2", "I3", "I4")}})
        st.set(keys.first_step(e), {"t": r["t"] + 0.05})
    return build_report(st, cfg, "done", tmp, "rid")


def test_a_kill_and_a_crash_handled_in_one_recovery_are_both_its_own(tmp_path: Path) -> None:
    rep = _job(tmp_path, [{"spec": "kill:node=1@step=3", "node": "n1", "t": 100.0},
                {"spec": "crash:node=2@step=3", "node": "n2", "t": 100.2}],
               [{"t": 100.5, "dead": ["n1"], "restarted": ["n2.0"]}])
    (r,) = rep["recoveries"]
    assert r["faults"] == ["kill:node=1@step=3", "crash:node=2@step=3"]
    assert r["fault"] == "crash:node=2@step=3"  # the latest of them
    assert abs(r["detect_s"] - 0.5) < 1e-9 and abs(r["recovery_s"] - 0.55) < 1e-9  # from the first of them


def test_each_recovery_takes_the_fault_of_the_node_it_found_dead(tmp_path: Path) -> None:
    # a hang noticed late: the kill after it is recovered first, then the hang, each with its own fault
    rep = _job(tmp_path, [{"spec": "hang:node=2@step=2", "node": "n2", "t": 50.0},
                {"spec": "kill:node=1@step=3", "node": "n1", "t": 51.0}],
               [{"t": 51.1, "dead": ["n1"]}, {"t": 60.0, "dead": [], "unresponsive": ["n2"]}])
    first, second = rep["recoveries"]
    assert first["faults"] == ["kill:node=1@step=3"] and second["faults"] == ["hang:node=2@step=2"]
    assert abs(second["detect_s"] - 10.0) < 1e-9


def test_a_fault_on_no_lost_node_goes_to_the_next_recovery(tmp_path: Path) -> None:
    # a NaN loses no node: the recovery after it answers it (the latest fault before its first report)
    rep = _job(tmp_path, [{"spec": "nan@step=2", "node": "n0", "t": 10.0},
                {"spec": "kill:coordinator@step=2", "node": "n0", "t": 10.1}],
               [{"t": 10.3, "class": "transient", "action": "rollback"}])
    (r,) = rep["recoveries"]
    assert r["faults"] == ["nan@step=2"] and r["fault"] == "nan@step=2"


def test_a_resumed_run_that_failed_before_its_first_step_reports_the_checkpoint_step(tmp_path: Path) -> None:
    """Resumed from step 6, the run failed in step 7: it holds step 6, not 0 ("failed: 0 steps" said the
    state was the model as initialised)."""
    cfg = RunConfig(nodes=2, spares=0, steps=12)
    st = DictStore()
    st.set(keys.topo(0), {"epoch": 0, "nodes": ["n0", "n1"], "resume_step": 6})
    rep = build_report(st, cfg, "failed", tmp_path, "rid")
    assert rep["steps_completed"] == 6 and rep["loss"] == [] and rep["first_step"] is None
    fresh = DictStore()  # a run that failed before its first step, from the start
    fresh.set(keys.topo(0), {"epoch": 0, "nodes": ["n0", "n1"], "resume_step": 0})
    assert build_report(fresh, cfg, "failed", tmp_path, "rid")["steps_completed"] == 0


class CountingStore(DictStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def check(self, ks: list[str]) -> bool:
        self.calls += 1
        return super().check(ks)

    def get(self, key: str) -> bytes:
        self.calls += 1
        return super().get(key)

    def multi_get(self, ks: list[str]) -> list[bytes]:
        self.calls += 1
        return super().multi_get(ks)


def test_the_report_reads_the_steps_that_ran_in_batches(tmp_path: Path) -> None:
    """An interrupted `--steps 99999999999` run: the report looked at every step of --steps, one round
    trip each, with signals held (SIGTERM ignored: the demo it ended could not be stopped). It reads
    the steps that ran (after the resumed checkpoint, up to the progress), a batch per round trip."""
    cfg = RunConfig(nodes=2, spares=0, steps=2_000_000)  # (the old loop: 2M round trips here)
    st = CountingStore()
    st.set(keys.topo(0), {"epoch": 0, "nodes": ["n0", "n1"], "resume_step": 100})
    for s in range(101, 1301):
        if s != 700:  # a record that is missing (its batch is read key by key)
            st.set(keys.step(s), {"step": s, "loss": float(s), "dt": 0.5})
    st.set(keys.step(1400), {"step": 1400, "loss": 0.0, "dt": 0.5})  # beyond the progress: a rolled-back step
    st.set(keys.PROGRESS, "1300")
    rep = build_report(st, cfg, "failed: interrupted", tmp_path, "rid")
    assert rep["loss"] == [float(s) for s in range(101, 1301) if s != 700]
    assert st.calls < 1200, st.calls  # 3 batches, one of them (512 keys) key by key


def test_the_recovery_that_ended_the_run_is_in_the_recoveries(tmp_path: Path, capsys: Any) -> None:
    """Both nodes holding a shard's only copies were killed in epoch 0 with no persistent checkpoint: the
    run failed, and its report's recoveries were empty, as if nothing had been tried. The failed recovery
    is there, with the fault it answers, the dead nodes and why it could not recover."""
    from phoenixft.observe.display import Display

    cfg = RunConfig(nodes=3, spares=1, steps=8, inject=["kill:node=0,1@step=4,phase=backward"])
    st = DictStore()
    st.set(keys.topo(0), {"epoch": 0, "nodes": ["n0", "n1", "n2"], "resume_step": 0})
    for s in range(1, 4):
        st.set(keys.step(s), {"step": s, "loss": 1.0 / s, "dt": 0.1})
    st.set(keys.fault(0), {"index": 0, "kind": "fault", "spec": cfg.inject[0], "node": "n0", "nodes": ["n0", "n1"],
                           "t": 100.0, "step": 4})
    why = "in-memory state lost (pp0.tp0.dp0of3 at every step) and no complete persistent checkpoint"
    st.set(keys.recovery_failed(1), {"epoch": 1, "failed_epoch": 0, "t_start": 100.1, "t_first_report": 100.05,
                                     "t_decided": 100.2, "dead": ["n0", "n1"], "fenced": ["n0", "n1"],
                                     "unresponsive": [], "restarted": [], "class": "permanent",
                                     "errors": ["peer closed"], "error": why, "max_committed": 3})
    st.set(keys.RUN_ERROR, why + " (epoch 0)")
    rep = build_report(st, cfg, "failed", tmp_path, "rid")
    (r,) = rep["recoveries"]
    assert r["action"] == "failed" and r["error"] == why and r["faults"] == [cfg.inject[0]]
    assert r["dead"] == ["n0", "n1"] and r["epoch"] == 1 and r["recovery_s"] is None and r["resumed_step"] is None
    assert abs(r["detect_s"] - 0.05) < 1e-9 and r["last_committed_step"] == 3
    capsys.readouterr()
    Display(quiet=True).done(rep)
    err = capsys.readouterr().err
    assert f"not recovered {cfg.inject[0]}: lost n0, n1 in epoch 0" in err and why in err, err
    assert " recovered " not in err.replace("not recovered", ""), err


def test_a_recovery_interrupted_by_a_failure_whose_recovery_failed_is_not_called_an_invariant_failure(
        tmp_path: Path, capsys: Any) -> None:
    """n1 killed at step 4, then n0 (the only other holder of n0's shard) killed during that recovery's
    transfer: the second recovery fails. The first one said "not recovered ...: invariants FAILED: I1, I2,
    I3, I4", as if the state had broken an invariant; it was interrupted, and says so."""
    from phoenixft.observe.display import Display

    cfg = RunConfig(nodes=3, spares=2, steps=8, inject=["kill:node=1@step=4,phase=optimizer", "kill:node=0@recovery=1"])
    st = DictStore()
    st.set(keys.topo(0), {"epoch": 0, "nodes": ["n0", "n1", "n2"], "resume_step": 0})
    st.set(keys.fault(0), {"index": 0, "kind": "fault", "spec": cfg.inject[0], "node": "n1", "t": 100.0, "step": 4})
    st.set(keys.fault(1), {"index": 1, "kind": "fault", "spec": cfg.inject[1], "node": "n0", "t": 100.3})
    st.set(keys.recovery(1), {"t_start": 100.05, "t_first_report": 100.03, "t_decided": 100.1, "dead": ["n1"],
                              "fenced": ["n1"], "unresponsive": [], "restarted": [], "promoted": ["s0"],
                              "resume_step": 3, "max_committed": 3, "class": "permanent", "action": "hotswap"})
    st.set(keys.topo(1), {"nodes": ["n0", "s0", "n2"]})
    st.set(keys.join(1, "n2.0"), {"t": 100.2, "rank": 2, "reconfigure_s": 0.01,
                                  "invariants": {k: True for k in ("I1", "I2", "I3", "I4")}})
    st.set(keys.recovery_failed(2), {"epoch": 2, "failed_epoch": 1, "t_start": 100.35, "t_first_report": 100.32,
                                     "t_decided": 100.4, "dead": ["n0"], "fenced": ["n0"], "unresponsive": [],
                                     "restarted": [], "class": "permanent", "errors": [], "error": "state lost",
                                     "max_committed": 3})
    rep = build_report(st, cfg, "failed", tmp_path, "rid")
    first, failed = rep["recoveries"]
    assert first["completed_in_epoch"] is None and failed["action"] == "failed"
    assert first["faults"] == [cfg.inject[0]] and failed["faults"] == [cfg.inject[1]]
    capsys.readouterr()
    Display(quiet=True).done(rep)
    err = capsys.readouterr().err
    assert "FAILED" not in err and "another failure interrupted it, and its recovery failed" in err, err
    assert f"not recovered {cfg.inject[0]}: hotswap" in err, err
