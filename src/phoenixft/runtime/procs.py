"""Process lifetime helpers: parent-death signals, process identity that survives PID reuse.

- `die_with_parent(sig, parent)`: receive `sig` when the process `parent` dies: from the kernel
  (`PR_SET_PDEATHSIG`) when it is our parent, from a watcher thread on a pidfd when it is an
  ancestor (a process forked by the launcher's zygote follows the launcher, not the zygote), and
  at once if it is already gone.
- `start_time(pid)`: the process's start time in clock ticks since boot (`/proc/PID/stat`
  field 22); a (pid, start time) pair names one process, never a later one that reuses the PID.
- `group_members(pgid)`: live (not zombie) processes of a process group.
- `signal_node(agent, sig)`: SIGKILL or SIGSTOP one node (its agent and the processes below it) and
  nothing else, also where the agent shares its process group with the script that started it.

`python -m phoenixft.runtime.procs --parent PID --signal N MODULE ARGS...` runs `python -m MODULE
ARGS...` in this process after `die_with_parent(N, PID)`, and exits with `exit_now` (the launcher
starts the coordinator so).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

__all__ = ["die_with_parent", "start_time", "alive", "group_members", "cmdlines", "exit_now", "fork", "descendants",
           "signal_node"]

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int) -> None:
    """Receive `sig` when the process `parent` dies. Our parent (the thread that forked us): the
    kernel's parent-death signal. An ancestor that started before us (the launcher, when its zygote
    forked us): a daemon thread waiting on a pidfd of it, so that the zygote's own death changes
    nothing. Already gone (we were reparented before this call): `sig` now."""
    if os.getppid() == parent:
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # it died meanwhile
            os.kill(os.getpid(), sig)
        return
    born, mine = start_time(parent), start_time(os.getpid())
    if born is None or mine is None or born > mine or not alive(parent, born):  # gone, or its PID reused
        os.kill(os.getpid(), sig)
        return
    _watch(parent, born, sig)


def _watch(pid: int, born: int, sig: int) -> None:
    """Send `sig` to this process once `pid` (started at `born`) has exited."""
    import threading

    fd = -1
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): poll
        pass
    if fd >= 0 and not alive(pid, born):  # it exited, or its PID was reused, before the pidfd was opened
        os.close(fd)
        os.kill(os.getpid(), sig)
        return

    def wait() -> None:
        import select

        if fd >= 0:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            import time

            while alive(pid, born):
                time.sleep(0.2)
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name=f"phoenixft-follow-{pid}", daemon=True).start()


def fork() -> int:
    """`os.fork()` for an agent's workers and health checks, without Python 3.12's warning that forking a
    process with threads may deadlock the child. An agent's only other thread is `die_with_parent`'s, which
    waits on a pidfd (or sleeps between looks at /proc) and holds no lock the child needs; the warning, on
    every fork in every agent's log, would only alarm."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        return os.fork()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 2 (comm) may contain spaces and parentheses: split after the last ')'
    return raw[raw.rfind(")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """The scheduler state of `pid` (`R`, `S`, `D`, `T` stopped, `t` stopped by a tracer, `Z`, ...), or None
    if there is no such process."""
    f = _stat_fields(pid)
    return f[0] if f else None


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if there is no such process."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None  # field 22 overall; f[0] is field 3


PF_EXITING = 0x4  # /proc/PID/stat flags: the process is on its way out (it will never act again)


def alive(pid: int, start: int | None) -> bool:
    """True if the process `pid` that started at `start` still runs (not a zombie, not exiting: a
    SIGKILLed process with many threads or much memory takes a while to become a zombie)."""
    f = _stat_fields(pid)
    if not f or f[0] in ("Z", "X") or int(f[6]) & PF_EXITING:
        return False
    return start is None or int(f[19]) == start


def _group_states(pgid: int) -> dict[int, str]:
    """PID -> scheduler state of the live processes (zombies excluded) whose process group is `pgid`."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        f = _stat_fields(int(d.name))
        if f and f[0] not in ("Z", "X") and int(f[2]) == pgid:
            out[int(d.name)] = f[0]
    return out


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (zombies excluded)."""
    return list(_group_states(pgid))


def group_stopped(pgid: int) -> bool:
    """Whether process group `pgid` has live processes and every one of them is stopped (SIGSTOP,
    SIGTSTP, a tracer): such a group obeys no request to exit until it is continued."""
    states = _group_states(pgid).values()
    return bool(states) and all(st in ("T", "t") for st in states)


def descendants(root: int) -> list[int]:
    """Live processes below `root` (its children, theirs, ...), by the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            f = _stat_fields(int(d.name))
            if f and f[0] not in ("Z", "X"):
                children.setdefault(int(f[1]), []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def signal_node(root: int, sig: int) -> None:
    """Send `sig` (SIGKILL: the node dies; SIGSTOP: it hangs) to one node: its agent `root` and every process
    below it, and nothing else. An agent that leads its own session (a local run starts every agent so)
    is signalled as its process group, at once. One started by hand may share its process group with
    whatever started it (a script that runs `phoenixft agent ... &` puts every agent, the coordinator and
    itself in one group): then the node's process tree is frozen first (SIGSTOP, until no new process
    appears below `root`: none forks or leaves meanwhile), then signalled. The calling process, if it is one
    of the node's, is signalled last."""
    me = os.getpid()
    try:
        own_session = os.getsid(root) == root
    except ProcessLookupError:
        own_session = False
    if own_session:
        os.killpg(root, sig)
        return
    frozen: list[int] = []
    inside = False  # (the caller is one of the node's processes: signalled last)
    while True:
        tree = (root, *descendants(root))
        inside = inside or me in tree
        new = [p for p in tree if p != me and p not in frozen]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            frozen.append(p)
    if sig != signal.SIGSTOP:
        for p in frozen:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    if inside:
        os.kill(me, sig)


def cmdlines() -> dict[int, list[str]]:
    """argv of every readable process except this one."""
    out: dict[int, list[str]] = {}
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            raw = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if raw:
            out[int(d.name)] = raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return out


def _main(argv: list[str]) -> None:
    import argparse
    import runpy

    ap = argparse.ArgumentParser(prog="python -m phoenixft.runtime.procs")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--signal", type=int, default=int(signal.SIGKILL))
    ap.add_argument("module")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    die_with_parent(a.signal, a.parent)
    sys.argv = [a.module, *a.args]
    code: object = 0
    try:
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    exit_now(code)


def exit_now(code: object = 0) -> None:
    """Exit like `sys.exit(code)` but skip the interpreter's finalization: with torch imported it
    takes seconds on a busy machine, and a run's launcher waits for its processes to be gone.
    Only for processes whose files are closed by then (stdout and stderr are flushed here)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    _main(sys.argv[1:])
