"""Planned drain: a live node's role moves to a spare at a step boundary with nothing lost (real processes,
real signals), from each source of a request: the `preempt:` fault, a signal to the agent, `phoenixft drain`;
without a spare the job shrinks; a notice too short for the drain is an ordinary failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import SUITE_FLAGS, processes_with, run

from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import parse_drain_request


def _drained_cleanly(rep: dict[str, Any], run_dir: Path, node: str, spare: str | None) -> dict[str, Any]:
    """The run's recovery that drained `node`: class planned, nothing lost, the spare in its slot (or a shrink),
    invariants true, the node's workers and agent gone with exit code 0 (its log says why)."""
    (rec,) = [r for r in rep["recoveries"] if (r.get("drain") or {}).get("node") == node]
    assert rec["class"] == "planned" and rec["lost_steps"] == 0, rec
    assert rec["action"] == ("drain" if spare else "shrink") and rec["dead"] == [], rec
    assert rec["promoted"] == ([spare] if spare else []), rec
    assert rec["drain"]["completed"] and rec["drain"]["notice_to_swapped_s"] > 0, rec["drain"]
    assert all(rec["invariants"].get(k) is True for k in ("I1", "I2", "I3", "I4")), rec["invariants"]
    assert rec["bytes_moved"] > 0 or not spare, rec
    log = (run_dir / "logs" / f"{node}.log").read_text()
    assert f"{node} was drained" in log and "Traceback" not in log, log[-2000:]
    return rec


def test_preempt_notice_drains_with_nothing_lost(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """The fault sends the agent of slot 2 its drain signal at step 5 and would SIGKILL it 30 s later: the
    node's role moves to the spare before that, the final state is the failure-free run's, and nothing of the
    node is left (conftest.run: no process, no /dev/shm segment, an empty teardown record)."""
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=1, steps=12, inject=["preempt:node=2@step=5,notice=30"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["faults_not_fired"] == [] and rep["faults"][0]["fault"] == "preempt", rep["faults"]
    rec = _drained_cleanly(rep, tmp_path, "n2", "s0")
    assert rec["faults"] == ["preempt:node=2@step=5,notice=30"] and rec["resumed_step"] >= 5, rec
    assert rec["drain"]["source"] == "preempt" and rec["drain"]["deadline"] is not None, rec["drain"]
    assert rec["drain"]["notice_to_swapped_s"] < 30.0, rec["drain"]  # within the notice: no SIGKILL was needed
    from phoenixft.cli.main import main  # (`phoenixft report` in this process: tests/test_html_report.py runs it)

    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert 'data-key="drain"' in page and "n2 (preemption notice (SIGUSR1); preempt)" in page


def test_no_spare_shrinks_and_short_notice_is_a_failure(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """Without a spare the drain shrinks the job (nothing lost; after a shrink the loss matches within 1e-4,
    not bitwise); with a notice of 0 s the node is SIGKILLed at once and the ordinary failure path recovers
    it, bitwise."""
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path / "shrink", nodes=4, spares=0, steps=12, inject=["preempt:node=1@step=5,notice=30"])
    assert rep["state"] == "done", rep.get("error")
    assert [f["step"] for f in rep["faults"]] == [5], rep["faults"]  # the job held step 5 for the agent's notice
    _drained_cleanly(rep, tmp_path / "shrink", "n1", None)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(rep["loss"], ref["loss"], strict=True))
    rep = run(tmp_path / "kill", nodes=4, spares=1, steps=12, inject=["preempt:node=1@step=6,notice=0"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["promoted"] == ["s0"], rec
    if rec["drain"] is not None and rec["drain"]["completed"]:
        # (a notice of 0 s races the SIGKILL: a drain planned before the node went is a drain, nothing lost)
        assert rec["class"] == "planned" and rec["action"] == "drain" and rec["lost_steps"] == 0, rec
    else:  # the node was gone first: the ordinary failure path
        assert rec["class"] == "permanent" and rec["action"] == "hotswap" and rec["dead"] == ["n1"], rec
        assert rec["lost_steps"] <= 1, rec


def _wait(what: str, cond: Any, timeout_s: float = 90.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_signal_and_cli_drain_a_live_run(tmp_path: Path, reference, capsys) -> None:  # type: ignore[no-untyped-def]
    """A live run: `phoenixft drain n0 --run-dir D --wait` drains the node of rank 0 onto a spare (its step
    records and the final state are then written by the new rank 0), and SIGUSR1 to the whole process group
    of node n1 (as Slurm signals every process of a step) drains it onto the other spare: its workers ignore
    the signal, its agent turns it into a request. Both are planned drains with nothing lost, and the run ends
    bitwise equal to the failure-free one."""
    from phoenixft.cli.main import main
    from phoenixft.distributed.comm import connect_store

    steps = 30
    ref = reference(nodes=3, steps=steps, microbatches=6, workload="user_workload:workload")
    d = tmp_path / "run"
    # tests/user_workload.py's paced workload: `workload`'s arithmetic, each microbatch 0.05 s longer asleep, so
    # a step lasts 0.3 s at least however fast the machine: the run outlasts both drains (a run training flat
    # out could end before the agent's request for the second was seen)
    here = str(Path(__file__).parent)
    env = {**os.environ, "PHOENIXFT_TEST_PACE_S": "0.05",
           "PYTHONPATH": os.pathsep.join(q for q in (here, os.environ.get("PYTHONPATH")) if q)}
    p = subprocess.Popen([sys.executable, "-m", "phoenixft", "run", "--nodes", "3", "--spares", "2", "--steps",
                          str(steps), *SUITE_FLAGS, "--microbatches", "6", "--workload", "user_workload:paced_workload",
                          "--run-dir", str(d), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        port = _wait("the store", lambda: (d / "coordinator.port").is_file() and (d / "coordinator.port").read_text())
        store = connect_store(f"127.0.0.1:{port}", 30.0)
        run_id = store.get(keys.RUN_ID).decode()
        _wait("step 1", lambda: store.check([keys.PROGRESS]) and int(sealed.peel(store.get(keys.PROGRESS)) or 0) >= 1)
        store.set(keys.drain_key(2), "not json")  # a malformed request is ignored (logged), never a crash
        # the command in this process (a new interpreter importing torch takes longer than the run on a loaded
        # machine): its parser, the run found by its directory, the request, and --wait's answer
        rc = main(["drain", "n0", "--run-dir", str(d), "--wait", "--reason", "maintenance", "--timeout", "120"])
        out = capsys.readouterr().out
        assert rc == 0 and "n0 drained at step" in out and "action drain, spare s0, lost 0 step(s)" in out, out
        agent = [q for q in processes_with(run_id) if _is_agent(q, "n1")]
        assert len(agent) == 1, agent
        os.killpg(agent[0], signal.SIGUSR1)
        assert p.wait(timeout=180) == 0, p.stderr.read().decode() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    rep = json.loads((d / "report.json").read_text())
    assert rep["state"] == "done" and rep["teardown"] == {"killed": [], "removed_segments": []}, rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert [r["action"] for r in rep["recoveries"]] == ["drain", "drain"], rep["recoveries"]
    cli_rec = _drained_cleanly(rep, d, "n0", "s0")["drain"]
    assert cli_rec["source"] == "cli" and cli_rec["reason"] == "maintenance", cli_rec
    assert _drained_cleanly(rep, d, "n1", "s1")["drain"]["source"] == "signal"
    assert processes_with(run_id) == [] and not list(Path("/dev/shm").glob(f"phoenixft-{run_id}[-.]*"))
    assert "ignored the store value of 'drain/2'" in (d / "logs" / "coordinator.log").read_text()


def _is_agent(pid: int, node: str) -> bool:
    """`pid` is the agent of `node` (its process group's leader; its workers share its command line)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return "runtime.agent" in cmd and f"--node {node} " in cmd and os.getpgid(pid) == pid
    except OSError:
        return False


def test_drain_requests_are_validated() -> None:
    """What a producer writes is checked field by field; anything else is ignored (None), never raised."""
    ok = parse_drain_request(json.dumps({"reason": "straggler", "source": "detector", "deadline": None}), "k")
    assert ok == {"reason": "straggler", "source": "detector", "deadline": None, "t": None, "node_id": None}
    assert parse_drain_request(json.dumps({"reason": "x", "source": "y", "deadline": 12.5, "t": 3,
                                           "node_id": "n1"}), "k")["deadline"] == 12.5
    for bad in (b"not json", b"[1]", json.dumps({"reason": 3}), json.dumps({"deadline": "soon"}),
                json.dumps({"deadline": float("inf")}), json.dumps({"t": True}), json.dumps({"node_id": 2}),
                b"\xff\xfe"):
        assert parse_drain_request(bad, "k") is None, bad
    assert keys.drain_key(2) == "drain/2"


def test_the_drain_command_signs_its_request_with_the_job_token(tmp_path: Path, monkeypatch: Any,
                                                              capsys: Any) -> None:
    """`phoenixft drain` seals its request with the run key: without the job token it writes nothing and says
    so in one line; with another job's token too; with the token the request verifies, and only under this
    run's key."""
    import secrets

    from phoenixft.cli.main import main
    from phoenixft.config import RunConfig
    from phoenixft.controlplane import signed
    from phoenixft.controlplane.server import serve_store
    from phoenixft.distributed.comm import connect_store

    token = secrets.token_urlsafe(32)
    server = serve_store("127.0.0.1", 0)
    st = connect_store(server.addr)
    st.set(keys.RUN_ID, "run1")
    signed.set_signed(st, token, "run1", keys.CONFIG, RunConfig(nodes=2).to_json())
    sealed.bind(token, "run1")
    sealed.put(st, keys.EPOCH, "0")
    from phoenixft.controlplane import auth
    from phoenixft.distributed.topology import Topology

    topo = Topology(epoch=0, nodes=["n0", "n1"], workers_per_node=1, replicas=1, resume_step=0).to_json()
    st.multi_set([keys.topo_sig(0), keys.topo(0)], [auth.sign_topology(token, 0, topo), topo])  # (as published)
    sealed.unbind()
    monkeypatch.delenv("PHOENIXFT_TOKEN", raising=False)
    f = tmp_path / "tok"
    for tok, why in ((None, "a drain request is signed with the job token"),
                     (secrets.token_urlsafe(32), "not the token of the job")):
        args = ["drain", "n1", "--coordinator", server.addr]
        if tok is not None:
            f.write_text(tok + "\n")
            f.chmod(0o600)
            args += ["--token-file", str(f)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
        assert not st.check([keys.drain_key(1)])
    monkeypatch.setenv("PHOENIXFT_TOKEN", token)
    assert main(["drain", "n1", "--coordinator", server.addr, "--reason", "maintenance"]) == 0
    raw = st.get(keys.drain_key(1))
    req = parse_drain_request(sealed.unseal(keys.drain_key(1), raw), keys.drain_key(1))
    assert req is not None and req["node_id"] == "n1" and req["reason"] == "maintenance" and req["source"] == "cli"
    sealed.bind(token, "run2")
    assert sealed.unseal(keys.drain_key(1), raw) is None


def test_a_drain_whose_node_died_ends_the_survivors_waits_at_its_end() -> None:
    """A drain notice of 0 s: the node is SIGKILLed as its drain begins. The survivors' protection job of the
    step (the scrub repair round's all-reduce spans every rank) then waits on a dead peer; it used to wait out
    the replication timeout, because the job's flag check let any epoch with a drain notice finish its job,
    even after the drain's end, so the training thread (waiting for that job before its gradient all-reduce)
    missed the gather and its node was fenced as unresponsive. And each survivor waited out the drain wait
    (5 s) for the dead node's descriptor. Both now end at the drain's end (`keys.drain_abort`)."""
    import secrets
    from types import SimpleNamespace

    from phoenixft.controlplane.server import serve_store
    from phoenixft.distributed.comm import connect_store
    from phoenixft.protect.protection import Protection
    from phoenixft.runtime.worker import Worker

    token, e = secrets.token_urlsafe(32), 3
    server = serve_store("127.0.0.1", 0)
    st = connect_store(server.addr)
    sealed.bind(token, "run1")
    try:
        flagged = [False]
        ctx = SimpleNamespace(epoch=e, run_id="run1", store=st, watcher=SimpleNamespace(flagged=lambda x: flagged[0]))
        check = Protection._flag_check(SimpleNamespace(ctx=ctx), st)  # type: ignore[arg-type]  # (the workers')
        assert check() is None
        st.set(keys.failflag(e), "1")  # a stranger's flag is ignored
        assert check() is None
        sealed.put(st, keys.drain_notice(e), json.dumps({"node": "n1", "after_step": 5}))
        sealed.put(st, keys.failflag(e), "1")
        assert check() is None  # a planned drain: every peer is alive, the job finishes
        st.set(keys.drain_abort(e), "1")  # (forged: ignored)
        assert check() is None
        sealed.put(st, keys.drain_abort(e), "1")
        assert check() == "recovery requested"  # the drain is over: a job still waiting gives up
        check2 = Protection._flag_check(SimpleNamespace(ctx=ctx), st)  # type: ignore[arg-type]
        flagged[0] = True  # the watcher raises a drain epoch's flag only at the drain's end: no round trip
        st.delete_key(keys.drain_abort(e))
        assert check2() == "recovery requested"
        ctx.epoch = e + 1  # an ordinary failure of the next epoch
        flagged[0] = False
        sealed.put(st, keys.failflag(e + 1), "1")
        assert check2() == "recovery requested"

        # the survivor's wait for every descriptor (the dead node's never comes) ends at the drain's end
        topo = SimpleNamespace(nodes=["n0", "n1", "n2"], workers_per_node=1)
        worker = SimpleNamespace(ctx=ctx, _drain_wait_s=lambda: 30.0)
        for n in ("n0", "n2"):
            sealed.put(st, keys.desc(e, f"{n}.0"), "{}")
        sealed.put(st, keys.drain_abort(e), "1")
        t0 = time.monotonic()
        Worker._await_peers_settled(worker, e, topo)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 10.0
        worker = SimpleNamespace(ctx=ctx, _drain_wait_s=lambda: 0.5)  # without the drain's end: the bounded wait
        t0 = time.monotonic()
        Worker._await_peers_settled(worker, e + 1, topo)  # type: ignore[arg-type]
        assert time.monotonic() - t0 >= 0.5
    finally:
        sealed.unbind()
