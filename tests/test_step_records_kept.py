"""The store holds a bounded window of step records whatever the run's length (observe/live.py `prune`), and
the report still has every step's last execution (from metrics.jsonl where the store no longer holds it).

A simulated run drives the launcher's LiveMetrics as the monitor does (a step record and the progress per
step, the recovery's events arriving late, recoveries that roll back one step or, from the persistent tier,
many), over thousands of generated schedules; one case deletes while a recovery begins and replays."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_hotswap, run

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, sealed
from phoenixft.distributed.topology import Topology
from phoenixft.errors import UserError
from phoenixft.observe.live import LiveMetrics
from phoenixft.observe.report import _run_steps


class _Store:
    """The job's values as it writes them (sealed with the run key; topologies as they are), with deletes."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.on_delete: Any = None
        sealed.bind("t" * 32, "rid")

    def put(self, key: str, value: Any) -> None:
        text = json.dumps(value) if not isinstance(value, str) else value
        self.kv[key] = text.encode() if key.startswith("topo/") else sealed.seal(key, text)

    def check(self, ks: list[str]) -> bool:
        return all(k in self.kv for k in ks)

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def get_nowait(self, key: str, serializable: bool = True) -> bytes | None:
        return self.kv.get(key)

    def multi_get(self, ks: list[str]) -> list[bytes]:
        return [self.kv[k] for k in ks]

    def delete_key(self, key: str) -> bool:
        if self.on_delete is not None:
            self.on_delete(key)
        return self.kv.pop(key, None) is not None

    def step_keys(self) -> int:
        return sum(1 for k in self.kv if k.startswith("step/"))


def _topo(epoch: int, resume: int) -> str:
    return Topology(epoch=epoch, nodes=["n0", "n1"], workers_per_node=1, replicas=1, resume_step=resume).to_json()


class _Run:
    """A job as the store sees it: rank 0 writes `step/<s>` and `progress` per step; a recovery publishes a
    new epoch (its topology, then `epoch`) resuming from some step; the launcher hears of it later."""

    def __init__(self, st: _Store, live: LiveMetrics) -> None:
        self.st, self.live = st, live
        self.epoch, self.progress, self.t = 0, 0, 100.0
        self.last: dict[int, dict[str, Any]] = {}  # each step's last execution (what the report must show)
        self.late: list[dict[str, Any]] = []  # events the launcher has not read yet
        st.put(keys.topo(0), _topo(0, 0))
        st.put(keys.EPOCH, "0")

    def step(self) -> None:
        s = self.progress + 1
        self.t += 0.01
        rec = {"step": s, "loss": 1.0 / s + self.epoch, "dt": 0.01, "t_end": self.t, "epoch": self.epoch}
        self.st.put(keys.step(s), rec)
        self.st.put(keys.PROGRESS, str(s))
        self.progress, self.last[s] = s, rec

    def recover(self, resume: int) -> None:
        self.epoch += 1
        self.st.put(keys.topo(self.epoch), _topo(self.epoch, resume))
        self.st.put(keys.EPOCH, str(self.epoch))
        self.late.append({"kind": "recovery_planned", "epoch": self.epoch, "resume_step": resume, "t": self.t})
        self.progress = resume

    def look(self, now: float) -> None:
        """The launcher's look: the events it has by now, the records up to the progress, the deletes."""
        for ev in self.late:
            self.live.event(ev)
        self.late = []
        self.live.advance(self.st, self.progress)  # type: ignore[arg-type]
        self.live.prune(self.st, now=now)  # type: ignore[arg-type]


def _live(tmp: Path, keep: int) -> LiveMetrics:
    cfg = RunConfig(nodes=2, steps=10**6, spike_window=4, store_step_records=keep)
    return LiveMetrics(cfg, tmp, "127.0.0.1", 99.0, info=lambda _: None)


def _check_report(run: _Run, live: LiveMetrics) -> None:
    seen = {"steps": live.history(), "steps_from": live.pruned + 1}
    got = _run_steps(run.st, 1, run.progress, seen)  # type: ignore[arg-type]
    assert [r["step"] for r in got] == list(range(1, run.progress + 1))
    assert got == [run.last[s] for s in range(1, run.progress + 1)]  # each step's last execution


def test_step_records_stay_within_the_window_over_generated_runs(tmp_path: Path) -> None:
    """600 generated runs of up to 250 steps: recoveries rolling back 0-1 steps (in memory) or up to 60 (the
    persistent tier), the launcher hearing of each 0-5 looks later and looking after half the steps. After a
    look that heard of every recovery, the store holds the window and the rolled-back steps not yet replayed,
    nothing more; the launcher always reaches the progress; the report has every step's last execution."""
    for case in range(600):
        rng = random.Random(case)
        keep = rng.choice([6, 7, 10, 33])
        d = tmp_path / str(case)
        d.mkdir()
        st, live = _Store(), _live(d, keep)
        run = _Run(st, live)
        now, top, delay, looks = 0.0, 0, 0, 0
        held: list[dict[str, Any]] = []  # recovery events the launcher hears of some looks later
        for _ in range(rng.randint(50, 250)):
            run.step()
            top = max(top, run.progress)
            if rng.random() < 0.02 and run.progress > 2:
                back = rng.choice([0, 1, 1, rng.randint(2, min(60, run.progress - 1))])
                run.recover(run.progress - back)
                held, run.late, delay = held + run.late, [], rng.randint(0, 5)
            if rng.random() < 0.5:
                continue
            if delay > 0:
                delay -= 1
            else:
                run.late, held = held + run.late, []
            now += 1.0
            run.look(now)
            looks += 1
            if not held:  # (every recovery heard of: the window, and the steps past the progress not replayed yet)
                assert st.step_keys() <= keep + (top - run.progress), (case, st.step_keys(), keep, top, run.progress)
        run.late, held = held + run.late, []
        run.look(now + 1.0)
        assert live.next == run.progress + 1, case
        assert st.step_keys() <= keep + (top - run.progress), case
        _check_report(run, live)
        live.close()


def test_a_record_replayed_and_deleted_as_its_epoch_began_is_passed_over(tmp_path: Path) -> None:
    """A recovery from the persistent tier is published while the launcher deletes, and its epoch replays
    steps 21..31 before their deletion. The launcher finds out (the epoch changed under the deletes), passes
    those steps over once the new epoch is past them (their earlier execution stays in metrics.jsonl), and
    records every later step: it never waits for a record that will not come."""
    st, live = _Store(), _live(tmp_path, 6)
    run = _Run(st, live)
    for _ in range(40):
        run.step()
    live.advance(st, 40)  # type: ignore[arg-type]
    deleted: list[str] = []

    def recovery_during(key: str) -> None:
        deleted.append(key)
        if len(deleted) == 5:  # epoch 1 resumes from step 20 and replays 21..31 meanwhile
            run.recover(20)
            for _ in range(11):
                run.step()

    st.on_delete = recovery_during
    assert live.prune(st, now=1.0) == 34  # type: ignore[arg-type]
    st.on_delete = None
    assert not [s for s in range(1, 35) if keys.step(s) in st.kv] and sorted(live.raced) == list(range(21, 35))
    for _ in range(9):  # epoch 1 goes on: 32..40
        run.step()
    run.look(2.0)
    assert live.next == 41
    got = {r["step"]: r for r in _run_steps(st, 1, 40, {"steps": live.history(),  # type: ignore[arg-type]
                                                        "steps_from": live.pruned + 1})}
    assert sorted(got) == list(range(1, 41))
    assert [got[s]["epoch"] for s in range(1, 41)] == [0] * 31 + [1] * 9
    live.close()


def test_the_window_must_hold_the_spike_guard_window() -> None:
    RunConfig(spike_window=4, store_step_records=6).validate()
    with pytest.raises(UserError, match=r"--store-step-records.*at least --spike-window \+ 2"):
        RunConfig(store_step_records=10).validate()  # (--spike-window 32 by default)


STEPS, KILL, KEPT = 60, 30, 6


def test_a_run_many_times_the_window_long_keeps_every_step_and_its_hash(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """A run ten times as long as the store's window of step records (--store-step-records 6) with a node
    killed halfway: the hot-swap reads what it needs from the window (the spike guard's steps before its resume
    step), the run ends bitwise identical to a failure-free one, the store held only the window at the end,
    and the report and metrics.jsonl have every step (the deleted ones from the launcher's copy)."""
    ref = reference(nodes=2, steps=STEPS, spike_window=4)
    rep = run(tmp_path, nodes=2, spares=1, steps=STEPS, spike_window=4, store_step_records=KEPT,
              inject=[f"kill:node=1@step={KILL},phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert_one_hotswap(rep, ["n1"], KILL)
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["first_step"] == 1 and rep["loss"] == ref["loss"] and len(rep["loss"]) == STEPS
    # the store kept the newest steps only (a deletion at most every PRUNE_EVERY_S: a few steps more)
    assert STEPS - 4 * KEPT < rep["store"]["step_records_from"] <= STEPS - KEPT + 1, rep["store"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in lines] == ref["loss"]
