"""One job across separate hosts: real network namespaces, each host its own address (tests/netns.py).

The head (`phoenixft coordinator`) runs in one namespace, an agent (`phoenixft agent --coordinator`)
in each of the others; nothing is shared but the bridge between them (and this machine's
filesystem, which the job does not rely on). Checked: a host partitioned (its link down, its processes
alive), then another killed, end bitwise equal to a failure-free run; the partitioned host, healed
after its fence, finds itself fenced, writes nothing into the job and returns as a spare; agents without the
token, or with another job's, are refused with one clear line and never become members; the
namespaces and their links are gone afterwards, also after a failed or interrupted test.
Needs root and `ip` (iproute2); skips, saying which is missing, otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS
from netns import Hosts, namespaces, sweep_orphans, unavailable

from phoenixft.controlplane import sealed
from phoenixft.protect import shm

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PORT = "29500"


def _env(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PHOENIXFT_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(REPO / "src"), str(REPO / "tests"),
                                                    os.environ.get("PYTHONPATH", "")] if x)
    if token:
        env["PHOENIXFT_TOKEN"] = token
    return env


def _wait(what: str, cond: Any, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
          log: Path | None = None) -> Any:
    """Poll cond() until it returns something truthy; fail naming `what` (and the head's log tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            pytest.fail(f"the head exited ({proc.returncode}) while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{tail}")
        time.sleep(0.05)


def _get(store: Any, key: str) -> bytes | None:
    """The value of `key` (None: absent), a sealed one's MAC left off (the test only looks)."""
    return sealed.peel(bytes(store.get(key))) if store.check([key]) else None


def _head(H: Hosts, tmp: Path, token: str | None, *flags: str) -> subprocess.Popen[bytes]:
    return H.run("head", [PY, "-m", "phoenixft", "coordinator", "--host", H.addr["head"], "--port", PORT,
                          "--run-dir", str(tmp / "run"), "--report", str(tmp / "report.json"), *flags],
                 log=tmp / "head.log", env=_env(token))


def _agent(H: Hosts, tmp: Path, host: str, token: str | None, *flags: str, log: str = "") -> subprocess.Popen[bytes]:
    return H.run(host, [PY, "-m", "phoenixft", "agent", "--coordinator", f"{H.addr['head']}:{PORT}", *flags],
                 log=tmp / (log or f"{host}.log"), env=_env(token))


def _node_keys_written_by(store: Any, node: str, epochs: int) -> dict[str, bytes | None]:
    """Every key the node's processes write, with its value now (None: absent)."""
    names = [keys_hb(node), f"left/{node}", f"ready/{node}.0"]
    names += [f"desc/{e}/{node}.0" for e in range(epochs + 2)] + [f"join/{e}/{node}.0" for e in range(epochs + 2)]
    return {k: _get(store, k) for k in names}


def keys_hb(node: str) -> str:
    return f"hb/{node}"


def _events(store: Any) -> list[dict[str, Any]]:
    raw = bytes(store.get("events")) if store.check(["events"]) else b""
    return [json.loads(sealed.peel(x) or b"") for x in raw.splitlines() if x.strip()]


@pytest.mark.serial  # (alone: a run started beside it could sweep the memory it looks for, see conftest)
def test_kill_then_partition_across_four_hosts_and_a_spare(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """4 hosts + 1 spare host (+ the head), the suite's `nano`: the host in slot 2 is partitioned at step 4 for 6 s (its
    link down, its processes running). The job notices it within --failure-timeout, fences it and hot-swaps
    the spare in; the healed host finds itself fenced and exits having written nothing after its fence, and
    comes back as a spare (as a repaired node would). The host in slot 1 is SIGKILLed at step 8, a fault that
    waits (`,wait=`) until the job is whole again, i.e. until the returned host is a warm spare: the run
    stands at step 8 meanwhile, however fast this machine trains, so it is still on when the healed host
    comes back; the returned host takes the killed one's place. Two strangers (no token, another job's
    token) are refused meanwhile. Final state bitwise equal to the failure-free run; once the head has
    exited, every host's processes exit by themselves and no memory of the run is left but the SIGKILLed
    node's (looked at before any cleanup of the test's)."""
    steps = 12  # (the configuration of test_drain's and test_ec's runs: one reference run for all)
    ref = reference(nodes=4, steps=steps)
    token = secrets.token_hex(16)
    names = ["head", "h1", "h2", "h3", "h4", "h5", "x1"]
    with Hosts(names) as H:
        head = _head(H, tmp_path, token, "--nodes", "4", "--spares", "1", "--steps", str(steps),
                     "--failure-timeout", "2", "--quiet", "--inject", "partition:node=2@step=4,for=6,wait=90",
                     *SUITE_FLAGS, "--inject", "kill:node=1@step=8,wait=120")
        log = tmp_path / "head.log"
        for h in ("h1", "h2", "h3", "h4"):
            _agent(H, tmp_path, h, token, "--node", h)
        _agent(H, tmp_path, "h5", token, "--node", "h5", "--spare")
        no_token = _agent(H, tmp_path, "x1", None, "--node", "stranger", "--spare", log="x1-none.log")
        wrong = _agent(H, tmp_path, "x1", secrets.token_hex(16), "--node", "other-job", "--spare",
                       log="x1-wrong.log")
        store = _wait("the store", lambda: _try_connect(H), 60, head, log)
        # the partition: wait for its fence, then for the healed host to stop by itself
        fault = json.loads(_wait("the partition", lambda: _get(store, "fault/0"), 180, head, log))
        victim = fault["node"]
        assert fault["step"] == 4, fault  # the job held step 4 for the agent, however fast it trains
        victim_host = json.loads(_get(store, "members") or b"{}")[victim]["name"]
        fenced_at = float(_wait("the fence", lambda: _get(store, f"fence/{victim}"), 60, head, log))
        snapshot = _node_keys_written_by(store, victim, epochs=3)
        events_at_fence = len(_events(store))
        assert fenced_at < fault["t"] + 6.0, "the host was healed before it was fenced: the test proves nothing"
        _wait("the healed host's processes to exit", lambda: not H.pids(victim_host), 60, head, log)
        assert head.poll() is None and _get(store, "run/state") is None, \
            "the run ended before the healed host came back: it was not put to the test"
        assert _get(store, "fault/1") is None, "the kill fired without waiting for a whole job"
        after = _node_keys_written_by(store, victim, epochs=3)
        late = [e for e in _events(store)[events_at_fence:]
                if "by" not in e and (e.get("node") == victim or str(e.get("wid", "")).startswith(f"{victim}."))]
        # the healed host returns as a spare; the job is whole again and the kill held at step 8 fires
        _agent(H, tmp_path, victim_host, token, "--node", f"{victim_host}-back", "--spare", log="back.log")
        killed = json.loads(_wait("the kill", lambda: _get(store, "fault/1"), 180, head, log))["node"]
        assert head.wait(timeout=240) == 0, log.read_text()[-3000:]
        assert no_token.wait(timeout=30) == 2 and wrong.wait(timeout=30) == 2
        left = _left_behind(H, tmp_path)
    assert H.leftovers() == [], "namespaces outlived the test"
    rep = json.loads((tmp_path / "report.json").read_text())
    # what is left is the SIGKILLed node's memory alone (on a real cluster its host's: nobody else could
    # free it; its host returning as a spare would, as test_hotswap shows): every other process freed its own
    killed_mem = f"{shm.PREFIX}{rep['run_id']}-{killed}."
    assert left["processes"] == {} and all(s.startswith(killed_mem) for s in left["segments"]), left
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["faults_not_fired"] == [], rep["faults_not_fired"]
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap", "hotswap"], rep["recoveries"]
    r1, r2 = rep["recoveries"]
    assert r1["fault"].startswith("partition:") and r2["fault"].startswith("kill:")
    assert r1["dead"] == [victim] and r1["fenced"] == [victim] and r1["promoted"] == ["s0"], r1
    assert r2["dead"] == [killed] and r2["promoted"] == ["s1"], r2  # s1: the healed host, returned
    assert rep["members"]["s1"]["name"] == f"{victim_host}-back", rep["members"]
    assert all(r["invariants"] == {"I1": True, "I2": True, "I3": True, "I4": True} for r in rep["recoveries"])
    assert r1["detect_s"] < 2.0 + 3.0, r1  # noticed within --failure-timeout (+ this loaded machine's slack)
    # the partitioned host wrote nothing after its fence, and found itself fenced once healed
    assert after == snapshot, {k: (snapshot[k], after[k]) for k in after if after[k] != snapshot[k]}
    assert late == [], late
    vlog = (tmp_path / f"{victim_host}.log").read_text()
    # (its agent's look or its worker's next store call, whichever comes first, finds the fence)
    assert "partition healed" in vlog and ("fenced by the control plane" in vlog
                                           or "was fenced: it is not a member any more" in vlog), vlog[-2000:]
    # strangers: refused with one clear line, never members, never in any topology
    for f, why in (("x1-none.log", "presented no token"), ("x1-wrong.log", "wrong token")):
        text = (tmp_path / f).read_text()
        assert "refused to admit" in text and why in text and "Traceback" not in text, text
    assert not any(m["name"] in ("stranger", "other-job") for m in rep["members"].values()), rep["members"]
    ev = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    refused = sorted(e["name"] for e in ev if e["kind"] == "join_refused")
    assert refused == ["other-job", "stranger"], refused
    # the token is in no file the job wrote
    for p in (tmp_path / "run").rglob("*"):
        if p.is_file():
            assert token not in p.read_text(errors="replace"), p


def _left_behind(H: Hosts, tmp: Path, within_s: float = 30.0) -> dict[str, Any]:
    """Once the head has exited: every process started on a host must exit by itself (each agent sees the
    run's end, stops its workers and frees its node's memory) within `within_s`. Returns what of the run
    is still there then: processes per host (`ip netns pids`) and the run's files in /dev/shm, looked at
    before the harness kills anything and before any sweep; found segments are then unlinked (the test's
    own cleanup: a failed test leaves nothing either; the harness kills the processes)."""
    run_id = json.loads((tmp / "report.json").read_text())["run_id"]
    deadline = time.monotonic() + within_s
    while any(p.poll() is None for p in H.procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = {h: H.pids(h) for h in H.names if H.pids(h)}
    segments = [p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{run_id}[-.]*")]
    if segments:
        shm.unlink_segments(run_id)
        shm.owner_path(run_id).unlink(missing_ok=True)
    return {"processes": procs, "segments": segments}


def _try_connect(H: Hosts) -> Any:
    try:
        s = H.connect("head", f"{H.addr['head']}:{PORT}", timeout_s=5)
        return s if s.check(["config"]) else None
    except Exception:  # noqa: BLE001 - the head is still starting
        return None


def _store_alive(store: Any) -> bool:
    try:
        store.check(["config"])
        return True
    except Exception:  # noqa: BLE001
        return False


_HARNESS = """
import json, sys, time
from netns import Hosts
with Hosts(["a", "b"]) as H:
    p = H.run("a", ["sleep", "300"])
    open(sys.argv[1], "w").write(json.dumps({"tag": H.tag, "pid": p.pid}))
    if sys.argv[2] == "fail":
        assert False, "a deliberately failing test"
    time.sleep(120)
"""

def _started(info: Path, p: subprocess.Popen[str], timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (info.exists() and info.read_text()):
        assert p.poll() is None or info.exists(), p.communicate()[0] if p.stdout else p.returncode
        assert time.monotonic() < deadline, "the harness did not start"
        time.sleep(0.05)
    out: dict[str, Any] = json.loads(info.read_text())
    return out


def _gone(tag: str, pid: int) -> bool:
    alive = Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    return not [n for n in namespaces() if n.startswith(tag)] and not alive


def test_namespaces_and_links_are_removed_after_a_failed_or_interrupted_test(tmp_path: Path) -> None:
    """A test that fails, one interrupted with Ctrl-C (SIGINT), and one SIGKILLed (its namespaces are
    removed by the next harness that starts): afterwards no namespace, link or process of theirs is left."""
    env = _env(None)
    links_before = _root_links()
    # 1. a failing pytest test that built hosts and started a process in one
    harness = tmp_path / "harness.py"
    harness.write_text(_HARNESS)
    test_file = tmp_path / "test_deliberately_failing.py"
    info = tmp_path / "failing.json"
    test_file.write_text(
        "import subprocess, sys\n"
        "def test_fails():\n"
        f"    sys.argv = ['harness', {str(info)!r}, 'fail']\n"
        f"    exec(compile(open({str(harness)!r}).read(), 'harness', 'exec'), {{'__name__': 'harness'}})\n")
    p = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 1 and "a deliberately failing test" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    started = json.loads(info.read_text())
    assert _gone(started["tag"], started["pid"]), "a failed test left namespaces or processes behind"
    # 2. Ctrl-C in the middle of a test, 3. SIGKILL (the next harness sweeps what it left)
    for sig in (signal.SIGINT, signal.SIGKILL):
        info = tmp_path / f"{int(sig)}.json"
        h = subprocess.Popen([PY, str(harness), str(info), "wait"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, preexec_fn=_ctrl_c_as_in_a_terminal)
        started = _started(info, h)
        assert [n for n in namespaces() if n.startswith(started["tag"])], "the harness built nothing"
        h.send_signal(sig)
        h.communicate(timeout=60)
        if sig == signal.SIGKILL:
            assert [n for n in namespaces() if n.startswith(started["tag"])], "nothing was left to sweep"
            assert started["tag"] + "-a" in sweep_orphans()
        assert _gone(started["tag"], started["pid"]), f"{sig!r} left namespaces or processes behind"
    assert _root_links() - links_before == set(), "a link appeared in the machine's own namespace"


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT at its default in the child: a suite started in the background (`make test &`, some CI
    runners) passes it on ignored, and Python then ignores it too (Ctrl-C would test nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def test_the_heads_host_cut_off_for_longer_than_the_failure_timeout(tmp_path: Path, reference,  # type: ignore[no-untyped-def]
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's own link goes down for 6 s (--failure-timeout 2), every agent and the spare alive: all
    heartbeats stop at once. Fencing every node would fail the run when the link
    came back ("every node is lost (n0, n1) and no spare is ready"). Every member and spare silent at
    once, nobody posting, is taken for what it most likely is (this host cut off): the gather waits
    (an `all_silent` event, at most ALL_SILENT_WAIT_S more), then gives every node the full timeout
    to reconnect. Nobody is fenced, and the run ends bitwise equal to a failure-free one."""
    steps = 40  # (the failure-free run of test_etcd's head-host test: one reference run for both)
    ref = reference(nodes=2, steps=steps, workload="user_workload:workload")
    token = secrets.token_hex(16)
    # tests/user_workload.py's paced workload (`workload`'s arithmetic, each step 0.1 s longer asleep): the run is
    # still on when the link goes down, however fast this machine trains
    monkeypatch.setenv("PHOENIXFT_TEST_PACE_S", "0.1")
    with Hosts(["head", "h1", "h2", "h3"]) as H:
        head = _head(H, tmp_path, token, "--nodes", "2", "--spares", "1", "--steps", str(steps),
                     "--workload", "user_workload:paced_workload", *SUITE_FLAGS, "--failure-timeout", "2", "--quiet")
        log = tmp_path / "head.log"
        for h in ("h1", "h2"):
            _agent(H, tmp_path, h, token, "--node", h)
        _agent(H, tmp_path, "h3", token, "--node", "h3", "--spare")
        store = _wait("the store", lambda: _try_connect(H), 60, head, log)
        _wait("a whole job at step 3", lambda: _get(store, "job/whole") and int(_get(store, "progress") or 0) >= 3,
              120, head, log)
        H.link("head", False)
        time.sleep(6.0)
        assert _get(store, "run/state") is None, _get(store, "run/error")  # (the head's own view: its loopback)
        H.link("head", True)
        assert head.wait(timeout=120) == 0, log.read_text()[-3000:]
        left = _left_behind(H, tmp_path)
    assert H.leftovers() == []
    assert left == {"processes": {}, "segments": []}, left
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert all(r["dead"] == [] and r["fenced"] == [] for r in rep["recoveries"]), rep["recoveries"]
    ev = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "all_silent" for e in ev)
