"""The warm zygote (phoenixft.runtime.zygote): a forked child must look like `subprocess.Popen([python, "-m",
module, *args], start_new_session=True, stdin=DEVNULL, stdout=log, stderr=STDOUT, env=...)`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run

from phoenixft.runtime import zygote
from phoenixft.runtime.procs import alive, cmdlines, start_time

CHILD = '''
import json, os, sys, time
mode = sys.argv[1]
if mode == "info":
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("ZTEST"), "gone": os.environ.get("ZGONE"),
                      "cwd": os.getcwd(), "pgid": os.getpgid(0), "sid": os.getsid(0), "name": __name__,
                      "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")), "stdin": sys.stdin.read()}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "sleep":
    print("sleeping", flush=True)
    time.sleep(float(sys.argv[2]))
elif mode == "raise":
    raise ValueError("boom")
'''


def _wait_for(log: Path, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and text in log.read_text()):
        assert time.monotonic() < deadline, f"{log} never said {text!r}"
        time.sleep(0.02)


@pytest.fixture
def z(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> zygote.Zygote:
    (tmp_path / "zchild.py").write_text(CHILD)
    monkeypatch.chdir(tmp_path)  # the child finds zchild.py as `python -m` would: in its working directory
    return zygote.Zygote.shared()


def test_child_is_set_up_like_a_fresh_process(z: zygote.Zygote, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZTEST", "set after the zygote started")
    monkeypatch.delenv("ZGONE", raising=False)
    log = tmp_path / "info.log"
    c = z.spawn(["zchild", "info", "x y"], log, {"PHOENIXFT_EXTRA": "1"})
    assert c.wait(timeout=30) == 0
    first, second = log.read_text().splitlines()
    info = json.loads(first)
    assert second == "to stderr"  # stdout and stderr both go to the log, unbuffered, in order
    assert info["argv"] == ["info", "x y"] and info["name"] == "__main__"
    assert info["env"] == "set after the zygote started" and info["gone"] is None
    assert info["cwd"] == str(tmp_path)
    assert info["pgid"] == c.pid and info["sid"] == c.pid  # its own session: a node is one process group
    assert info["fds"][:3] == [0, 1, 2] and len(info["fds"]) == 4  # 0-2 and listdir's own: nothing inherited
    assert info["stdin"] == ""


def test_command_line_exit_codes_and_signals(z: zygote.Zygote, tmp_path: Path) -> None:
    c = z.spawn(["zchild", "sleep", "30", "--run-id", "abc123"], tmp_path / "s.log", {})
    _wait_for(tmp_path / "s.log", "sleeping")
    # what `ps`, `phoenixft gc`, rundir and the tests read
    assert cmdlines()[c.pid] == [sys.executable, "-m", "zchild", "sleep", "30", "--run-id", "abc123"]
    assert c.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        c.wait(timeout=0.2)
    os.killpg(c.pid, signal.SIGTERM)
    assert c.wait(timeout=30) == -signal.SIGTERM and c.returncode == -signal.SIGTERM
    assert z.spawn(["zchild", "exit", "3"], tmp_path / "e.log", {}).wait(timeout=30) == 3
    r = z.spawn(["zchild", "raise"], tmp_path / "r.log", {})
    assert r.wait(timeout=30) == 1 and "ValueError: boom" in (tmp_path / "r.log").read_text()
    assert z.spawn(["no_such_module_here"], tmp_path / "n.log", {}).wait(timeout=30) == 1


def test_a_command_line_too_long_for_the_room_is_started_fresh(z: zygote.Zygote, tmp_path: Path) -> None:
    long = "x" * (zygote.ROOM + 100)
    c = z.spawn(["zchild", "info", long], tmp_path / "l.log", {})
    assert c.wait(timeout=120) == 0
    assert json.loads((tmp_path / "l.log").read_text().splitlines()[0])["argv"] == ["info", long]


def test_the_zygote_is_shared_and_replaced_when_it_died(z: zygote.Zygote, tmp_path: Path) -> None:
    assert zygote.Zygote.shared() is z
    c = z.spawn(["phoenixft.runtime.procs", "--parent", str(z.pid), "--signal", str(int(signal.SIGKILL)),
                 "zchild", "sleep", "60"], tmp_path / "p.log", {})
    st = start_time(c.pid)
    _wait_for(tmp_path / "p.log", "sleeping")
    os.kill(z.pid, signal.SIGKILL)
    # its child named it as the parent to follow: it dies with it, and its handle says so
    assert c.wait(timeout=30) == -signal.SIGKILL
    assert not alive(c.pid, st)
    z2 = zygote.Zygote.shared()
    assert z2 is not z and z2.alive()
    assert z2.spawn(["zchild", "exit", "0"], tmp_path / "ok.log", {}).wait(timeout=120) == 0


_EXIT_PROBE = """
import atexit, sys
from phoenixft.runtime import zygote
from phoenixft.runtime.procs import alive, start_time
seen = {}
atexit.register(lambda: print("alive" if alive(seen["pid"], seen["start"]) else "gone", flush=True))  # runs last
z = zygote.Zygote.shared()
seen.update(pid=z.pid, start=start_time(z.pid))
sys.exit(0)
"""


def test_a_launching_process_ends_its_zygote_before_it_exits(tmp_path: Path) -> None:
    """A `phoenixft run` that has exited leaves no process of its own behind: its zygote is ended and waited
    for at its exit (left alone, the zygote exits once it reads the end of its request pipe, after the
    launcher: a user's or a test's look at the processes just after the launcher's exit found it)."""
    p = subprocess.run([sys.executable, "-c", _EXIT_PROBE], capture_output=True, text=True, timeout=180,
                       cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "gone", (p.stdout, p.stderr[-2000:])


def _no_spawn(*_: object, **__: object) -> zygote.Child:
    raise AssertionError("the zygote was used")


def test_phoenixft_zygote_0_starts_every_process_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOENIXFT_ZYGOTE", "0")
    monkeypatch.setattr(zygote.Zygote, "spawn", _no_spawn)
    rep = run(tmp_path, nodes=2, spares=0, steps=2, model="tiny")
    assert rep["state"] == "done" and rep["steps_completed"] == 2


def test_a_failed_zygote_falls_back_to_fresh_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> zygote.Child:
        raise zygote.ZygoteError("broken on purpose")

    monkeypatch.setattr(zygote.Zygote, "spawn", broken)
    rep = run(tmp_path, nodes=2, spares=0, steps=2, model="tiny")
    assert rep["state"] == "done" and rep["steps_completed"] == 2


def test_a_handle_is_a_named_process_group_at_once(z: zygote.Zygote, tmp_path: Path) -> None:
    # the zygote answers only once the child has its session and title: what killpg and `ps` act on
    for i in range(10):
        c = z.spawn(["zchild", "sleep", "30", f"--tag-{i}"], tmp_path / f"g{i}.log", {})
        assert cmdlines()[c.pid][-1] == f"--tag-{i}"
        os.killpg(c.pid, signal.SIGKILL)
        assert c.wait(timeout=30) == -signal.SIGKILL


def test_a_spawn_given_up_on_never_hands_its_process_to_the_next(z: zygote.Zygote, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert z.spawn(["zchild", "exit", "0"], tmp_path / "warm.log", {}).wait(timeout=30) == 0  # ready
    monkeypatch.setattr(zygote, "SPAWN_TIMEOUT_S", 0.5)
    os.kill(z.pid, signal.SIGSTOP)  # the answer comes after the spawn gave up
    try:
        with pytest.raises(zygote.ZygoteError, match="no answer"):
            z.spawn(["zchild", "sleep", "30", "first"], tmp_path / "first.log", {})
    finally:
        os.kill(z.pid, signal.SIGCONT)
    monkeypatch.setattr(zygote, "SPAWN_TIMEOUT_S", 30.0)
    second = z.spawn(["zchild", "sleep", "30", "second"], tmp_path / "second.log", {})
    assert cmdlines()[second.pid][-1] == "second"
    _wait_for(tmp_path / "first.log", "")  # it was started, late (it opened its log); nobody holds it: ended
    deadline = time.monotonic() + 10
    while any(a[-1:] == ["first"] and "zchild" in a for a in cmdlines().values()):
        assert time.monotonic() < deadline, "the abandoned child lives on"
        time.sleep(0.05)
    os.killpg(second.pid, signal.SIGKILL)
    assert second.wait(timeout=30) == -signal.SIGKILL


def test_a_child_that_cannot_set_up_is_an_error_and_the_zygote_stays(z: zygote.Zygote, tmp_path: Path) -> None:
    with pytest.raises(zygote.ZygoteError, match="No such file or directory"):
        z.spawn(["zchild", "exit", "0"], tmp_path / "no" / "such" / "dir.log", {})
    assert z.alive() and zygote.Zygote.shared() is z
    odd = os.fsdecode(b"caf\xe9")  # a command line that is not UTF-8 (a latin-1 path)
    c = z.spawn(["zchild", "info", odd], tmp_path / "odd.log", {})
    assert c.wait(timeout=30) == 0
    assert json.loads((tmp_path / "odd.log").read_text().splitlines()[0])["argv"] == ["info", odd]


def test_a_zygote_that_cannot_start_is_a_zygote_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object, **__: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(zygote.subprocess, "Popen", fail)
    z = zygote.Zygote()
    with pytest.raises(zygote.ZygoteError, match="could not start"):
        _ = z.pid
    with pytest.raises(zygote.ZygoteError, match="could not start"):
        z.spawn(["zchild", "exit", "0"], "/dev/null", {})
