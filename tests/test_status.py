"""Tests of `phoenixft status` / phoenixft.observe.status: against an in-process store, bad addresses, a live run.

    .venv/bin/python -m pytest tests/test_status.py

The live test starts `phoenixft run` (2 nodes, 1 spare, 200 steps, node 1 killed at step 8) in its
own session, reads the coordinator's port from RUN_DIR/coordinator.port, checks what status
shows before and after the hot-swap, then stops the run (SIGINT: the launcher's teardown) and
checks that no process of it is left; a `finally` kills whatever is left, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import processes_with, wait_while_running

from phoenixft.controlplane import keys
from phoenixft.errors import UserError
from phoenixft.observe.status import collect_status, connect, format_status, parse_address

# `phoenixft status` once cli/main.py registers it; until then the same parser and error handling
_WRAPPER = """
import argparse, sys
from phoenixft.cli import cmd_status
from phoenixft.errors import UserError
ap = argparse.ArgumentParser(prog="phoenixft")
cmd_status.add_parser(ap.add_subparsers(dest="command", required=True))
args = ap.parse_args()
try:
    sys.exit(args.func(args))
except UserError as e:
    print(f"phoenixft {args.command}: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _cli() -> list[str]:
    from phoenixft.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if "status" in sub.choices:
        return [sys.executable, "-m", "phoenixft"]
    return [sys.executable, "-c", _WRAPPER]


def _status_cmd(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from phoenixft.cli import cmd_status

    ap = argparse.ArgumentParser(prog="phoenixft")
    cmd_status.add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["status", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------ unit tests
def test_parse_address() -> None:
    assert parse_address("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("", "nohost", "host:", ":80", "host:0", "host:99999", "host:http"):
        with pytest.raises(UserError, match="--coordinator"):
            parse_address(bad)


def test_status_of_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    """What status shows, from a store filled the way the coordinator and workers fill it."""
    import torch.distributed as dist

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    addr = f"127.0.0.1:{master.port}"
    store = connect(addr, 5.0)
    st = collect_status(store)
    assert st["config"] is None and "no phoenixft run has published its config" in format_status(st, addr)

    master.set(
        keys.CONFIG,
        json.dumps(
            {
                "nodes": 2,
                "workers_per_node": 2,
        "replicas": 1,
                "spares": 4,
                "steps": 50,
                "protect": "phoenix",
                "model": "tiny",
            }
        ),
    )
    for w in ("s0.0", "s0.1", "s1.0", "s1.1", "s2.0", "s2.1", "s3.0"):  # s3 is still starting
        master.set(keys.ready(w), "1")
    topo0: dict[str, Any] = {
        "epoch": 0,
        "nodes": ["n0", "n1"],
        "workers_per_node": 2,
        "replicas": 1,
        "resume_step": 0,
        "meta": {},
    }
    topo1 = {
        "epoch": 1,
        "nodes": ["s0", "n1"],
        "workers_per_node": 2,
        "replicas": 1,
        "resume_step": 9,
        "meta": {"dead": ["n0"], "promoted": ["s0"], "class": "permanent", "action": "hotswap"},
    }
    topo2 = {
        "epoch": 2,
        "racks": 2,
        "nodes": ["s1", "n1"],
        "workers_per_node": 2,
        "replicas": 1,
        "resume_step": 19,
        "meta": {"dead": ["s0"], "promoted": ["s1"], "class": "permanent", "action": "hotswap"},
    }
    for t in [topo0, topo1, topo2]:
        master.set(keys.topo(t["epoch"]), json.dumps(t))
    master.set(keys.EPOCH, "2")
    now = time.time()
    master.set(keys.heartbeat("s1"), str(now - 0.5))
    master.set(keys.heartbeat("n1"), str(now - 0.5))
    master.set(keys.node_exit("s0"), str(now))
    master.set(keys.PROGRESS, "23")
    master.set(keys.step(23), json.dumps({"step": 23, "loss": 3.25, "dt": 0.2, "epoch": 2, "world": 4}))
    for i in range(15):
        ev = {"t": now + i, "kind": "epoch", "by": "coordinator", "epoch": i}
        master.append(keys.EVENTS, json.dumps(ev) + "\n")  # type: ignore[attr-defined]

    # a TCPStore `set` is not acknowledged: a request that is answered (check) flushes them
    assert master.check([keys.EVENTS])
    st = collect_status(store, events=3, now=now)
    assert st["epoch"] == 2 and st["topology"]["nodes"] == ["s1", "n1"]
    assert [m["ranks"] for m in st["members"]] == [[0, 1], [2, 3]]
    assert st["members"][0]["heartbeat_age_s"] == pytest.approx(0.5, abs=0.01)
    assert st["config"]["spares"] == 4, st["config"]
    assert {s["id"]: s["state"] for s in st["spares"]} == {
        "s0": "used in epoch 1, since lost",
        "s1": "in use (slot 0, since epoch 2)",
        "s2": "ready",
        "s3": "starting (not ready yet)",
    }
    assert (
        st["progress"]["step"] == 23
        and st["events_total"] == 15
        and [e["epoch"] for e in st["events"]] == [12, 13, 14]
    )
    text = format_status(st, addr)
    assert "epoch 2: world 4 (2 node(s) x 2 worker(s)), resume step 19" in text
    assert "dead s0, promoted s1" in text
    assert re.search(r"slot 0\s+s1\s+rack 0\s+rank\(s\) 0,1\s+heartbeat 0\.5s ago", text), text
    assert re.search(r"slot 1\s+n1\s+rack 1\s+rank\(s\) 2,3\s+heartbeat", text), text
    assert "epochs: 0: n0 n1; 1: s0 n1; 2: s1 n1" in text
    assert "spares: 4 in the pool, 1 ready and unused" in text
    assert "progress: step 23/50 (46%), loss 3.2500" in text
    assert "last events (3 of 15):" in text

    master.set(keys.RUN_STATE, "failed")
    master.set(keys.RUN_ERROR, "2 node(s) lost")
    assert master.check([keys.RUN_ERROR])
    out = _status_cmd(["--coordinator", addr, "--json", "--events", "0"], capsys)
    js = json.loads(out)
    assert js["run_state"] == "failed" and js["run_error"] == "2 node(s) lost" and js["events"] == []
    assert js["coordinator"] == addr
    assert "run state: failed (2 node(s) lost)" in _status_cmd(["--coordinator", addr], capsys)


def test_unreachable_coordinator_is_one_line() -> None:
    """A closed port, and a port that accepts connections but never answers (c10d's own timeout
    does not cover that handshake): exit 2, one line naming --coordinator. All at once, the silent
    port three times: a thread left inside the c10d client once made the exit a SIGABRT."""
    closed = _free_port()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t = time.monotonic()
        procs = [
            subprocess.Popen(
                [*_cli(), "status", "--coordinator", f"127.0.0.1:{port}", "--timeout", "1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for port in (closed, *[silent.getsockname()[1]] * 3)
        ]
        try:
            results = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        took = time.monotonic() - t
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(
            "phoenixft status: error: cannot reach a phoenixft coordinator at --coordinator=127.0.0.1:"
        ), lines[0]
    assert took < 90  # python + torch import (slow on a loaded machine), then at most 2 x timeout + 2 s


# ------------------------------------------------------------------------------------- live run
LAUNCH = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from phoenixft.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def _pids_of(needles: list[str]) -> list[int]:
    """Live processes whose command line contains any of `needles`."""
    return sorted({pid for n in needles for pid in processes_with(n)})




@pytest.mark.slow
def test_status_of_a_live_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "live"
    log = tmp_path / "launcher.log"
    cmd = [
        sys.executable,
        "-c",
        LAUNCH,
        "run",
        "--nodes",
        "2",
        "--spares",
        "1",
        "--steps",
        "200",
        "--inject",
        "kill:node=1@step=8",
        "--run-dir",
        str(run_dir),
        "--quiet",
    ]
    needles = [str(run_dir)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        port_file = run_dir / "coordinator.port"
        wait_while_running("coordinator.port", lambda: port_file.exists() and port_file.read_text().strip(), proc, 90)
        addr = f"127.0.0.1:{port_file.read_text().strip()}"
        needles.append(addr)
        store = connect(addr, 5.0)
        wait_while_running("epoch 0", lambda: collect_status(store)["epoch"] is not None, proc, 90)
        first = _status_cmd(["--coordinator", addr], capsys)
        assert re.search(r"^epoch \d+: world 2 \(2 node\(s\) x 1 worker\(s\)\)", first, re.M), first
        assert re.search(r"slot 0\s+n0\s+rank\(s\) 0\s", first), first
        assert "spares: 1 in the pool" in first and "run state: running" in first

        # node 1 is killed at step 8: spare s0 takes slot 1 in epoch 1
        st = wait_while_running(
            "the hot-swap and a step after it",
            lambda: (
                (s := collect_status(store))["epoch"] == 1
                and s["progress"]
                and s["progress"]["step"] > s["topology"]["resume_step"]
                and s
            ),
            proc,
            120,
        )
        assert st["topology"]["nodes"] == ["n0", "s0"]
        text = _status_cmd(["--coordinator", addr, "--events", "20"], capsys)
        assert "epoch 1: world 2" in text and "dead n1, promoted s0" in text, text
        assert re.search(r"slot 1\s+s0\s+rank\(s\) 1\s+heartbeat", text), text
        assert "s0 in use (slot 1, since epoch 1)" in text
        assert "epochs: 0: n0 n1; 1: n0 s0" in text
        assert re.search(r"progress: step \d+/200", text)
        for kind in ("run_start", "fault", "classified", "recovery_planned"):
            assert f" {kind} " in text, kind
        assert not list(run_dir.glob("report.json"))  # still running: status only read

        # stop the run the way a user does (Ctrl-C): the launcher tears every process down
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        gone_by = time.monotonic() + 15
        while _pids_of(needles) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert _pids_of(needles) == [], "processes of the run outlived it"
        assert (run_dir / "report.json").exists()
        m = re.search(r"^run (\w+):", log.read_text(errors="replace"), re.M)
        assert m, log.read_text(errors="replace")
        assert not list(Path("/dev/shm").glob(f"phoenixft-{m.group(1)}-*")), "shared memory left behind"
        with pytest.raises(UserError, match="--coordinator"):
            connect(addr, 1.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in _pids_of(needles):  # agents and coordinator run in their own sessions: by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        m = re.search(r"^run (\w+):", log.read_text(errors="replace"), re.M) if log.exists() else None
        if m:
            for f in Path("/dev/shm").glob(f"phoenixft-{m.group(1)}-*"):
                f.unlink(missing_ok=True)


def test_a_closed_port_is_given_up_after_about_the_timeout() -> None:
    """c10d retries a refused connect for about twice its client timeout: `--timeout 5` took about 12 s
    (10 s here in-process) before the client was given half of it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        t0 = time.monotonic()
        with pytest.raises(UserError, match=f"cannot reach a phoenixft coordinator at --coordinator=127.0.0.1:{port}"):
            connect(f"127.0.0.1:{port}", 5.0)
        took = time.monotonic() - t0
    assert took < 5.0 + 1.5, took
