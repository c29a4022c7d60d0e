"""A node lost before the run's first step, in a hand-started deployment (`phoenixft coordinator` +
`phoenixft agent` processes on 127.0.0.1). A survivor building the epoch's process groups with a member
that never comes would block there, be fenced as unresponsive and lose the run with a ready spare
waiting; instead the build is abandoned when the failure flag is set, and since nothing was
committed yet the run starts afresh with the spare in the dead node's slot."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS, free_port

PY = sys.executable
TOKEN = "q7Vx2-Lm9_Zr4Tb8Kc1Nw6Hd3Pj5Sf0Y"  # a job token of 32 url-safe characters


def _wait_for(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} within {timeout_s}s:\n{path.read_text(errors='replace')[-2000:]}")


def _wait_ready(addr: str, wid: str, timeout_s: float) -> None:
    """Until worker `wid` of the job at `addr` has said it is ready (its `ready/` key)."""
    from phoenixft.controlplane import keys
    from phoenixft.distributed.comm import connect_store

    store = connect_store(addr, 30.0)
    deadline = time.monotonic() + timeout_s
    while not store.check([keys.ready(wid)]):
        assert time.monotonic() < deadline, f"{wid} was not ready within {timeout_s}s"
        time.sleep(0.05)


Start = Callable[..., "subprocess.Popen[bytes]"]


@contextlib.contextmanager
def _hand_started(tmp_path: Path) -> Iterator[Start]:
    """`start(log, *args)`: `phoenixft *args` in its own session, its output in tmp_path/log; every process
    started is SIGKILLed with its group on the way out, whatever the test did."""
    env = dict(os.environ, PHOENIXFT_TOKEN=TOKEN)
    procs: list[subprocess.Popen[bytes]] = []

    def start(log: str, *args: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / log, "wb") as out:
            p = subprocess.Popen([PY, "-m", "phoenixft", *args], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _two_node_job(tmp_path: Path, start: Start, *flags: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A hand-started head for 2 nodes of 1 worker and 1 spare, `tiny`, 8 steps: (its address, its process)."""
    port = free_port()
    coord = start("coordinator.log", "coordinator", "--host", "127.0.0.1", "--port", str(port), "--nodes", "2",
                  "--workers-per-node", "1", "--spares", "1", "--steps", "8", *SUITE_FLAGS, "--model", "tiny",
                  "--failure-timeout", "2", "--run-dir", str(tmp_path / "run"), "--quiet", "--timeout", "120",
                  "--join-timeout", "90", *flags)
    return f"127.0.0.1:{port}", coord


def test_a_node_lost_before_the_first_step_is_replaced_by_the_spare(tmp_path: Path, reference: Any) -> None:
    with _hand_started(tmp_path) as start:
        addr, coord = _two_node_job(tmp_path, start)
        early = start("early.log", "agent", "--coordinator", addr, "--node", "early", "--workers", "1")
        _wait_for(tmp_path / "early.log", "admitted", 60.0)
        _wait_ready(addr, "n0.0", 60.0)  # its worker is up and ready
        os.killpg(early.pid, signal.SIGKILL)  # dead before the job has all its nodes
        start("spare.log", "agent", "--coordinator", addr, "--node", "sp", "--workers", "1", "--spare")
        _wait_for(tmp_path / "spare.log", "admitted", 60.0)
        _wait_ready(addr, "s0.0", 60.0)
        start("late.log", "agent", "--coordinator", addr, "--node", "late", "--workers", "1")
        assert coord.wait(timeout=180) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((tmp_path / "run" / "report.json").read_text())
        assert rep["state"] == "done" and rep["steps_completed"] == 8, rep.get("error")
        assert rep["final_state_sha256"] == reference(nodes=2, steps=8, model="tiny")["final_state_sha256"]
        (rec,) = rep["recoveries"]
        assert rec["resumed_step"] == 0 and rec["lost_steps"] == 0, rec
        assert rec["action"].startswith("hotswap") and rec["fenced"] == ["n0"], rec


def test_a_node_lost_while_it_starts_gives_its_slot_to_the_spare(tmp_path: Path, reference: Any) -> None:
    """An active agent SIGKILLed right after its admission, before its workers were ready (it never
    heartbeated): the job must not keep its slot until --join-timeout fails the run ("only 2 of 2
    node(s) joined ... not ready yet: n0") with a ready spare waiting. A slot whose node is gone
    before the start (no heartbeat --start-grace after its admission, a stale one, or its exit
    reported) goes to a ready spare; the run starts with it and ends bitwise equal to a failure-free run.
    (--start-grace 3: the killed node's slot is given up 3 s after its admission, not the default 15 s; the
    late node is never given up, whenever its first heartbeat comes: the one spare is taken by then.)"""
    with _hand_started(tmp_path) as start:
        addr, coord = _two_node_job(tmp_path, start, "--start-grace", "3")
        early = start("early.log", "agent", "--coordinator", addr, "--node", "early", "--workers", "1")
        deadline = time.monotonic() + 60
        while "admitted" not in (tmp_path / "early.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, (tmp_path / "early.log").read_text(errors="replace")
            time.sleep(0.01)
        os.killpg(early.pid, signal.SIGKILL)  # dead while it starts: never ready, never a heartbeat
        start("spare.log", "agent", "--coordinator", addr, "--node", "sp", "--workers", "1", "--spare")
        start("late.log", "agent", "--coordinator", addr, "--node", "late", "--workers", "1")
        assert coord.wait(timeout=150) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((tmp_path / "run" / "report.json").read_text())
        assert rep["state"] == "done" and rep["steps_completed"] == 8, rep.get("error")
        assert rep["final_state_sha256"] == reference(nodes=2, steps=8, model="tiny")["final_state_sha256"]
        assert rep["recoveries"] == []
        ev = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
        (swap,) = [e for e in ev if e["kind"] == "replaced_before_start"]
        assert swap["node"] == "n0" and swap["spare"] == "s0", swap
        (begin,) = [e for e in ev if e["kind"] == "run_start"]
        assert begin["nodes"] == ["s0", "n1"], begin


@pytest.mark.slow  # (suite time: a message, 20 s)
def test_a_node_that_never_gets_ready_is_named_in_one_clear_line(tmp_path: Path) -> None:
    """Every slot filled, one node's agent stopped (SIGSTOP) right after its admission, no spare: the run
    fails at --join-timeout naming that node (not "only 1 of 1 node(s) joined")."""
    port = free_port()
    env = dict(os.environ, PHOENIXFT_TOKEN=TOKEN)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for log, args in (("coordinator.log", ["coordinator", "--host", "127.0.0.1", "--port", str(port), "--nodes",
                                               "1", "--workers-per-node", "1", "--spares", "0", "--steps", "4",
                                               "--model", "tiny", "--run-dir", str(tmp_path / "run"), "--quiet",
                                               "--protect", "none", "--join-timeout", "8"]),
                          ("stuck.log", ["agent", "--coordinator", f"127.0.0.1:{port}", "--node", "stuck",
                                         "--workers", "1"])):
            procs.append(subprocess.Popen([PY, "-m", "phoenixft", *args], stdout=open(tmp_path / log, "wb"),
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=env))
        _wait_for(tmp_path / "stuck.log", "admitted", 60.0)
        os.killpg(procs[1].pid, signal.SIGSTOP)
        assert procs[0].wait(timeout=90) == 1
        rep = json.loads((tmp_path / "run" / "report.json").read_text())
        assert rep["error"].startswith("all 1 node(s) joined, but n0 did not get its workers ready within "
                                       "--join-timeout=8s"), rep["error"]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        report = tmp_path / "run" / "report.json"
        if report.exists():  # what the SIGKILLed agent could not remove (the next sweep would)
            from phoenixft.protect import shm
            run_id = json.loads(report.read_text())["run_id"]
            shm.unlink_segments(run_id)
            shm.owner_path(run_id).unlink(missing_ok=True)
