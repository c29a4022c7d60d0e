"""NCCL's failure behaviour on gloo groups, for CPU tests of the GPU path's ordering.

`PHOENIXFT_DEVICE_MIRROR=nccl` (tests only) makes a CPU worker's training groups (data-parallel,
tensor-parallel, pipeline edges, tied embedding) behave, where a failure is concerned, as torch 2.11's
NCCL groups do with the settings phoenixft uses (distributed/nccl.py):

- `is_completed()` is true once the collective finished or failed (gloo: "Connection closed by peer");
- `wait()` on a failed work first aborts the whole group on the calling thread, then raises (what
  `WorkNCCL::wait()` does);
- `block_current_stream()` never raises; the host waits there (bounded) for the work, since on a CPU the
  host is what reads the result next (on a GPU only the stream waits);
- a reduce leaves the tensors of the ranks other than its root unchanged (gloo's writes into them);
- the group's `abort()` is journaled: the time, the thread, the group, and whether this worker's
  recovery descriptor of that epoch was in the store at that moment.

Each worker appends its journal lines (JSON) to `$PHOENIXFT_NCCL_JOURNAL` when set. The production
path wraps these groups in `NcclGroup` exactly as it wraps ProcessGroupNCCL, so a CPU run goes through
the same polled waits, marks and stream ordering; an abort on the training thread, or one before the
descriptor, shows in the journal.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any

from phoenixft.controlplane import keys

__all__ = ["JOURNAL_ENV", "EmulatedGroup", "EmulatedWork", "read_journal"]

JOURNAL_ENV = "PHOENIXFT_NCCL_JOURNAL"
_EPOCH = re.compile(r"^e(\d+)/")
ORDER_WAIT_S = 60.0  # the longest a CPU "stream order" waits for its work


class EmulatedWork:
    """A gloo work with NCCL's `wait()`; `query()` is the mark (true once it finished without error)."""

    def __init__(self, work: Any, group: EmulatedGroup) -> None:
        self.gloo, self.group = work, group
        self.keep: Any = None  # tensors the work uses, alive as long as it is
        self.error: str | None = None
        self._settled = False

    def _settle(self) -> None:
        if self._settled:
            return
        try:
            self.gloo.wait()  # (complete: returns at once, or raises the error it ended with)
        except RuntimeError as e:
            self.error = str(e).splitlines()[0] if str(e) else "failed"
        self._settled = True

    def is_completed(self) -> bool:
        return bool(self.gloo.is_completed())

    def query(self) -> bool:
        if not self.gloo.is_completed():
            return False
        self._settle()
        return self.error is None

    def wait(self, timeout: Any = None) -> bool:
        self._settle()
        if self.error is not None:
            self.group.abort(why="Work.wait() on a failed work")
            raise RuntimeError(f"NCCL error (emulated): {self.error}")
        return True

    def block_current_stream(self) -> None:
        """On a GPU the stream waits, the host does not; on a CPU the host is what reads the result next, so
        it waits here (bounded; never raises: a failure shows at the next polled wait, as on a GPU)."""
        deadline = time.monotonic() + ORDER_WAIT_S
        nap = 0.00005
        while not self.gloo.is_completed() and time.monotonic() < deadline:
            time.sleep(nap)
            nap = min(2 * nap, 0.001)
        if self.gloo.is_completed():
            self._settle()

    def get_future(self) -> Any:
        return self.gloo.get_future()


class EmulatedGroup:
    """A gloo group standing in for ProcessGroupNCCL: collectives return `EmulatedWork`s; `abort()` is
    journaled. `store` is the group's rendezvous store (its epoch and the job's store are read from it),
    `wid` the worker's id."""

    def __init__(self, pg: Any, store: Any, wid: str) -> None:
        self.pg, self.wid = pg, wid
        prefix = str(getattr(store, "prefix", ""))
        m = _EPOCH.match(prefix)
        self.name = prefix or "?"
        self.epoch = int(m.group(1)) if m else -1
        inner = getattr(store, "inner", store)
        self._root: Any = getattr(inner, "underlying_store", None)
        self.aborted = False

    def _wrap(self, work: Any) -> EmulatedWork:
        return EmulatedWork(work, self)

    def allreduce(self, *a: Any, **kw: Any) -> EmulatedWork:
        return self._wrap(self.pg.allreduce(*a, **kw))

    def reduce(self, tensors: list[Any], opts: Any) -> EmulatedWork:
        """NCCL's reduce leaves a non-root rank's tensor as it was; gloo's uses it as scratch space: a
        non-root rank reduces a copy (kept until the work is dropped)."""
        if self.pg.rank() != opts.rootRank:
            tensors = [t.clone() for t in tensors]
        work = self._wrap(self.pg.reduce(tensors, opts))
        work.keep = tensors
        return work

    def broadcast(self, *a: Any, **kw: Any) -> EmulatedWork:
        return self._wrap(self.pg.broadcast(*a, **kw))

    def _allgather_base(self, *a: Any, **kw: Any) -> EmulatedWork:
        return self._wrap(self.pg._allgather_base(*a, **kw))

    def __getattr__(self, name: str) -> Any:
        if name in ("pg", "wid", "name", "epoch", "_root", "aborted"):  # (not set yet: a half-built object)
            raise AttributeError(name)
        attr = getattr(self.pg, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            out = attr(*a, **kw)
            return self._wrap(out) if hasattr(out, "is_completed") else out

        return call

    def size(self) -> int:
        return int(self.pg.size())

    def rank(self) -> int:
        return int(self.pg.rank())

    def _descriptor_posted(self) -> bool | None:
        if self._root is None or self.epoch < 0:
            return None
        try:
            return bool(self._root.check([keys.desc(self.epoch, self.wid)]))
        except Exception:  # noqa: BLE001 - the store is gone (the run is ending): unknown
            return None

    def abort(self, why: str = "abort()") -> None:
        rec = {"t": time.time(), "thread": threading.current_thread().name, "group": self.name, "epoch": self.epoch,
               "wid": self.wid, "pid": os.getpid(), "why": why, "descriptor_posted": self._descriptor_posted(),
               "again": self.aborted}
        self.aborted = True
        path = os.environ.get(JOURNAL_ENV, "")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        self.pg.abort()


def read_journal(path: str) -> list[dict[str, Any]]:
    """The journal's records (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
