"""A node's death takes down only that node's processes.

An agent started by hand from a script with `&` (as docs/hosts.md shows) shares the script's process group
with the script, the coordinator and every other agent; a kill fault, a hang or a preemption notice that
runs out must strike only its own node (`procs.signal_node`), never that group."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SUITE_FLAGS, processes_with

from phoenixft.runtime.procs import descendants, signal_node

SCRIPT = """#!/bin/bash
set -u
export PHOENIXFT_TOKEN={token}
PY={py}
RUN={run}
"$PY" -m phoenixft coordinator --host 127.0.0.1 --port 0 --nodes 2 --steps 12 {flags} \\
    --inject kill:node=1@step=5,wait=60 --run-dir "$RUN" --quiet > "$RUN.head.log" 2>&1 &
HEAD=$!
for _ in $(seq 600); do [ -s "$RUN/coordinator.port" ] && break; sleep 0.1; done
ADDR=127.0.0.1:$(cat "$RUN/coordinator.port")
"$PY" -m phoenixft agent --coordinator "$ADDR" --node a0 > "$RUN.a0.log" 2>&1 &
"$PY" -m phoenixft agent --coordinator "$ADDR" --node a1 > "$RUN.a1.log" 2>&1 &
"$PY" -m phoenixft agent --coordinator "$ADDR" --node sp --spare > "$RUN.sp.log" 2>&1 &
wait $HEAD
echo "head exited $?" > "$RUN.script"
wait
echo "script done" >> "$RUN.script"
"""


def test_a_kill_fault_in_a_script_started_job_strikes_only_its_node(tmp_path: Path) -> None:
    """The coordinator and three agents started from one shell script with `&` (one process group, the
    script's): node 1 is killed at step 5; the script, the coordinator and the other agents live on, the spare
    takes the node's place, the run finishes and writes its report, and the script sees the head exit 0."""
    run = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT.format(token=secrets.token_hex(16), py=sys.executable, run=run,
                                    flags=" ".join(SUITE_FLAGS)))
    p = subprocess.Popen(["bash", str(script)], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = p.wait(timeout=240)
        logs = {n: Path(f"{run}.{n}.log").read_text() if Path(f"{run}.{n}.log").exists() else ""
                for n in ("head", "a0", "a1", "sp")}
        assert rc == 0, (rc, logs)
        assert Path(f"{run}.script").read_text().splitlines() == ["head exited 0", "script done"], logs
        rep = json.loads((run / "report.json").read_text())
        assert rep["state"] == "done" and rep["steps_completed"] == 12, (rep.get("error"), logs["head"][-3000:])
        assert rep["faults_not_fired"] == [] and [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep
        assert processes_with(rep["run_id"]) == [] and processes_with(str(run)) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for pid in processes_with(str(run)):
            os.kill(pid, signal.SIGKILL)


def test_signal_node_strikes_the_tree_below_its_root_and_nothing_beside_it(tmp_path: Path) -> None:
    """One process group (a script's: bash without job control) holding bystanders and a 'node' (a root with two
    children and a grandchild): SIGSTOP then SIGKILL of the node stop and kill exactly the root and what runs
    below it; the script and its other background process live on."""
    pid_file = tmp_path / "root.pid"
    code = ("import os, subprocess, time; "
            "kids = [subprocess.Popen(['sleep', '60']), subprocess.Popen(['bash', '-c', 'sleep 60 & wait'])]; "
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    script = subprocess.Popen(["bash", "-c", f'sleep 60 & {sys.executable} -c "{code}" & wait'],
                              start_new_session=True)

    def state(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        root = int(pid_file.read_text())
        while len(descendants(root)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [root, *descendants(root)]
        beside = [p for p in descendants(script.pid) if p not in tree]
        assert len(tree) == 4 and len(beside) == 1, (tree, beside)
        assert {os.getpgid(p) for p in [script.pid, *tree, *beside]} == {script.pid}  # one group for all
        signal_node(root, signal.SIGSTOP)
        deadline = time.monotonic() + 30  # (a signal is delivered when its process is next scheduled)
        while any(state(p) != "T" for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [state(p) for p in tree] == ["T"] * 4 and state(script.pid) == "S" and state(beside[0]) == "S"
        signal_node(root, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(state(p) not in ("Z", "gone") for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(state(p) in ("Z", "gone") for p in tree), [state(p) for p in tree]
        assert script.poll() is None and state(beside[0]) == "S"
    finally:
        os.killpg(script.pid, signal.SIGKILL)
        script.wait(timeout=30)
