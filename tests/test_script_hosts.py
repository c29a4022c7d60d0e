"""A user's own training script across separate hosts: `phoenixft launch --head` on one host, `phoenixft agent
--coordinator` on each of the others (real network namespaces, tests/netns.py; the script at the same path on
every host). A node's host is SIGKILLed mid-step: the spare's host takes its place, and the run ends bitwise
equal to the failure-free run of the same script on one host. Needs root and `ip` (iproute2); skips, saying
which is missing, otherwise."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Hosts, unavailable
from test_script import EXAMPLE, STEPS, launch

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

REPO = Path(__file__).resolve().parents[1]
PORT = "29500"


def _env(token: str) -> dict[str, str]:
    env = dict(os.environ, PHOENIXFT_TOKEN=token)
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(REPO / "src"), os.environ.get("PYTHONPATH", "")] if x)
    return env


def _wait_exit(p: subprocess.Popen[bytes], timeout_s: float, log: Path) -> int:
    try:
        return p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the head did not end within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


@pytest.mark.serial  # (alone: three hosts' workers and a head; a run beside it could sweep their memory)
def test_a_script_across_hosts_hot_swaps_a_killed_host_bitwise(tmp_path: Path) -> None:
    ref = launch(tmp_path / "ref")  # the same script on one host, no fault: 2 nodes and a spare
    assert ref["state"] == "done", ref["state"]
    token = secrets.token_urlsafe(32)
    env = _env(token)
    with Hosts(["head", "h1", "h2", "h3"]) as H:
        log = tmp_path / "head.log"
        head = H.run("head", [sys.executable, "-m", "phoenixft", "launch", "--head", "--host", H.addr["head"],
                              "--port", PORT, "--nodes", "2", "--spares", "1", "--failure-timeout", "3",
                              "--quiet", "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "report.json"),
                              "--inject", "kill:node=1@step=7,phase=backward", str(EXAMPLE), "--steps", str(STEPS)],
                     log=log, env=env)
        agents = {h: H.run(h, [sys.executable, "-m", "phoenixft", "agent", "--coordinator", f"{H.addr['head']}:{PORT}",
                               "--node", h, *(["--spare"] if h == "h3" else [])], log=tmp_path / f"{h}.log", env=env)
                  for h in ("h1", "h2", "h3")}
        assert _wait_exit(head, 300, log) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 60  # every host's agent sees the run's end and exits by itself
        while any(p.poll() is None for h, p in agents.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = {h: H.pids(h) for h in ("h1", "h2", "h3")}
    assert H.leftovers() == [], "namespaces outlived the test"
    rep: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    assert rep["state"] == "done", rep.get("error")
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    (rec,) = rep["recoveries"]
    assert rec["promoted"] == ["s0"] and rec["lost_steps"] <= 1, rec
    assert all(rec["invariants"][k] for k in ("I1", "I2", "I3", "I4")), rec["invariants"]
    assert rep["steps_completed"] == STEPS
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    killed = rec["dead"][0]
    host_of = {n: m["name"] for n, m in rep["members"].items()}
    assert all(not pids for h, pids in alive.items() if h != host_of[killed]), alive  # (the rest left by themselves)
