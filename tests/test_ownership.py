"""Host memory always has an owner: however a run ends, no process and no /dev/shm segment of it
is left behind; `phoenixft gc` frees what dead runs left and never touches a live run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS, processes_with, run

from phoenixft.controlplane import keys, sealed
from phoenixft.distributed.comm import connect_store
from phoenixft.protect import shm
from phoenixft.runtime.procs import cmdlines, start_time

# `serial`: runs alone in `make test`, after the other tests: every local run that starts sweeps the memory of
# dead runs on this machine, and one started beside these tests could free what they look for (a leak would
# pass unseen, a planted orphan go missing)
pytestmark = pytest.mark.serial

PY = sys.executable


def _segments(run_id: str, node: str | None = None) -> list[Path]:
    return shm.segments(run_id, node)


def _progress(run_dir: Path) -> int:
    """The run's last completed step, read from its live control-plane store (0 until it trains)."""
    port = run_dir / "coordinator.port"
    if not port.exists() or not port.read_text().strip():
        return 0
    try:
        store = connect_store(f"127.0.0.1:{port.read_text().strip()}", 5.0)
        return int(sealed.peel(store.get(keys.PROGRESS)) or 0) if store.check([keys.PROGRESS]) else 0
    except Exception:  # noqa: BLE001 - not up yet, or gone
        return 0


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Launcher:
    """`phoenixft run` as a real process in its own session (like a shell starts it)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = tmp / "launcher.log"
        self.run_dir = tmp / "run"
        self._out = open(self.log, "wb")
        self.p = subprocess.Popen([PY, "-m", "phoenixft", "run", "--quiet", "--run-dir", str(self.run_dir),
                                   "--timeout", "120", *args], stdout=self._out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        self.run_id = ""

    def wait_training(self, timeout_s: float = 90.0) -> str:
        def started() -> bool:
            m = re.search(r"run ([0-9a-f]{10}):", self.log.read_text(errors="replace"))
            if m:
                self.run_id = m.group(1)
            return bool(m) and _progress(self.run_dir) >= 2

        _wait(lambda: started() or self.p.poll() is not None, timeout_s, "the run to train")
        assert self.p.poll() is None, self.log.read_text()
        assert _segments(self.run_id), "a protected run keeps its snapshots in /dev/shm"
        return self.run_id

    def close(self) -> None:
        """Kill whatever is left of this test's own run (by process group), even if the test failed."""
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)
        self._out.close()
        if self.run_id:
            for pid in processes_with(self.run_id):
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            shm.unlink_segments(self.run_id)
            shm.owner_path(self.run_id).unlink(missing_ok=True)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Any]:
    made: list[Launcher] = []

    def make(*args: str) -> Launcher:
        made.append(Launcher(tmp_path, *args))
        return made[-1]

    yield make
    for ln in made:
        ln.close()


def _assert_nothing_left(run_id: str, within_s: float = 15.0) -> None:
    def clean() -> bool:
        return not processes_with(run_id) and not _segments(run_id) and not shm.owner_path(run_id).exists()

    try:
        _wait(clean, within_s, "the run's processes and shared memory to go")
    except AssertionError:
        left = {"processes": processes_with(run_id), "segments": [p.name for p in _segments(run_id)],
                "owner": shm.owner_path(run_id).exists()}
        raise AssertionError(f"left behind {within_s}s after the launcher's end: {left}") from None


@pytest.mark.slow  # (in `make test`: test_leaks: SIGHUP, with `phoenixft gc` on the live run)
def test_sighup_to_the_launcher_ends_the_run_and_frees_its_memory(launcher: Any) -> None:
    ln = launcher("--nodes", "2", "--spares", "1", "--steps", "2000")
    run_id = ln.wait_training()
    # `phoenixft gc` must not touch a live run's segments (a spare's health probe writes a segment of its own
    # for a moment, and removes it: not compared; gc naming the run as dead is still caught)
    before = {p.name for p in _segments(run_id) if ".health-" not in p.name}
    g = subprocess.run([PY, "-m", "phoenixft", "gc"], capture_output=True, text=True, timeout=60)
    assert g.returncode == 0, g.stderr
    assert run_id not in g.stdout and before <= {p.name for p in _segments(run_id)}
    assert ln.p.poll() is None
    os.kill(ln.p.pid, signal.SIGHUP)  # the terminal closed
    ln.p.wait(timeout=30)
    _assert_nothing_left(run_id)
    rep = json.loads((ln.run_dir / "report.json").read_text())
    assert rep["state"] == "failed: interrupted"
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    # what it did up to the signal is kept (not only the state: its steps and logs too)
    assert rep["steps_completed"] >= 2 and len(rep["loss"]) >= 2 and rep["run_dir"] == str(ln.run_dir)
    assert len((ln.run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
    assert (ln.run_dir / "events.jsonl").read_text().strip()


@pytest.mark.slow  # (in `make test`: test_leaks: SIGKILL of the launcher)
def test_sigkill_of_the_launcher_leaves_nothing(launcher: Any) -> None:
    ln = launcher("--nodes", "2", "--spares", "1", "--steps", "2000")
    run_id = ln.wait_training()
    os.kill(ln.p.pid, signal.SIGKILL)  # the OOM killer
    ln.p.wait(timeout=10)
    _assert_nothing_left(run_id)


def test_the_zygote_sigkilled_mid_run_takes_nothing_with_it(launcher: Any, reference: Any) -> None:
    """The warm zygote forked the coordinator and the agents, but they follow the launcher: killing
    the zygote alone (an OOM killer's pick) loses nothing, and the run ends as a failure-free one."""
    ln = launcher("--nodes", "2", "--spares", "1", "--steps", "30", *SUITE_FLAGS, "--model", "tiny")
    run_id = ln.wait_training()

    def zygotes() -> list[int]:
        out = []
        for pid, cmd in cmdlines().items():
            if "phoenixft.runtime.zygote" in " ".join(cmd):
                try:
                    if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == ln.p.pid:
                        out.append(pid)
                except (OSError, IndexError, ValueError):
                    pass
        return out

    (z,) = zygotes()
    os.kill(z, signal.SIGKILL)
    assert ln.p.wait(timeout=120) == 0, ln.log.read_text()[-3000:]
    rep = json.loads((ln.run_dir / "report.json").read_text())
    assert rep["state"] == "done" and rep["steps_completed"] == 30, rep["state"]
    assert rep["recoveries"] == [], rep["recoveries"]
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    assert rep["final_state_sha256"] == reference(nodes=2, steps=30, model="tiny")["final_state_sha256"]
    _assert_nothing_left(run_id)


@pytest.mark.slow  # (in `make test`: test_leaks: SIGKILL of an agent)
def test_agent_sigkilled_mid_run_leaves_no_memory_of_its_node(tmp_path: Path) -> None:
    """Only the agent is killed; its workers die with it, the launcher frees the node's memory
    at once, a spare takes over, and the run finishes clean."""
    seen: dict[str, Any] = {}

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not seen:
            if _progress(tmp_path) >= 3:
                store = f"127.0.0.1:{(tmp_path / 'coordinator.port').read_text().strip()}"
                for pid, argv in cmdlines().items():
                    if "phoenixft.runtime.agent" in argv and "n1" in argv and store in argv:  # our own run's node n1
                        run_id = argv[argv.index("--run-id") + 1]
                        assert _segments(run_id, "n1")
                        os.kill(pid, signal.SIGKILL)
                        t0 = time.monotonic()
                        while _segments(run_id, "n1") and time.monotonic() - t0 < 10:
                            time.sleep(0.02)
                        seen.update(run_id=run_id, freed_s=time.monotonic() - t0, left=_segments(run_id, "n1"))
                        return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    rep = run(tmp_path, nodes=2, spares=1, steps=60)  # asserts nothing of the run is left at the end
    t.join(timeout=30)
    assert seen.get("run_id") == rep["run_id"], "the agent was never killed"
    assert seen["left"] == [], f"node n1's segments outlived its agent: {seen}"
    assert rep["state"] == "done" and rep["steps_completed"] == 60
    assert rep["recoveries"] and rep["recoveries"][0]["action"] == "hotswap"
    assert not _segments(rep["run_id"], "n1")


def _fake_run(run_id: str, owners: list[dict[str, Any]], nbytes: int = 4096) -> list[Path]:
    files = [shm.SHM_DIR / f"{shm.run_prefix(run_id)}n0.0-g0-state.data",
             shm.SHM_DIR / f"{shm.run_prefix(run_id)}n0.0-g0-state.hdr"]
    for f in files:
        f.write_bytes(b"\0" * nbytes)
    shm.owner_path(run_id).write_text("".join(json.dumps(o) + "\n" for o in owners))
    return files


def test_gc_frees_orphans_only(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    dead = {"pid": sleeper.pid, "start": start_time(sleeper.pid), "role": "launcher"}
    sleeper.kill()
    sleeper.wait(timeout=10)
    tag = uuid.uuid4().hex[:8]
    orphan, reused, live = f"gcorphan{tag}", f"gcreused{tag}", f"gclive{tag}"
    my_start = start_time(os.getpid()) or 0
    me: dict[str, Any] = {"pid": os.getpid(), "start": my_start, "role": "launcher"}
    files: dict[str, list[Path]] = {}
    try:
        files[orphan] = _fake_run(orphan, [dead])
        files[reused] = _fake_run(reused, [{**me, "start": my_start - 1}])  # same PID, other process
        files[live] = _fake_run(live, [me])
        d = subprocess.run([PY, "-m", "phoenixft", "gc", "--dry-run"], capture_output=True, text=True, timeout=60)
        assert d.returncode == 0, d.stderr
        assert "would free" in d.stdout and orphan in d.stdout and reused in d.stdout and live not in d.stdout
        assert all(f.exists() for fs in files.values() for f in fs)
        g = subprocess.run([PY, "-m", "phoenixft", "gc"], capture_output=True, text=True, timeout=60)
        assert g.returncode == 0, g.stderr
        m = re.search(r"freed (\d+) segment\(s\), (\d+) bytes", g.stdout)
        assert m and int(m.group(1)) >= 4 and int(m.group(2)) >= 4 * 4096, g.stdout
        assert orphan in g.stdout and reused in g.stdout and live not in g.stdout
        for rid in (orphan, reused):
            assert not any(f.exists() for f in files[rid]) and not shm.owner_path(rid).exists()
        assert all(f.exists() for f in files[live]) and shm.owner_path(live).exists()
    finally:
        for rid, fs in files.items():
            for f in fs:
                f.unlink(missing_ok=True)
            shm.owner_path(rid).unlink(missing_ok=True)
