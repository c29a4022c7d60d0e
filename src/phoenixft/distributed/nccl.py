"""NCCL process groups behind the device seam: a collective's outcome read without `Work.wait()`.

A survivor must post its recovery descriptor before any of the failed epoch's communicators is aborted
(`ncclCommAbort` can block: distributed/retire.py aborts them on a thread of its own, after the
descriptor, within a bound). Two things in torch would abort earlier, on their own:

- `WorkNCCL::wait()`: when the work has an error, it aborts the communicator on the calling thread (the
  training thread) before it raises. So no NCCL work is ever waited with `wait()` here.
- the NCCL watchdog with `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (`CleanUpOnly`) aborts every communicator
  of a group when a work fails, on its own thread, at a moment of its choosing; a work of an aborted
  communicator then reports completion and no error, so a polled wait would take the output of a failed
  collective for a result. `1` and `3` tear the process down. So the mode is `0` (`NoHandling`): only
  phoenixft aborts, and `new_group` refuses to build an NCCL group in any other mode (it is read when the
  group is built).

What is read instead (`NcclWork`), with `0`: `Work.is_completed()` is true once the work's kernel finished
or once NCCL reported an error on the communicator (torch then records the error on the work without
aborting anything); a *mark* tells the two apart: an event recorded on a stream of our own after that
stream was ordered behind the work (`block_current_stream`: documented by torch to return at once and
only order the stream). The mark completes only if the work's kernel finished; a kernel waiting on a dead
peer never finishes before an abort, and with `0` nobody but phoenixft aborts (after it stopped looking).
So: mark complete -> done; `is_completed()` true and the mark still incomplete after `GRACE_S` -> failed
(`RuntimeError`, which the polled wait turns into `PeerFailure`). Ordering the compute stream behind a
work (`order()`, for results only kernels read) is `block_current_stream()` too, never `wait()`.

The C++ behaviour this rests on (what `wait()`, the watchdog and `isCompleted()` do in torch 2.11) was
not readable where this was written: docs/gpu.md lists it as unverified until bench/gpu_check.sh has run.
`phoenixft.distributed.nccl_emulation` puts the same contract on gloo groups, so that a CPU run goes
through this code (`PHOENIXFT_DEVICE_MIRROR=nccl`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["GRACE_S", "HANDLING_ENV", "HANDLING_MODE", "Mark", "NcclGroup", "NcclWork", "check_handling_mode"]

GRACE_S = 0.25  # after is_completed(): how long a finished kernel's mark may take to complete
HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # torch reads them in this order
HANDLING_MODE = "0"


class Mark(Protocol):
    """Completes once the work it was made for finished (a CUDA event; the emulation's own probe)."""

    def query(self) -> bool: ...


def check_handling_mode(env: Any = None) -> None:
    """RuntimeError unless NCCL's async error handling is `0` in `env` (default os.environ), as torch
    reads it when a group is built (the first of `HANDLING_ENV` that is set; torch's default is 3)."""
    env = os.environ if env is None else env
    for name in HANDLING_ENV:
        if name in env:
            if env[name] == HANDLING_MODE:
                return
            raise RuntimeError(f"{name}={env[name]}: NCCL groups are built only with {name}={HANDLING_MODE} "
                               "(1 and 3 tear the process down when a peer dies; 2 aborts the communicators "
                               "from the watchdog before the survivor posts its recovery descriptor)")
    raise RuntimeError(f"{HANDLING_ENV[0]} is not set (torch's default, 3, tears the process down when a peer "
                       f"dies): NCCL groups are built only with {HANDLING_ENV[0]}={HANDLING_MODE}")


class NcclWork:
    """One NCCL work: `is_completed()` (done or failed, never blocking, never aborting), `wait(timeout)`
    (polls until then; raises RuntimeError if it failed; else orders the current stream behind it),
    `order()` (the current stream waits for it, the host does not), `failed`."""

    __slots__ = ("work", "_make_mark", "_mark", "_state", "_flagged_at", "timeout_s")

    def __init__(self, work: Any, make_mark: Callable[[Any], Mark], timeout_s: float) -> None:
        self.work = work
        self._make_mark = make_mark
        self._mark: Mark | None = None
        self._state = ""  # "", "done" or "failed"
        self._flagged_at = 0.0  # when is_completed() first said true while the mark had not completed
        self.timeout_s = timeout_s

    @property
    def failed(self) -> bool:
        return self._state == "failed"

    def is_completed(self) -> bool:
        if not self._state:
            self._state = self._poll()
        return bool(self._state)

    def _poll(self) -> str:
        if self._mark is None:
            try:
                self._mark = self._make_mark(self.work)
            except RuntimeError:  # (ordering a stream behind a work torch already knows failed)
                return "failed"
        if self._mark.query():
            return "done"
        if not self.work.is_completed():  # (true on a finished kernel or an error NCCL reported)
            return ""
        now = time.monotonic()
        if not self._flagged_at:
            self._flagged_at = now
        if self._mark.query():
            return "done"
        return "failed" if now - self._flagged_at >= GRACE_S else ""

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = timeout.total_seconds() if timeout is not None and timeout.total_seconds() > 0 else self.timeout_s
        deadline = time.monotonic() + limit
        nap = 0.00005
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"NCCL work not complete after {limit:.1f}s")
            time.sleep(nap)
            nap = min(2 * nap, 0.001)
        self.order()
        return True

    def order(self) -> None:
        """The current stream waits for this work; the host goes on (RuntimeError if it is known failed)."""
        if self._state == "failed":
            raise RuntimeError("NCCL reported an error on the communicator (a peer died or its connection "
                               "failed): the collective did not complete")
        self.work.block_current_stream()

    def get_future(self) -> Any:
        return self.work.get_future()


class NcclGroup:
    """A `ProcessGroupNCCL` (or the emulation's stand-in) whose works are `NcclWork`s; everything else
    (`size`, `rank`, `abort`, ...) is the group's own."""

    def __init__(self, pg: Any, make_mark: Callable[[Any], Mark], timeout_s: float) -> None:
        self.pg = pg
        self._make_mark = make_mark
        self.timeout_s = timeout_s

    def _wrap(self, work: Any) -> Any:
        if isinstance(work, dist.Work) or hasattr(work, "block_current_stream"):
            return NcclWork(work, self._make_mark, self.timeout_s)
        return work

    def allreduce(self, *a: Any, **kw: Any) -> NcclWork:
        return self._wrap(self.pg.allreduce(*a, **kw))

    def reduce(self, *a: Any, **kw: Any) -> NcclWork:
        return self._wrap(self.pg.reduce(*a, **kw))

    def broadcast(self, *a: Any, **kw: Any) -> NcclWork:
        return self._wrap(self.pg.broadcast(*a, **kw))

    def _allgather_base(self, *a: Any, **kw: Any) -> NcclWork:
        return self._wrap(self.pg._allgather_base(*a, **kw))

    def abort(self) -> None:
        self.pg.abort()

    def size(self) -> int:
        return int(self.pg.size())

    def rank(self) -> int:
        return int(self.pg.rank())

    def __getattr__(self, name: str) -> Any:
        if name in ("pg", "_make_mark", "timeout_s"):  # (not set yet: a half-built object)
            raise AttributeError(name)
        attr = getattr(self.pg, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            return self._wrap(attr(*a, **kw))

        return call
