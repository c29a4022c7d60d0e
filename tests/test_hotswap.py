"""Hot-swap: real SIGKILLs of whole nodes, recovery inside the running job, bitwise-equal results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_hotswap, processes_with, run

from phoenixft.controlplane import sealed


@pytest.mark.parametrize(
    "phase,node,transport",  # (auto: the nodes of a local run share a host, so replicas go through shared memory)
    [("forward", 0, "auto"), ("backward", 1, "auto"), ("replicate", 1, "auto"), ("optimizer", 0, "auto"),
     ("optimizer", 1, "auto"), ("replicate", 1, "tcp"), ("backward", 0, "tcp")],
)
def test_kill_in_every_phase_is_bitwise_invisible(tmp_path: Path, reference, phase: str, node: int,  # type: ignore[no-untyped-def]
                                                  transport: str) -> None:
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=1, steps=12, inject=[f"kill:node={node}@step=6,phase={phase}"],
              replica_transport=transport)
    shm = [json.loads(x).get("protect_shm_bytes") for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(b > 0 for b in shm[1:]) if transport == "auto" else not any(shm), shm
    assert rep["state"] == "done", rep.get("error")
    assert rep["steps_completed"] == 12
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["loss"] == ref["loss"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["class"] == "permanent"
    assert rec["dead"] == [f"n{node}"] and rec["promoted"] == ["s0"]
    assert rec["lost_steps"] <= 1
    assert rec["resumed_step"] in (4, 5, 6)
    assert all(rec["invariants"].values()), rec["invariants"]
    assert rec["detect_s"] >= 0 and rec["recovery_s"] > rec["detect_s"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kill_in_the_first_step_resumes_from_the_initial_state(tmp_path: Path, reference, precision: str) -> None:  # type: ignore[no-untyped-def]
    """A node lost in step 1, before the first replication can have landed: its shard of step 0 is kept
    by its ring peer from the start (the model as built under the seed, a zero optimizer state), so the
    spare takes over from step 0. Without that, the run is lost ("in-memory state lost") 2 times in 3."""
    ref = reference(nodes=2, steps=4, precision=precision)
    # wait=0: the kill comes as soon as step 1 starts (the suite's default would hold it until the spare
    # is warm, and the replication of step 0 lands meanwhile), so there may be no warm spare yet: a
    # shrink is as good an answer as a hot-swap, but the run must go on from step 0
    rep = run(tmp_path, nodes=2, spares=1, steps=4, precision=precision,
              inject=["kill:node=1@step=1,phase=forward,wait=0"])
    assert rep["state"] == "done", rep.get("error")
    rec = rep["recoveries"][0]
    assert rec["action"] in ("hotswap", "shrink") and rec["resumed_step"] == 0, rec
    assert all(all(r["invariants"].values()) for r in rep["recoveries"])
    if rec["action"] == "hotswap":
        assert rep["final_state_sha256"] == ref["final_state_sha256"]
    else:
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(rep["loss"], ref["loss"], strict=True))


@pytest.mark.serial  # (wall-clock times: run alone, not beside another test: `make test`)
def test_four_node_hotswap_under_two_seconds(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=1, steps=12, inject=["kill:node=2@step=6,phase=backward"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["recovery_s"] < 2.0, rec


def test_two_faults_two_spares(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=2, steps=12,
              inject=["kill:node=1@step=4,phase=backward", "kill:node=1@step=9,phase=optimizer"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert [r["promoted"] for r in rep["recoveries"]] == [["s0"], ["s1"]]
    assert [r["fault"] for r in rep["recoveries"]] == [f["spec"] for f in rep["faults"]]


def test_corrupt_replica_is_never_loaded(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=10)
    # with --replicas 2, nodes 1 and 2 keep node 0's replicas. The copy node 1 received during step 5
    # (the state after step 4: the newest, the one recovery would use) is corrupted at rest. Node 0
    # then dies inside its optimizer step 5, after every rank committed step 4. Loading node 1's copy
    # would change the final hash; its checksum rejects it and node 2's copy of the same step is used.
    rep = run(tmp_path, nodes=4, spares=1, replicas=2, steps=10,
              inject=["corrupt:node=1@step=5", "kill:node=0@step=5,phase=optimizer"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert ["pp0.tp0.dp0of4", 4] in rec["replicas_rejected"], rec
    assert rec["resumed_step"] == 4 and rec["lost_steps"] == 0, rec
    assert all(rec["invariants"].values())


def test_a_corruption_at_rest_fires_once_even_when_its_step_is_replayed(tmp_path: Path, reference: Any) -> None:
    """The crash restarts rank 3 in step 4, so the replication of step 3 is repeated: the corruption
    must not hit the repeated copy (it did: a fault fires once per run), and it is reported like
    every other fault (the live line, the report's `faults`)."""
    ref = reference(nodes=4, steps=10)  # (10 steps: the reference run of the test above)
    spec = "corrupt:node=2@step=4"
    rep = run(tmp_path, nodes=4, spares=1, steps=10,
              inject=[spec, "crash:rank=3@step=4,phase=optimizer", "kill:node=1@step=5,phase=forward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    hits = [e for e in events if e.get("kind") == "corrupted_replica" and e.get("spec") == spec]
    assert len(hits) == 1, hits  # replicas 1: node 2 holds one shard's replica
    (rec,) = [f for f in rep["faults"] if f["spec"] == spec]
    assert rec["fault"] == "corrupt" and rec["phase"] == "at rest" and rec["replicas_of_step"] == 3, rec
    assert rep["faults_not_fired"] == []


def test_both_halves_corrupt_fails_clearly(tmp_path: Path) -> None:
    # without scrubbing (which would repair the first corrupted copy before the kill: tests/test_scrub.py)
    rep = run(tmp_path, nodes=2, spares=1, steps=10, scrub_every=0,
              inject=["corrupt:node=1@step=4", "corrupt:node=1@step=5", "kill:node=0@step=5,phase=optimizer"])
    assert rep["state"] == "failed"
    assert "lost shards: pp0.tp0.dp0of2" in rep["error"], rep["error"]
    assert "rejected by checksum" in rep["error"]


def test_no_process_left_after_fault(tmp_path: Path) -> None:
    rep = run(tmp_path, nodes=2, workers_per_node=2, spares=1, steps=6, inject=["kill:node=0@step=3,phase=forward"])
    assert rep["state"] == "done"
    assert_one_hotswap(rep, ["n0"], 3)  # the kill fired and bit: processes were killed and a spare took over
    assert processes_with(rep["run_id"]) == []


class _HandJob:
    """A job started by hand on 127.0.0.1, `tiny`, 2 nodes (agents `a`, `b`) + 1 spare (`sp`), each
    `phoenixft` process in its own session with its log in tmp_path/NAME.log; `close` ends them all
    (the head first, by SIGTERM, when `graceful`; then whatever is left by SIGKILL of its group)."""

    def __init__(self, tmp_path: Path, steps: int, pace_s: float = 0.1) -> None:
        from conftest import free_port

        self.tmp, self.steps = tmp_path, steps
        self.port, self.env = free_port(), dict(os.environ, PHOENIXFT_TOKEN="q7Vx2-Lm9_Zr4Tb8Kc1Nw6Hd3Pj5Sf0Y")
        # the job trains tests/user_workload.py's paced workload: its steps last `pace_s` at least, asleep (the
        # tests wait for events between steps; a job training flat out would burn the CPU the suite needs)
        tests_dir = str(Path(__file__).parent)
        self.env.update(PHOENIXFT_TEST_PACE_S=str(pace_s),
                        PYTHONPATH=os.pathsep.join(p for p in (tests_dir, self.env.get("PYTHONPATH")) if p))
        self.addr = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.tmp / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "phoenixft", *args], stdout=out,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, env=self.env)

    @staticmethod
    def wait_for(what: str, cond: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (v := cond()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)
        return v

    def begin(self) -> Any:
        """Head, agents and spare started; the store client once the job is whole at step 3."""
        from phoenixft.distributed.comm import connect_store

        self.start("head", "coordinator", "--host", "127.0.0.1", "--port", str(self.port), "--nodes", "2",
                   "--spares", "1", "--workers-per-node", "1", "--steps", str(self.steps),
                   "--workload", "user_workload:paced_workload",
                   "--failure-timeout", "2", "--run-dir", str(self.tmp / "run"), "--quiet", "--timeout", "240",
                   "--join-timeout", "90")
        for name, extra in (("a", []), ("b", []), ("sp", ["--spare"])):
            self.start(name, "agent", "--coordinator", self.addr, "--node", name, "--workers", "1", *extra)
        store = self.wait_for("the store", lambda: _connected(connect_store, self.addr), 60)
        self.wait_for("a whole job at step 3", lambda: store.check(["job/whole"]) and store.check(["progress"])
                      and int(sealed.peel(store.get("progress")) or 0) >= 3, 120)
        return store

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)

    def close(self, graceful: bool = False) -> None:
        head = self.procs.get("head")
        if graceful and head is not None and head.poll() is None:
            head.send_signal(signal.SIGTERM)  # the head ends the run; the agents follow
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=60)
        for p in self.procs.values():
            try:
                p.wait(timeout=30 if graceful else 0.1)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def test_a_spare_that_died_while_idle_is_never_promoted(tmp_path: Path) -> None:
    """Hand-started job (coordinator + agents on 127.0.0.1): the only spare's agent is SIGKILLed while
    it waits, then an active node. The coordinator watches idle spares' heartbeats too: the job is no
    longer whole once the spare is gone, and the node's loss shrinks the job at once. It must not
    promote the dead spare (a `hotswap` into a corpse), wait out --failure-timeout for it to answer,
    fence it and only then shrink, in a second recovery (a mesh, which cannot shrink, would be lost)."""
    job = _HandJob(tmp_path, steps=60, pace_s=0.2)  # (the spare's loss is noticed 2-3 s after step 3: by step 20)
    try:
        store = job.begin()
        job.kill("sp")
        job.wait_for("the job to be not whole without its spare", lambda: not store.check(["job/whole"]), 15)
        members = json.loads(sealed.peel(store.get("members")) or b"")
        victim = next(n for n, m in members.items() if m["name"] == "b")
        assert int(sealed.peel(store.get("progress")) or 0) < 45, "too late: make the run longer"
        job.kill("b")
        assert job.procs["head"].wait(timeout=240) == 0, (tmp_path / "head.log").read_text()[-3000:]
        rep = json.loads((tmp_path / "run" / "report.json").read_text())
        assert rep["state"] == "done", rep.get("error")
        (rec,) = rep["recoveries"]  # one recovery: no detour through the dead spare
        assert rec["action"] == "shrink" and rec["dead"] == [victim] and rec["promoted"] == [], rec
        assert job.procs["a"].wait(timeout=30) == 0
    finally:
        job.close()


def _connected(connect_store: Any, addr: str) -> Any:
    import socket

    host, port = addr.rsplit(":", 1)
    try:  # a plain connect first: a store client refused while the head starts backs off for seconds
        socket.create_connection((host, int(port)), timeout=1.0).close()
        s = connect_store(addr, 5.0)
        return s if s.check(["config"]) else None
    except Exception:  # noqa: BLE001 - the head is still starting
        return None


def test_a_host_that_rejoins_frees_what_its_killed_node_left(tmp_path: Path) -> None:
    """Hand-started job on one machine (coordinator + agents on 127.0.0.1): node b's agent is SIGKILLed
    (its node's shared memory stays: nobody on another host could free it), the job hot-swaps it, and
    the host comes back as a spare of the same run. The new agent frees the fenced node's segments at
    once; otherwise they would stay in /dev/shm for the whole run (the sweep spares a live run's memory), a
    snapshot's worth of host memory lost on the repaired host."""
    from phoenixft.protect import shm
    job, run_id = _HandJob(tmp_path, steps=2000), ""
    try:
        store = job.begin()
        run_id = store.get("run/id").decode()
        victim = next(n for n, m in json.loads(sealed.peel(store.get("members")) or b"").items() if m["name"] == "b")
        assert shm.segments(run_id, victim), "the node keeps no shared memory: the test proves nothing"
        job.kill("b")
        job.wait_for("the hot-swap", lambda: store.check(["recovery/1"]), 60)
        job.start("b-back", "agent", "--coordinator", job.addr, "--node", "b-back", "--workers", "1", "--spare")
        job.wait_for("the host's return", lambda: "admitted" in (tmp_path / "b-back.log").read_text(), 60)
        job.wait_for("its node to be warm", lambda: store.check(["ready/s1.0"]), 60)
        assert not store.check(["run/state"]), "the run ended: the test proves nothing"
        assert shm.segments(run_id, victim) == [], "the killed node's memory outlived its return"
        assert "of fenced node" in (tmp_path / "b-back.log").read_text()
    finally:
        job.close(graceful=True)
        if run_id:  # (what a failed run of this test left: the run is over)
            shm.unlink_segments(run_id)


def test_a_stateless_optimizer_of_the_workloads_own_is_protected(
        tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """The workload's own optimizer with no state (plain SGD): the protected payload of fp32 parameters has
    no row, and viewing it as (0, -1) failed; every node's worker crashed in its epoch-0 join and was
    restarted in place (a recovery of a failure that was none, tracebacks in every log)."""
    wl = "user_workload:stateless_optimizer_workload"
    ref = reference(nodes=2, steps=8, workload=wl)
    rep = run(tmp_path, nodes=2, spares=1, steps=8, workload=wl, inject=["kill:node=1@step=5"])
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert (rec["action"], rec["dead"], rec["promoted"], rec["restarted"]) == ("hotswap", ["n1"], ["s0"], [])
    assert not any("Traceback" in f.read_text() for f in (tmp_path / "logs").glob("*.log"))
