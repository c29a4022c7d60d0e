"""Failure classes beyond a clean SIGKILL: crashes, hangs, multiple and cascading failures, NaN."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_DEFAULTS, processes_with, run


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


def _worker_of(node: str, launcher: int) -> int | None:
    """The PID of the (first) worker of `node` in the local run launched by `launcher`: the agent's child."""
    agents = [p for p in processes_with(f"--parent-pid {launcher}")
              if f"--node {node} " in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
    for p in agents:
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid in agents:
            return p
    return None


def _await_progress(run_dir: Path, step: int, deadline: float) -> None:
    """Wait (until `deadline`, monotonic) for the local run in `run_dir` to have completed `step` steps."""
    import time

    from phoenixft.controlplane import keys, sealed
    from phoenixft.distributed.comm import connect_store

    store = None
    while time.monotonic() < deadline and store is None:
        try:
            store = connect_store(f"127.0.0.1:{int((run_dir / 'coordinator.port').read_text())}", 5.0)
        except (OSError, ValueError, RuntimeError):
            time.sleep(0.05)
    assert store is not None
    while time.monotonic() < deadline and not (store.check([keys.PROGRESS])
                                               and int(sealed.peel(store.get(keys.PROGRESS)) or 0) >= step):
        time.sleep(0.01)


def _proc_state(pid: int) -> str | None:
    """The scheduler state letter of `pid` in /proc (R, S, T, Z, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _sigstop(pid: int, seen: dict[str, object]) -> None:
    """SIGSTOP `pid` and record in `seen` that the kernel stopped it: its /proc state read 'T' (stopped by a
    signal) within 5 s, with the time; a signal that did not land leaves `seen` without them."""
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        if _proc_state(pid) == "T":
            seen["state"], seen["stopped"] = "T", time.monotonic()
            return
        time.sleep(0.005)


def test_a_stopped_worker_whose_agent_runs_on_is_fenced_within_the_failure_timeout(
        tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """One worker SIGSTOPped (a debugger, a hang) while its agent runs on: the agent's heartbeat kept vouching
    for the node, so nothing but the peers' collective timeout (max(60 s, 6 x --failure-timeout)) found it and
    the job stood still for a minute. The agent now looks at its workers' scheduler state: the node is fenced
    after about two --failure-timeouts, the spare takes over, and the stopped worker, let go again, changes
    nothing."""
    import signal
    import threading
    import time


    ref = reference(nodes=2, steps=40)
    seen: dict[str, Any] = {}

    def stop_n1_mid_run() -> None:
        try:
            deadline = time.monotonic() + 90
            _await_progress(tmp_path, 4, deadline)
            pid = _worker_of("n1", os.getpid())
            assert pid is not None, "no worker of n1 found"
            seen["pid"] = pid
            _sigstop(pid, seen)
            while time.monotonic() < deadline and _proc_state(pid) not in (None, "Z"):
                time.sleep(0.02)
            seen["gone"] = time.monotonic()  # fenced: its node's process group was killed
            try:
                os.kill(pid, signal.SIGCONT)  # (a no-op now: it must change nothing)
            except ProcessLookupError:
                pass
        except BaseException as e:  # (a thread's failure is otherwise silent: the test asserts on `seen`)
            seen["error"] = repr(e)

    t = threading.Thread(target=stop_n1_mid_run, daemon=True)
    t.start()
    rep = run(tmp_path, nodes=2, spares=1, steps=40, failure_timeout=2.0, timeout=120.0)
    t.join(timeout=10)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"]
    assert "error" not in seen, seen
    assert seen.get("state") == "T", f"the SIGSTOP never showed in /proc: {seen}"  # the worker was stopped
    assert "stopped" in seen and "gone" in seen, seen
    assert seen["gone"] - seen["stopped"] < 15.0, f"fenced {seen['gone'] - seen['stopped']:.1f}s after its stop"
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["dead"] == ["n1"] and rec["promoted"] == ["s0"], rec
    assert rec["fenced"] == ["n1"] and rec["lost_steps"] <= 1, rec
    assert "stopped (SIGSTOP) for longer than --failure-timeout=2s" in (tmp_path / "logs" / "n1.log").read_text()


def test_a_stopped_agent_whose_workers_run_on_is_not_a_recovery_every_poll(
        tmp_path: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The agent of n1 SIGSTOPped for 5 s (starved, Ctrl-Z'd by hand), its worker training on: its heartbeat went
    stale, and each recovery found the node's worker answering (not dead: a reconfigure) and left its staleness
    as it was, so the next poll, 0.25 s later, started another: 18 spurious recoveries in the report for 8 s.
    A node whose workers answered a gather is not judged stale again before another --failure-timeout."""
    import signal
    import threading
    import time

    _user_workloads(monkeypatch)
    monkeypatch.setenv("PHOENIXFT_TEST_PACE_S", "0.5")  # (16 steps of at least 0.5 s: the run outlasts the stop)
    steps = 16
    ref = reference(nodes=2, steps=steps, workload="user_workload:workload")
    seen: dict[str, Any] = {}

    def stop_agent_of_n1() -> None:
        try:
            deadline = time.monotonic() + 90
            _await_progress(tmp_path, 3, deadline)
            worker = _worker_of("n1", os.getpid())
            assert worker is not None, "no worker of n1 found"
            agent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
            _sigstop(agent, seen)
            time.sleep(5.0)
            seen["ran_on"] = Path(f"/proc/{worker}").exists()  # (the run was still on when the stop ended)
            os.kill(agent, signal.SIGCONT)
        except BaseException as e:  # (a thread's failure is otherwise silent: the test asserts on `seen`)
            seen["error"] = repr(e)

    t = threading.Thread(target=stop_agent_of_n1, daemon=True)
    t.start()
    rep = run(tmp_path, nodes=2, spares=1, steps=steps, failure_timeout=2.0, timeout=120.0,
              workload="user_workload:paced_workload")
    t.join(timeout=10)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"]
    assert "error" not in seen and seen.get("state") == "T" and seen.get("ran_on"), seen  # the agent was stopped
    recs = rep["recoveries"]
    assert 1 <= len(recs) <= 3, [(r["action"], r["resumed_step"]) for r in recs]
    assert all(r["action"] == "reconfigure" and r["dead"] == [] and r["fenced"] == [] for r in recs), recs


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
    # the recovery that could not recover is in the report (with empty recoveries nothing would say what
    # the fault led to)
    (rec,) = rep["recoveries"]
    assert rec["action"] == "failed" and "lost shards: pp0.tp0.dp0of4" in rec["error"], rec
    assert rec["faults"] == ["kill:node=0,1@step=6,phase=backward,wait=60"] and rec["dead"] == ["n0", "n1"], rec
    assert rec["class"] == "permanent" and rec["recovery_s"] is None and rec["epoch"] == 1, rec


def test_spare_killed_during_its_own_transfer(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, nodes=3, spares=2, steps=12, inject=["kill:node=1@step=6", "kill:node=1@recovery=1"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    first, second = rep["recoveries"]
    assert first["promoted"] == ["s0"] and second["dead"] == ["s0"] and second["promoted"] == ["s1"]
    assert first["completed_in_epoch"] == 2 and all(second["invariants"].values())


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`phoenixft run --quiet ARGS` in this process (as `run()` runs its jobs): its exit code and what it
    wrote to stderr. A new interpreter would spend seconds importing torch and starting its zygote first."""
    from phoenixft.cli.main import main

    capsys.readouterr()
    rc = main(["run", "--quiet", *args])
    return rc, capsys.readouterr().err


def test_nan_loss_stops_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--nodes", "2", "--spares", "0", "--steps", "10", "--inject", "nan:step=5",
                   "--run-dir", str(tmp_path))
    assert rc != 0
    reasons = [ln for ln in err.splitlines() if ln.startswith("!! run failed")]
    assert len(reasons) == 1 and "loss of step 5 is nan" in reasons[0], err
    assert "Traceback" not in err


def test_exception_in_user_code_stops_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _user_workloads(monkeypatch)
    rc, err = _cli(capsys, "--nodes", "2", "--spares", "1", "--steps", "10", "--workload",
                   "user_workload:broken_workload", "--run-dir", str(tmp_path))
    assert rc != 0
    reasons = [ln for ln in err.splitlines() if ln.startswith("!! run failed")]
    assert len(reasons) == 1 and "ValueError: shapes do not line up" in reasons[0], err


def test_an_error_in_user_code_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """torch raises inside the user's model ("expected input ... to have 1 channels"): the error names the user's
    file and line (not torch's), the node's log holds the traceback with the user's frames first, the launcher's
    lines say where that log is, and the report carries the traceback."""
    import inspect

    import user_workload

    _user_workloads(monkeypatch)
    rc, err = _cli(capsys, "--nodes", "2", "--spares", "0", "--steps", "4", "--workload",
                   "user_workload:channel_mismatch_workload", "--run-dir", str(tmp_path))
    assert rc == 1, err
    src = inspect.getsourcefile(user_workload)
    line = next(i for i, x in enumerate(Path(src or "").read_text().splitlines(), 1) if "the user's line" in x)
    where = f"{src}:{line} in forward"
    rep = json.loads((tmp_path / "report.json").read_text())
    assert "to have 1 channels" in rep["error"] and f"(at {where}; traceback in the log of node" in rep["error"]
    assert rep["error_where"] == where and rep["error_log"] == str(tmp_path / "logs" / f"{rep['error_node']}.log")
    tb = rep["error_traceback"]
    assert tb.startswith("Traceback of the error in your code (most recent call last); called from phoenixft at ")
    first = tb.splitlines()[1]  # the user's frames first: the loss, then the model's forward, then torch's
    assert first.startswith(f'  File "{src}", line ') and first.endswith(", in loss"), tb
    assert f'File "{src}", line {line}, in forward' in tb and tb.endswith("to have 1 channels, but got 3 channels "
                                                                           "instead"), tb
    assert tb in Path(rep["error_log"]).read_text()
    (failed,) = [ln for ln in err.splitlines() if ln.startswith("!! run failed")]
    assert failed.endswith(f"[{rep['error_log']}]"), failed
    assert f"   error in your code at {where}; its traceback: {rep['error_log']} and the report's error_traceback" \
        in err.splitlines(), err


def test_a_replication_stuck_on_a_stopped_peer_gives_up_when_the_run_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node hung (SIGSTOP) while its replica transfer to a healthy node was in flight; the run then ended
    (--timeout, Ctrl-C): the healthy node's replication thread only looked for a recovery, and its training
    thread waited for it without looking at the run's end, so the node outlived the run until the launcher
    killed it (`teardown.killed`: "still running after the run ended"; a remote host's agent: the whole
    replication timeout). The run's end now reaches the waiting training thread as RunAborted."""
    import time
    from types import SimpleNamespace

    from phoenixft.controlplane import keys
    from phoenixft.controlplane.server import serve_store
    from phoenixft.distributed.comm import connect_store
    from phoenixft.errors import RunAborted
    from phoenixft.protect.protection import Protection
    from phoenixft.protect.replication import Replicator

    server = serve_store("127.0.0.1", 0)
    token, run_id = "q7Vx2-Lm9_Zr4Tb8Kc1Nw6Hd3Pj5Sf0Y", "run1"
    monkeypatch.setenv("PHOENIXFT_TOKEN", token)
    watcher = SimpleNamespace(flagged=lambda e: False)
    fake = SimpleNamespace(ctx=SimpleNamespace(epoch=0, run_id=run_id, watcher=watcher))
    check = Protection._flag_check(fake, connect_store(server.addr))  # type: ignore[arg-type]  # (the workers' check)
    assert check() is None

    class Stuck:  # the peer is stopped mid-transfer: its part never comes
        def protect(self, repl: Replicator, step: int) -> tuple[int, dict[int, Any]]:
            repl.wait_all([SimpleNamespace(is_completed=lambda: False)], f"replication of step {step}")
            return 0, {}

    repl = Replicator(None, lambda s: None, 1, check, timeout_s=15.0)  # type: ignore[arg-type]
    repl.configure(None, None, Stuck())  # type: ignore[arg-type]
    repl.start(1)
    time.sleep(0.3)
    from phoenixft.controlplane.signed import set_signed

    outsider = connect_store(server.addr)
    outsider.set(keys.RUN_STATE, "aborted")  # unsigned: what a stranger could write, is ignored
    time.sleep(1.2)  # (the end of the run is looked at once a second)
    assert check() is None
    set_signed(outsider, token, run_id, keys.RUN_STATE, "aborted")  # the launcher's --timeout, or Ctrl-C
    t0 = time.monotonic()
    with pytest.raises(RunAborted, match=r"run ended \(aborted\)"):
        repl.wait(1)
    assert time.monotonic() - t0 < 10
    repl.close()
    # a wait inside backward's gradient hooks (where this one sits) runs in workload code: the run's end
    # passes through it as itself, not as an "exception in the workload" that stops the run as failed
    from phoenixft.errors import Unhealable
    from phoenixft.train.trainer import Trainer

    with pytest.raises(RunAborted), Trainer._user_code(1, 0):
        raise RunAborted("run ended (aborted)")
    with pytest.raises(Unhealable), Trainer._user_code(1, 0):
        raise ValueError("a bug in the workload")


def test_the_last_node_lost_ends_the_run_saying_why(tmp_path: Path) -> None:
    """Two nodes, no spare: n1 lost (a shrink to one node), then n0. The launcher saw every node exited and
    ended the run at once ("failed: every node exited", no error, no recovery for the second kill) before
    the coordinator had decided; it now lets it decide, and the run fails saying why."""
    rep = run(tmp_path, nodes=2, spares=0, steps=6, inject=["kill:node=1@step=3,phase=backward", "kill:node=0@step=5"])
    assert rep["state"] == "failed" and "every node is lost (n0) and no spare is ready" in rep["error"], rep["state"]
    first, last = rep["recoveries"]
    assert first["action"] == "shrink" and last["action"] == "failed" and last["faults"] == ["kill:node=0@step=5"]


@pytest.mark.parametrize("workload,needle", [
    ("unreduced_loss_workload", "the workload's loss returned a torch.float32 tensor of shape "
                                f"({SUITE_DEFAULTS['micro_batch']}, 1) at step 1"),
    ("dict_loss_workload", "the workload's loss returned a dict at step 1"),
    ("bad_batch_workload", "exception in the workload at step 3 on rank"),
    ("bad_model_workload", "exception in the workload's build_model: RuntimeError: layer sizes do not match"),
    ("float64_workload", "parameter '0.weight' (and 3 more) is torch.float64: phoenixft trains float32 parameters"),
    ("frozen_workload", "the model has no trainable parameters (every parameter has requires_grad=False)"),
    ("extra_state_workload", "module '0' keeps extra state (get_extra_state), which phoenixft cannot protect"),
    ("bad_optimizer_workload", "exception in the workload's optimizer at step 5 on rank"),
])
def test_a_bug_in_the_workload_stops_the_run_with_one_line(tmp_path: Path, workload: str, needle: str) -> None:
    """A loss that is not one number, a batch function or a build_model that raises, a model phoenixft cannot
    train (float64 parameters were silently made float32 and the user's batches then failed to match them;
    no trainable parameter at all failed inside autograd; a module's extra state, no tensor, failed inside the
    flat model and the run hung to --timeout): user code, not a node failure. Outside the user-code guard
    they would fail with a traceback in every worker, restarts in place of both nodes until the run
    ended as "in-memory state lost" (the loss, the batch), or no word at all until --timeout while the nodes
    crash-looped before the join (build_model)."""
    rep = run(tmp_path, nodes=2, spares=1, steps=5, workload=f"user_workload:{workload}", timeout=90.0)
    assert rep["state"] == "failed" and needle in rep.get("error", ""), rep.get("error")
    assert rep["recoveries"] == [], rep["recoveries"]  # nothing restarted, no spare consumed
    logs = "".join(f.read_text() for f in (tmp_path / "logs").glob("*.log"))
    assert "Traceback (most recent call last)" not in logs  # (no crash of phoenixft's own)
    if "exception in" in needle:  # raised in the user's code: its traceback, the user's frames first
        assert "user_workload.py:" in rep["error"] and "user_workload.py" in rep["error_traceback"], rep
        assert "Traceback of the error in your code" in logs
    else:  # (said by phoenixft itself: no traceback to show)
        assert "error_traceback" not in rep and "Traceback" not in logs


def _user_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOENIXFT_TEST_HEAD_PID", str(os.getpid()))  # (run() launches in this process)


@pytest.mark.parametrize("workload,needle", [
    ("head_only_workload", "failed to set up: FileNotFoundError: /data/corpus.bin is not on this host (deliberate)"),
    ("nonelementwise_workload", "the workload's optimizer 'normalised-sgd' is not elementwise"),
])
def test_every_node_failing_before_the_first_step_fails_the_run_with_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: str, needle: str) -> None:
    """A workload that sets up where the run was launched but fails on every node and spare (its data is
    on the head only; a file gone since the launch): every worker printed a traceback, was restarted in
    place 3 times, then its node stopped, and the run ended "failed: every node exited" with no reason
    (as the head of a multi-host job: only at --join-timeout). The coordinator now ends it, once every
    node and spare has failed before the first step, with the first worker's error. So does a workload's
    optimizer refused by the Trainer (not elementwise)."""
    _user_workloads(monkeypatch)
    rep = run(tmp_path, nodes=2, spares=1, steps=4, workload=f"user_workload:{workload}", timeout=120.0,
              join_timeout=120.0)
    assert rep["state"] == "failed", rep["state"]
    err = rep.get("error", "")
    assert err.startswith("every node failed before the first step (n0, n1, s0)"), err
    assert needle in err, err
    assert rep["recoveries"] == [] and rep["steps_completed"] == 0
    logs = {f.name: f.read_text() for f in (tmp_path / "logs").glob("*.log")}
    assert not any("Traceback" in t for t in logs.values()), logs
    assert all(needle.split(": ")[-1] in t for n, t in logs.items() if n != "coordinator.log"), logs


def test_a_join_timeout_names_the_error_of_the_node_it_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of three hosts lack the data (n0 fails first, n1 later): the spare took n0's slot, the run
    failed at --join-timeout waiting for n1, but the error it carried was n0's (the first error of the
    run), which named a host the message did not. It carries the waited-for node's."""
    _user_workloads(monkeypatch)
    monkeypatch.setenv("PHOENIXFT_TEST_FAIL_NODES", "n0,n1")
    rep = run(tmp_path, nodes=2, spares=1, steps=4, workload="user_workload:fails_on_nodes_workload",
              timeout=60.0, join_timeout=10.0)  # (waited out: the shorter, the cheaper)
    assert rep["state"] == "failed", rep["state"]
    err = rep.get("error", "")
    assert "did not get its workers ready within --join-timeout=10s" in err, err
    assert "joined, but n1 did not get its workers ready" in err, err
    assert "n1.0 failed:" in err and "not on host n1 (deliberate)" in err and "host n0" not in err, err


def test_a_worker_failing_once_before_the_start_is_restarted_fresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference) -> None:  # type: ignore[no-untyped-def]
    """One worker failing once before the run's first epoch (a transient error): its agent restarted it
    in place, to rejoin an epoch that did not exist yet; it waited 30 s for it, crashed again, and so on
    until --join-timeout failed the run. A restart before the first epoch is a fresh start."""
    _user_workloads(monkeypatch)
    monkeypatch.setenv("PHOENIXFT_TEST_MARK", str(tmp_path / "failed-once"))
    ref = reference(nodes=2, steps=4, workload="user_workload:workload")
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=4, workload="user_workload:fails_once_workload",
              timeout=60.0, join_timeout=25.0)
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["recoveries"] == []
    logs = "".join(f.read_text() for f in (tmp_path / "run" / "logs").glob("n*.log"))
    assert logs.count("the data mount is not there yet") == 1, logs


@pytest.mark.parametrize("nodes,spares", [(1, 0), (1, 1)])
def test_a_transient_failure_before_the_start_on_every_node_at_once_is_healed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference, nodes: int, spares: int) -> None:  # type: ignore[no-untyped-def]
    """A worker failing once before the first step (its data mount came up late) on every node of the
    run at the time (here the only one, no spare): "every node failed before the first step" ended the
    run at once, as a failure no restart can heal, although its restart in place healed it. The rule
    waits for each node's failure to repeat after that restart."""
    _user_workloads(monkeypatch)
    monkeypatch.setenv("PHOENIXFT_TEST_MARK", str(tmp_path / "failed-once"))
    ref = reference(nodes=nodes, steps=4, workload="user_workload:workload")
    rep = run(tmp_path / "run", nodes=nodes, spares=spares, steps=4, workload="user_workload:fails_once_workload",
              protect="none", timeout=60.0, join_timeout=25.0)
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]


def test_a_spare_whose_worker_died_while_idle_is_still_promoted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference) -> None:  # type: ignore[no-untyped-def]
    """The spare's worker process died while it waited, after the start (its agent alive): the agent
    restarted it in place, to rejoin an epoch the spare is no member of; it crashed (ValueError: 's0' is
    not in list) 3 times, the agent gave the spare up, and the node fault that followed shrank the job
    instead of hot-swapping. An idle spare's worker restarted in place starts fresh, warm again."""
    _user_workloads(monkeypatch)
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("PHOENIXFT_TEST_MARK", str(tmp_path / "marks"))
    ref = reference(nodes=2, steps=16, workload="user_workload:workload")
    rep = run(tmp_path / "run", nodes=2, spares=1, steps=16, workload="user_workload:spare_worker_dies_workload",
              inject=["kill:node=1@step=12"], timeout=90.0)
    assert (tmp_path / "marks" / "spare-back").exists()
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert (rec["action"], rec["dead"], rec["promoted"], rec["restarted"]) == ("hotswap", ["n1"], ["s0"], [])


def test_checkpoints_the_workers_cannot_read_are_each_refused_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume from a directory the head reads but the workers' hosts do not (not mounted there): the
    coordinator must not exclude only the checkpoint refused last (the choice would go back and forth
    between the two, 6, 3, 6, 3, ..., until the run failed as stuck). Each refused one is excluded
    for the rest of the run: it fails after trying each once, saying why; no recovery reports negative
    lost steps."""
    _user_workloads(monkeypatch)
    ck = tmp_path / "ck"
    first = run(tmp_path / "first", nodes=2, spares=0, steps=6, persist_every=3, persist_dir=str(ck),
                workload="user_workload:workload")
    assert first["state"] == "done"
    rep = run(tmp_path / "resumed", nodes=2, spares=0, steps=9, resume=str(ck),
              workload="user_workload:unmounted_checkpoint_workload", timeout=90.0)
    assert rep["state"] == "failed"
    err = rep.get("error", "")
    assert "the persistent checkpoint was not installed (step 3)" in err and "not mounted on this host" in err, err
    assert "no other persistent checkpoint verifies" in err and "recoveries in a row" not in err, err
    assert len(rep["recoveries"]) <= 3, [r["resumed_step"] for r in rep["recoveries"]]
    assert all((r["lost_steps"] or 0) >= 0 for r in rep["recoveries"]), rep["recoveries"]


def test_a_split_that_raises_stops_the_run_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload's split raising (--tp 2) is user code failing, not a node failure: the run stops at once with
    one line that names the split, its traceback (the user's frames first) in the node's log and the report;
    no worker crashes, nothing restarts in place, no spare is used."""
    _user_workloads(monkeypatch)
    rep = run(tmp_path, nodes=2, spares=1, tp=2, steps=4, workload="user_workload:bad_split_workload", timeout=90.0)
    assert rep["state"] == "failed"
    assert "exception in the workload's split (stage pp=0 tp=" in rep.get("error", ""), rep.get("error")
    assert "RuntimeError: no tensor-parallel layout for this layer (deliberate bug)" in rep["error"]
    assert rep["recoveries"] == []
    logs = "".join(f.read_text() for f in (tmp_path / "logs").glob("*.log"))
    assert "Traceback (most recent call last)" not in logs  # (no crash of phoenixft's own, no restart)
    assert "Traceback of the error in your code" in logs and ", in split" in rep["error_traceback"], rep


@pytest.mark.parametrize("workload,line", [
    ("bad_factory", "--workload='user_workload:bad_factory' failed to set up: FileNotFoundError: no such dataset "
                    "(deliberate bug)"),
    ("bad_prepare_workload", "--workload='user_workload:bad_prepare_workload': its prepare() failed: "
                             "PermissionError: the cache directory is read-only (deliberate)"),
])
def test_a_workload_that_fails_to_set_up_is_one_line(tmp_path: Path, workload: str, line: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The factory, or the one-off prepare() the launcher runs, raising: one line that says where in the user's
    code, under the traceback of the user's code (no launcher traceback)."""
    _user_workloads(monkeypatch)
    rc, err = _cli(capsys, "--nodes", "2", "--steps", "3", "--workload", f"user_workload:{workload}",
                   "--run-dir", str(tmp_path))
    assert rc == 2, err
    # (the launcher's notice of another run's memory it swept at its start, when this machine had some, aside)
    own = [x for x in err.strip().splitlines() if not _SWEPT.match(x)]
    assert own[-1].startswith(f"phoenixft run: error: {line} (at ") and "user_workload.py:" in own[-1], err
    assert own[0].startswith("Traceback of the error in your code") and "Traceback (most recent" not in err, err
    assert any(x.startswith('  File "') and "user_workload.py" in x for x in own), err


_SWEPT = re.compile(r"removed \d+ orphaned shared-memory segment\(s\), [\d.]+ MiB, of dead run\(s\) \w")


def test_a_run_timeout_shorter_than_a_step_says_its_value(tmp_path: Path) -> None:
    """`--timeout 0.5` ended 'failed: timeout after 0s' (the value rounded to whole seconds): the report
    named a limit the user never gave. It says 0.5s now, and leaves nothing behind (`run()` fails if teardown
    had to kill anything: rank 0 finishing just after the timeout used to publish its final state over the
    run's end for 10 s, until the launcher killed its node)."""
    rep = run(tmp_path, nodes=2, spares=1, steps=200, timeout=0.5)  # (far more steps than 0.5 s trains anywhere)
    assert rep["state"] == ("failed: timeout after 0.5s (--timeout 0.5, the run's wall-clock limit: raise it, or "
                            "leave --timeout out for none)"), rep["state"]


def test_a_run_stopped_by_its_timeout_keeps_its_checkpoints_and_says_where_to_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No wall-clock limit unless --timeout is given; one that is reached names the flag and its value, the
    persistent tier finishes what it writes, and the end says which step it saved and how to go on; the
    run resumed from there finishes."""
    from phoenixft.config import RunConfig

    assert RunConfig().timeout == 0  # (no limit by default)
    ckpt = tmp_path / "ckpt"
    rep = run(tmp_path / "a", nodes=2, spares=0, steps=5000, timeout=5.0, persist_every=3, persist_dir=str(ckpt),
              workload="user_workload:workload")
    assert rep["state"].startswith("failed: timeout after 5s (--timeout 5,"), rep["state"]
    saved = rep["resume_from"]
    assert saved is not None and saved["dir"] == str(ckpt) and saved["step"] % 3 == 0 and saved["step"] >= 3, saved
    from phoenixft.protect.persist import verified_manifest

    assert verified_manifest(ckpt)[0]["step"] == saved["step"]
    assert f"the persistent tier saved step {saved['step']} in {ckpt}: go on from there with the same flags and " \
           f"--resume {ckpt}" in capsys.readouterr().err
    again = run(tmp_path / "b", nodes=2, spares=0, steps=saved["step"] + 2, resume=str(ckpt),
                workload="user_workload:workload")
    assert again["state"] == "done" and again["steps_completed"] == saved["step"] + 2, again.get("error")


def _ended_worker(monkeypatch: pytest.MonkeyPatch, state: str) -> tuple[Any, Any]:
    """A worker's view of a run whose end (`state`, signed with the run key) is in a real store."""
    from types import SimpleNamespace

    from phoenixft.controlplane import keys, signed
    from phoenixft.controlplane.server import serve_store
    from phoenixft.distributed.comm import connect_store
    from phoenixft.runtime.worker import Worker

    monkeypatch.setenv("PHOENIXFT_TOKEN", "t" * 8 + "Aq3-Zt9_pL0wYv2s")
    server = serve_store("127.0.0.1", 0)
    st = connect_store(server.addr)
    signed.set_signed(st, signed.env_token(), "run1", keys.RUN_STATE, state)
    w = Worker.__new__(Worker)
    w.ctx, w.run_id, w._end_checked = SimpleNamespace(store=st, wid="n0.0"), "run1", 0.0
    return w, server


def test_rank_0_finishing_after_the_run_ended_keeps_that_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run ended (a --timeout, an interruption) while rank 0 finished its last step: it publishes neither
    its final state nor `done` over that end, and returns at once (it used to rewrite both for 10 s, waiting
    for an acknowledgement the launcher, already tearing down, never gives)."""
    import time

    from phoenixft.controlplane import keys, signed

    w, _server = _ended_worker(monkeypatch, "aborted")
    t0 = time.monotonic()
    w._publish_final('{"sha256": "x", "step": 12}')
    assert time.monotonic() - t0 < 1.0
    assert signed.run_ended(w.ctx.store, "run1") == "aborted" and not w.ctx.store.check([keys.FINAL])


def test_a_rank_stops_at_a_step_boundary_once_the_run_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast steps never wait long enough in a collective to look at the control plane: the step boundary
    looks (at most every RUN_END_CHECK_S, one store request) and stops the rank once the run has ended."""
    from phoenixft.errors import RunAborted

    w, _server = _ended_worker(monkeypatch, "aborted")
    with pytest.raises(RunAborted, match=r"run ended \(aborted\)"):
        w._stop_if_ended()
    w._stop_if_ended()  # (looked a moment ago: not again before RUN_END_CHECK_S)


def test_a_run_ended_while_a_node_is_stopped_does_not_wait_out_the_grace_for_it(tmp_path: Path) -> None:
    """A node hung (SIGSTOP) and not yet found (a long --failure-timeout) when the run ends (--timeout, Ctrl-C,
    SIGTERM): the launcher waited the whole STOP_GRACE_S (10 s) for it to leave by itself, which a stopped
    process never does, before killing it: every Ctrl-C with a hung node took 10 s. A node whose every process
    is stopped is killed at once now; the report still names it, and nothing is left behind."""
    import time

    from phoenixft.config import RunConfig
    from phoenixft.observe.display import Display
    from phoenixft.runtime.launcher import run_job

    cfg = RunConfig(nodes=2, spares=0, steps=400, model="tiny", failure_timeout=60.0, timeout=6.0,
                    inject=["hang:node=1@step=4"], run_dir=str(tmp_path), quiet=True)
    cfg.validate()
    t0 = time.monotonic()
    rep = run_job(cfg, Display(quiet=True, steps=cfg.steps))
    took = time.monotonic() - t0
    assert rep["state"].startswith("failed: timeout after 6s (--timeout 6,"), rep["state"]
    assert took < cfg.timeout + 6.0, f"the run took {took:.1f}s to end after its {cfg.timeout:g}s timeout"
    assert [k["node"] for k in rep["teardown"]["killed"]] == ["n1"], rep["teardown"]
    assert processes_with(rep["run_id"]) == []
    assert sorted(Path("/dev/shm").glob(f"phoenixft-{rep['run_id']}[-.]*")) == []


def test_a_run_ended_while_one_worker_is_stopped_ends_without_waiting_for_it(tmp_path: Path) -> None:
    """One worker SIGSTOPped, its agent running, not yet fenced (a long --failure-timeout), when the run ends
    (--timeout here; Ctrl-C alike): the agent waited for a worker that never exits, and the launcher waited
    out its 10 s grace and killed the node ('still running after the run ended'). The agent kills its stopped
    workers once the run has ended, and leaves by itself."""
    import signal
    import threading
    import time

    from phoenixft.config import RunConfig
    from phoenixft.observe.display import Display
    from phoenixft.runtime.launcher import run_job

    def stop_n1_worker() -> None:
        _await_progress(tmp_path, 3, time.monotonic() + 60)
        pid = _worker_of("n1", os.getpid())
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)

    cfg = RunConfig(nodes=2, spares=0, steps=400, model="tiny", failure_timeout=60.0, timeout=6.0,
                    run_dir=str(tmp_path), quiet=True)
    cfg.validate()
    t = threading.Thread(target=stop_n1_worker, daemon=True)
    t.start()
    t0 = time.monotonic()
    rep = run_job(cfg, Display(quiet=True, steps=cfg.steps))
    took = time.monotonic() - t0
    t.join(timeout=10)
    assert rep["state"].startswith("failed: timeout after 6s (--timeout 6,"), rep["state"]
    assert took < cfg.timeout + 6.0, f"the run took {took:.1f}s to end after its {cfg.timeout:g}s timeout"
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    assert processes_with(rep["run_id"]) == []
    assert sorted(Path("/dev/shm").glob(f"phoenixft-{rep['run_id']}[-.]*")) == []
