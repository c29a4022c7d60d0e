"""A warm image for a run's local processes: one `import torch`, then one fork per process.

A local run starts a coordinator and one agent per node. Started fresh (`python -m ...`), each of
them paid its own `import torch` (about 2 s of CPU here, and four to six of them at once at every
start, on 2 cores: agents were admitted 5-7 s after the launch of a 3-step `tiny` run). A zygote
pays it once per launching process: `python -m phoenixft.runtime.zygote` imports torch and the modules those
processes run, then forks a child per request.

Each child is set up as `subprocess.Popen([python, "-m", module, *args], start_new_session=True,
stdin=DEVNULL, stdout=log, stderr=STDOUT, env=os.environ | env)` would set it up: its own session
(so a node is killed as one process group), the log on stdout and stderr, unbuffered, descriptors
above 2 closed, the environment, signal dispositions as a fresh interpreter has them, and its
command line (/proc/PID/cmdline, what `ps`, `phoenixft gc`, `rundir` and the tests read) rewritten
to that argv, in room the zygote's own command line reserved (a title that does not fit is exec'd
fresh instead). The zygote runs one thread and never runs a torch operation, so forking it is as
safe as the agents' own forking of their workers.

Requests carry an id and the zygote answers only once the child has its session, log and title (a
handle's pid is at once a process group that `ps` names); a child that could not set itself up is
an error answer (the launcher then starts that process fresh), and a child whose spawn was given up
on (a timeout, Ctrl-C) is killed when its late answer comes, never handed to the next request.
The zygote reaps its children and reports every exit (the code, or minus the signal, as Popen
does) on its own reply pipe; `Child` is the Popen-like handle the launcher keeps (pid, poll, wait,
returncode). It dies with the thread that started it (`PR_SET_PDEATHSIG`: the handle's reader
thread, which lives as long as the zygote), and exits when its request pipe closes (the launching
process ended). Its children follow the launcher, not the zygote (`--parent-pid`, `procs --parent`
name the launcher; `procs.die_with_parent` watches it through a pidfd): a zygote killed on its own
takes none of the run's processes with it, the launcher keeps their handles (a `Child` whose zygote
is gone is polled by pid and start time) and starts the next process from a new zygote.

`Zygote.shared()` is the launching process's zygote for its environment (started on first use,
replaced if it died; what the interpreter and native libraries read at start, `PYTHON*`, `OMP_*`,
`LD_*`..., is part of the key): the chaos campaign and the tests run many jobs in one process and
pay the import once. `PHOENIXFT_ZYGOTE=0` starts every process fresh instead (Popen), as before.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["Zygote", "Child", "ZygoteError", "enabled", "set_title", "SCRIPT_PRELOAD"]

ROOM = 2048  # bytes of command line the zygote reserves for its children's titles (longer ones: exec'd)
PRELOAD = ("torch", "torch.distributed", "phoenixft.runtime.worker", "phoenixft.runtime.agent", "phoenixft.coordinator",
           "phoenixft.runtime.procs")
READY_TIMEOUT_S = 180.0  # the zygote's own start (one `import torch`) on a loaded machine
SPAWN_TIMEOUT_S = 30.0  # one fork, once it is ready
SETUP_TIMEOUT_S = 10.0  # a forked child setting up its session, log and title
PRELOAD_TIMEOUT_S = 120.0  # a spawn's preloaded modules imported first (torch's compiler stack: seconds)
SCRIPT_PRELOAD = ("torch._dynamo", "torch.utils.data", "phoenixft.api.launched")  # what a script's workers import


class ZygoteError(RuntimeError):
    """The zygote could not start or answer; the caller starts the process fresh instead."""


def enabled() -> bool:
    return os.environ.get("PHOENIXFT_ZYGOTE", "1") not in ("0", "false", "no", "off")


# ---------------------------------------------------------------------------- command lines
def _argv_area() -> tuple[int, int]:
    """Addresses [start, end) of this process's argv strings (/proc/self/stat fields 48 and 49)."""
    raw = Path("/proc/self/stat").read_text()
    f = raw[raw.rfind(")") + 2 :].split()  # f[0] is field 3
    return int(f[45]), int(f[46])


def set_title(argv: list[str]) -> bool:
    """Rewrite /proc/self/cmdline to `argv` in place (NUL padded); False if it does not fit."""
    start, end = _argv_area()
    data = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    room = end - start
    if len(data) > room:
        return False
    ctypes.memmove(start, data + b"\0" * (room - len(data)), room)
    return True


# ---------------------------------------------------------------------------- the zygote process
def _child(req: dict[str, Any], ready: int) -> None:
    """In the forked child: become the requested process (never returns). The zygote answers its
    launcher only once this child has its session, log and title (`ready` closed), or failed to
    get them (the traceback written to `ready`): a handle's pid is a process group that `ps` names."""
    try:
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        os.setsid()
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        with contextlib.suppress(OSError):  # (a working directory removed meanwhile: stay where we are)
            os.chdir(req["cwd"])
            if not sys.flags.safe_path:
                sys.path[0] = req["cwd"]  # `python -m` puts the working directory first
        module, args = req["argv"][0], list(req["argv"][1:])
        argv = [sys.executable, "-m", module, *args]
        titled = set_title(argv)
    except BaseException:  # noqa: BLE001 - the zygote reports it, the launcher starts the process fresh
        os.write(ready, b"E" + traceback.format_exc().encode(errors="replace")[-4000:])
        os._exit(1)
    os.closerange(3, ready)  # nothing of the zygote's (its pipes) stays open in the child
    os.closerange(ready + 1, 1 << 16)
    if not titled:  # no room for this command line: start it fresh (`ready` closes on exec)
        os.execv(sys.executable, argv)
    os.close(ready)
    code: object = 1
    try:
        import multiprocessing
        import runpy
        import warnings

        multiprocessing.current_process().authkey = os.urandom(32)  # not the zygote's, shared by all
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        # the module was preloaded here; `python -m` runs a second copy as __main__ all the same
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning)
        sys.argv = [module, *args]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    except KeyboardInterrupt:  # as a fresh interpreter: ended by SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as a fresh interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    from phoenixft.runtime.procs import exit_now

    exit_now(code)


def _read_until_eof(fd: int, timeout_s: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
    return out


def _preload(modules: list[str]) -> None:
    """Import `modules` into this image before the fork (its later children have them too); one that fails
    is left to the child, which imports what it needs itself."""
    import importlib

    for m in modules:
        if isinstance(m, str) and m not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(m)


def _serve(parent: int, reply_fd: int) -> int:
    from phoenixft.runtime.procs import die_with_parent

    die_with_parent(signal.SIGKILL, parent)
    set_title([sys.executable, "-m", "phoenixft.runtime.zygote", "--parent", str(parent)])
    out = os.fdopen(reply_fd, "w", buffering=1)

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")

    try:
        import importlib

        for m in PRELOAD:
            importlib.import_module(m)
    except BaseException as e:  # noqa: BLE001 - the launcher starts its processes fresh then
        reply({"fatal": f"preloading failed: {type(e).__name__}: {e}"})
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    reply({"ready": os.getpid()})
    buf = b""
    while True:
        while True:  # reap and report every child that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        try:
            ready, _, _ = select.select([0, wake_r], [], [], 1.0)
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the launching process closed the pipe (or ended): nothing more to start
            return 0
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            rid = None
            try:
                req = json.loads(line)
                rid = req.get("id")
                _preload(req.get("preload") or [])
                rd, wr = os.pipe()
                pid = os.fork()
            except (ValueError, AttributeError, OSError) as e:
                reply({"id": rid, "error": f"{type(e).__name__}: {e}"})
                continue
            if pid == 0:
                os.close(rd)
                _child(req, wr)
            os.close(wr)
            err = _read_until_eof(rd, SETUP_TIMEOUT_S)
            os.close(rd)
            if err.startswith(b"E"):  # it could not set itself up, and exits: reaped here, not reported
                os.waitpid(pid, 0)
                reply({"id": rid, "error": err[1:].decode(errors="replace").strip().splitlines()[-1]})
            else:
                reply({"id": rid, "pid": pid})


# ---------------------------------------------------------------------------- the launcher's side
class Child:
    """A process the zygote forked: the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._z, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None
        from phoenixft.runtime.procs import start_time

        self._start = start_time(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._z._eof:
            from phoenixft.runtime.procs import alive

            # the zygote is gone, so nobody reports this child's exit: it ended once it no longer runs
            if not alive(self.pid, self._start):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            with self._z._cv:
                self._z._cv.wait(timeout=0.05 if left is None else min(0.05, left))
        assert self.returncode is not None
        return self.returncode


# what the interpreter or a native library reads once, at start: a zygote serves only the environment it
# started in (another one is started for another)
_AT_START = ("PYTHON", "OMP_", "MKL_", "GOMP_", "KMP_", "LD_", "MALLOC_", "TORCH_", "CUDA_")


class Zygote:
    _shared: dict[tuple[Any, ...], Zygote] = {}
    _shared_lock = threading.Lock()
    _atexit_pid = 0  # the process that registered `_close_all` (a forked child registers its own)

    @classmethod
    def shared(cls) -> Zygote:
        """This process's zygote for the current environment: started on first use, replaced if it is
        gone; one that no environment uses any more is ended once its children have."""
        key = (os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_AT_START))))
        with cls._shared_lock:
            for k, old in list(cls._shared.items()):
                if k != key and (not old.alive() or not old.busy()):
                    old.close()
                    del cls._shared[k]
            z = cls._shared.get(key)
            if z is None or not z.alive():
                if cls._atexit_pid != os.getpid():
                    cls._atexit_pid = os.getpid()
                    atexit.register(cls._close_all)
                z = cls._shared[key] = cls()
            return z

    @classmethod
    def _close_all(cls) -> None:
        """At this process's exit: end its zygotes and wait for them, so that a launcher leaves no process of
        its own behind once it has exited (left alone, a zygote exits as its request pipe closes: after it)."""
        with cls._shared_lock:
            zygotes = [z for k, z in cls._shared.items() if k[0] == os.getpid()]
            cls._shared.clear()
        for z in zygotes:
            with contextlib.suppress(Exception):
                z.close(timeout_s=2.0)

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._seq = 0
        self._replies: dict[int, dict[str, Any]] = {}  # request id -> the zygote's answer
        self._abandoned: set[int] = set()  # request ids whose spawn gave up waiting
        self._discard: set[int] = set()  # pids of children nobody holds a handle of: their exits are dropped
        self._exits: dict[int, int] = {}  # exits of children not registered yet
        self._children: dict[int, Child] = {}  # running children by pid
        self._wlock = threading.Lock()  # one request written at a time
        self._eof = False
        self._ready = threading.Event()
        self._error: str | None = None
        self._started = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        # the zygote dies with the thread that started it (PR_SET_PDEATHSIG): that is the reader,
        # which lives exactly as long as the zygote does
        self._thread = threading.Thread(target=self._read, name="phoenixft-zygote", daemon=True)
        self._thread.start()
        self._started.wait(timeout=30.0)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ZygoteError(self._error or "not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self._eof and self._error is None

    def busy(self) -> bool:
        """Some child of it still runs (ending it would stop them: they follow it as their parent)."""
        with self._cv:
            return bool(self._children)

    def _read(self) -> None:
        rd, wr = os.pipe()
        try:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "phoenixft.runtime.zygote", "--parent", str(os.getpid()),
                     "--reply-fd", str(wr), "--room=" + "." * ROOM],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, pass_fds=(wr,))
            except OSError as e:
                self._error = f"could not start: {e}"
                return
            finally:
                os.close(wr)
                self._started.set()
            with os.fdopen(rd, "rb") as replies:
                rd = -1
                for line in replies:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    self._handle(msg)
        finally:
            if rd >= 0:
                os.close(rd)
            with self._cv:
                self._eof = True
                self._cv.notify_all()
            self._ready.set()

    def _handle(self, msg: dict[str, Any]) -> None:
        with self._cv:
            if "exit" in msg:
                pid, code = int(msg["exit"]), int(msg["code"])
                child = self._children.pop(pid, None)
                if child is not None:
                    child.returncode = code
                elif pid in self._discard:
                    self._discard.discard(pid)
                else:  # it exited before its handle was registered
                    self._exits[pid] = code
            elif "ready" in msg:
                self._ready.set()
            elif "fatal" in msg:
                self._error = str(msg["fatal"])
                self._ready.set()
            elif "id" in msg:
                rid = msg["id"]
                if rid in self._abandoned:  # nobody waits for it any more: the process must not live on
                    self._abandoned.discard(rid)
                    if "pid" in msg:
                        self._orphan(int(msg["pid"]))
                else:
                    self._replies[rid] = msg
            self._cv.notify_all()

    def _orphan(self, pid: int) -> None:
        """A child whose spawn was given up on (timeout, Ctrl-C): end it, forget its exit."""
        self._discard.add(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def spawn(self, argv: list[str], log: str | os.PathLike[str], env: dict[str, str],
              preload: tuple[str, ...] = ()) -> Child:
        """Fork `python -m argv[0] argv[1:]` (see the module docstring); ZygoteError if it cannot. `preload`:
        modules the zygote imports first, into its own image (a user script's workers need torch's compiler
        stack, which `torch.optim`'s first optimizer imports: seconds of CPU, paid once here)."""
        if not self._ready.wait(timeout=READY_TIMEOUT_S):
            raise ZygoteError(f"not ready after {READY_TIMEOUT_S:g}s")
        if not self.alive():
            raise ZygoteError(self._error or "the zygote exited")
        proc = self.proc
        assert proc is not None and proc.stdin is not None
        with self._cv:
            self._seq += 1
            rid = self._seq
        req = {"id": rid, "argv": argv, "log": str(log), "env": dict(os.environ, **env), "cwd": os.getcwd(),
               "preload": list(preload)}
        msg: dict[str, Any] | None = None
        try:
            with self._wlock:
                proc.stdin.write((json.dumps(req) + "\n").encode())
                proc.stdin.flush()
            deadline = time.monotonic() + SPAWN_TIMEOUT_S + (PRELOAD_TIMEOUT_S if preload else 0.0)
            with self._cv:
                while rid not in self._replies and not self._eof and time.monotonic() < deadline:
                    self._cv.wait(timeout=0.05)
                msg = self._replies.pop(rid, None)
        except OSError as e:
            raise ZygoteError(f"the request could not be sent ({e})") from None
        finally:
            if msg is None:  # given up (a timeout, the zygote gone, or an exception such as Ctrl-C)
                with self._cv:
                    late = self._replies.pop(rid, None)
                    if late is not None and "pid" in late:
                        self._orphan(int(late["pid"]))
                    elif late is None:
                        self._abandoned.add(rid)
        if msg is None:
            raise ZygoteError("the zygote exited" if self._eof else f"no answer within {SPAWN_TIMEOUT_S:g}s")
        if "pid" not in msg:
            raise ZygoteError(str(msg.get("error", msg)))
        child = Child(self, int(msg["pid"]), [sys.executable, "-m", *argv])
        with self._cv:
            if child.pid in self._exits:
                child.returncode = self._exits.pop(child.pid)
            else:
                self._children[child.pid] = child
        return child

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (its children follow the launcher, not it: they keep running)."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m phoenixft.runtime.zygote")
    ap.add_argument("--parent", type=int, required=True, help="die with this process")
    ap.add_argument("--reply-fd", type=int, required=True, help="where to write replies (a pipe)")
    ap.add_argument("--room", default="", help="filler: room for the children's command lines")
    a = ap.parse_args(argv)
    return _serve(a.parent, a.reply_fd)


if __name__ == "__main__":
    from phoenixft.runtime.procs import exit_now

    exit_now(main())
