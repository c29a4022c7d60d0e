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
them. A completed abort drops the thread's references: once nothing else refers to them (the
worker's communicators of the next epoch replace the old ones), the groups are freed, their
watchdog threads with them, in whichever thread drops the last reference (after the abort and the
severing, a gloo group's destructor has no op left to wait for).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ABORT_WAIT_S", "Retirement", "abandoned"]

ABORT_WAIT_S = 5.0  # how long a recovery waits for the old epoch's aborts before it abandons them
_lock = threading.Lock()
_abandoned: list[Retirement] = []


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
            for pg in local:
                self._abort(pg)
            if self._sever is not None:
                self._sever()
            del local  # the local groups are released now, even while an NCCL abort below hangs
            for pg in others:
                self._abort(pg)
        finally:
            others.clear()
            self.done.set()

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
