"""Aborting an epoch's process groups on a thread of its own, within a bound.

A recovery aborts the process groups of the failed epoch. Gloo's `abort()` returns at once; an
NCCL abort (`ncclCommAbort`) can block until the group's timeout (a kernel spinning on a dead peer
inside one host, or NCCL 2.25.1's abort hang). A survivor must never be held that long: the
coordinator gathers every survivor's descriptor within its failure timeout and fences the ones that
did not post. So the worker posts its descriptor first, then retires the epoch: `Retirement` runs
the aborts on a daemon thread, local (gloo) groups first, then the severing of their sockets, then
the NCCL groups, and the caller joins that thread with a deadline.

An abort that does not return by the deadline is *abandoned*: the worker goes on to the next epoch
(its new groups are built on a new store prefix, and NCCL communicators are independent of each
other), while the abandoned thread keeps the old groups referenced (their communicators, device
buffers and watchdog threads stay allocated) until the abort returns, when they are released, or
until the process exits (the thread is a daemon: it never holds the exit up). `abandoned()` lists
them.

A completed abort hands the groups to the reaper, a daemon thread that keeps them until it holds the
last reference, and then frees them itself. A group's destructor joins its worker threads, and a
gloo worker thread can still be inside an op of the failed step until the group's timeout, even after
the abort and the severing. The training thread also drops references late: the closures and works of
a step abandoned by the failure are dropped when the next step replaces them. If the training thread
dropped the last reference, its next step would stall for up to the collective timeout (60 s at
least). The reaper pays that wait on a thread of its own.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ABORT_WAIT_S", "Retirement", "abandoned", "reap", "reaping"]

ABORT_WAIT_S = 5.0  # how long a recovery waits for the old epoch's aborts before it abandons them
_lock = threading.Lock()
_abandoned: list[Retirement] = []


class _Reaper:
    """Keeps objects until it holds their last reference, then drops them on its own daemon thread (which
    runs while it holds any, and ends when it holds none)."""

    NAP_S = (0.01, 0.25)  # the first and the longest nap between two looks at the references

    def __init__(self) -> None:
        self._held: list[Any] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._freeing = False  # the thread is inside destructors (outside the lock)
        self._stopping = False  # the interpreter exits: free nothing more

    def hold(self, objs: Iterable[Any]) -> None:
        with self._cv:
            self._held.extend(objs)
            if self._held and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="phoenixft-reaper", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def count(self) -> int:
        with self._cv:
            return len(self._held)

    def at_exit(self, timeout_s: float = 10.0) -> None:
        """The interpreter exits: let a destructor in progress finish (bounded), then free nothing more (what
        is still held goes with the interpreter's own teardown, on the main thread). A process that exited
        while this thread was inside a group's destructor would abort ("terminate called without an active
        exception": the group's threads destroyed while joinable)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._freeing, timeout=timeout_s)

    def _run(self) -> None:
        nap = self.NAP_S[0]
        while True:
            with self._cv:
                if self._stopping:
                    self._thread = None
                    return
                # 2 references: the list's and getrefcount's argument (nobody else holds it)
                last = {i for i in range(len(self._held)) if sys.getrefcount(self._held[i]) <= 2}
                if last:
                    free = [self._held[i] for i in sorted(last)]
                    self._held = [self._held[i] for i in range(len(self._held)) if i not in last]
                    self._freeing = True
                elif not self._held:
                    self._thread = None
                    return
                else:
                    self._cv.wait(nap)
                    nap = min(2 * nap, self.NAP_S[1])
                    continue
            nap = self.NAP_S[0]
            free.clear()  # the destructors run here, outside the lock: a blocking one holds up nobody
            with self._cv:
                self._freeing = False
                self._cv.notify_all()


_reaper = _Reaper()
atexit.register(_reaper.at_exit)


def _after_fork_in_child() -> None:
    """A child forked while the reaper ran has no such thread (it starts its own), and the lock may have been
    held by it at the fork: both start afresh (the parent's objects stay held)."""
    _reaper._cv = threading.Condition()
    _reaper._thread, _reaper._freeing = None, False


os.register_at_fork(after_in_child=_after_fork_in_child)


def reap(objs: Iterable[Any]) -> None:
    """Free `objs` on the reaper's thread, once nothing else refers to them (see the module docstring)."""
    _reaper.hold(objs)


def reaping() -> int:
    """How many objects the reaper still holds (another holder still refers to them, or it has not looked)."""
    return _reaper.count()


def abandoned() -> list[str]:
    """The retirements whose aborts did not return within their bound and still run."""
    with _lock:
        _abandoned[:] = [r for r in _abandoned if not r.done.is_set()]
        return [r.name for r in _abandoned]


class Retirement:
    """The abort of `groups` ((kind, group) pairs: "gloo" groups first, then `sever()`, then the others),
    started at once on a daemon thread; `wait(timeout_s)` joins it with a deadline."""

    def __init__(self, name: str, groups: list[tuple[str, Any]], sever: Callable[[], object] | None = None) -> None:
        self.name = name
        self.errors: list[str] = []
        self.done = threading.Event()
        self._groups = list(groups)
        self._sever = sever
        self._t = threading.Thread(target=self._run, name=f"phoenixft-abort-{name}", daemon=True)
        self._t.start()

    def _run(self) -> None:
        local = [pg for kind, pg in self._groups if kind == "gloo"]
        others = [pg for kind, pg in self._groups if kind != "gloo"]
        self._groups = []  # from here on the thread's lists are the only references this object holds
        try:
            self._abort_all(local)
            if self._sever is not None:
                self._sever()
            reap(local)  # the local groups are released now, even while an NCCL abort below hangs
            del local
            self._abort_all(others)
        finally:
            reap(others)
            others.clear()
            self.done.set()

    def _abort_all(self, pgs: list[Any]) -> None:
        for pg in pgs:  # (the loop's name goes with this frame: no reference to a group outlives the call)
            self._abort(pg)

    def _abort(self, pg: Any) -> None:
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - best effort on an already broken group
            self.errors.append(f"{type(e).__name__}: {str(e)[:120]}")

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once every abort returned; False after `timeout_s` (default `ABORT_WAIT_S`; the retirement
        is then abandoned: it keeps running, and its groups stay referenced by its thread until their
        aborts return)."""
        if self.done.wait(max(0.0, ABORT_WAIT_S if timeout_s is None else timeout_s)):
            return True
        with _lock:
            if self not in _abandoned:
                _abandoned.append(self)
        return False
