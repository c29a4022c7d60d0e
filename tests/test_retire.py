"""Retiring an epoch's process groups: the survivor posts its descriptor before any abort, an abort that
blocks is bounded (and abandoned past its bound), a half-built epoch aborts what it built, and
retired groups are released."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import phoenixft.distributed.comm as comm_mod
from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.keeper import Keeper
from phoenixft.distributed import retire
from phoenixft.distributed.comm import EpochComm
from phoenixft.errors import RunAborted
from phoenixft.runtime.worker import Worker


class _BlockingGroup:
    """An NCCL-like group whose abort() blocks (as ncclCommAbort can, up to the group's timeout)."""

    def __init__(self, log: list[tuple[str, float]]) -> None:
        self.log = log
        self.release = threading.Event()

    def abort(self) -> None:
        self.log.append(("abort started", time.monotonic()))
        self.release.wait(30.0)
        self.log.append(("abort returned", time.monotonic()))


class _Recorded:
    """A real group, its abort() recorded."""

    def __init__(self, pg: Any, log: list[str], name: str) -> None:
        self.pg, self.log, self.name = pg, log, name

    def abort(self) -> None:
        self.log.append(self.name)
        self.pg.abort()


class _Store:
    def __init__(self, log: list[tuple[str, float]]) -> None:
        self.log = log
        sealed.bind("t" * 32, "rid")  # (what a worker writes is sealed with its run key)

    def check(self, names: list[str]) -> bool:
        return False

    def set(self, key: str, value: str) -> None:
        self.log.append((f"set {key}", time.monotonic()))

    def multi_set(self, names: list[str], values: list[bytes]) -> None:
        for key in names:
            self.set(key, "")

    def add(self, key: str, n: int) -> int:
        self.log.append((f"add {key}", time.monotonic()))
        return 1


def _survivor(comm: EpochComm, log: list[tuple[str, float]]) -> Worker:
    """A worker reduced to what `recover` touches; the next epoch never comes (its wait raises)."""
    w = Worker.__new__(Worker)
    w.node_id, w.wid = "n0", "n0.0"
    w.cfg = types.SimpleNamespace(next_epoch_wait_s=1.0)
    w.watcher = types.SimpleNamespace(disarm=lambda: None)
    desc = types.SimpleNamespace(to_json=lambda: {"wid": "n0.0"})
    w.protection = types.SimpleNamespace(repl=None, descriptor=lambda err, t: desc)
    w.ctx = types.SimpleNamespace(epoch=0, store=_Store(log), comm=comm)
    w.keeper = Keeper(w.ctx.store)  # (not started: what it puts is written at once, nothing is put back)

    def no_next_epoch(key: str, timeout_s: float) -> bytes:
        log.append(("waits for the next epoch", time.monotonic()))
        raise RunAborted("test: no next epoch")

    w._wait_key = no_next_epoch  # type: ignore[method-assign]
    return w


def test_descriptor_posted_before_a_blocking_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retire, "ABORT_WAIT_S", 0.5)
    log: list[tuple[str, float]] = []
    comm = EpochComm(dist.HashStore(), 0, 0, 1, 30.0)
    stuck = _BlockingGroup(log)
    comm._groups.append(("nccl", stuck))
    train = weakref.ref(comm.train)
    w = _survivor(comm, log)
    t0 = time.monotonic()
    try:
        with pytest.raises(RunAborted):
            w.recover("peer lost")
        took = time.monotonic() - t0
        until = time.monotonic() + 10.0  # (on a loaded machine the abort thread may start late)
        while "abort started" not in [n for n, _ in log] and time.monotonic() < until:
            time.sleep(0.01)
        names = [n for n, _ in log]
        first_abort = names.index("abort started")
        assert names.index(f"set {keys.desc(0, 'n0.0')}") < first_abort, names
        assert names.index(f"set {keys.desc_posted(0)}") < first_abort, names
        assert took < 3.0, f"the recovery waited {took:.1f}s on a blocked abort (bound 0.5s)"
        assert "abort returned" not in names  # it is still blocked: abandoned, and the worker went on
        assert w.ctx.comm is None
        assert "e0" in retire.abandoned()
        del comm
        gc.collect()
        _released([train], "a gloo group stayed alive while an NCCL abort of its epoch hung")
    finally:
        stuck.release.set()
    deadline = time.monotonic() + 10.0
    while "e0" in retire.abandoned() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "e0" not in retire.abandoned(), "a completed abort is still listed as abandoned"


def test_a_build_failing_on_its_third_group_aborts_the_first_two(monkeypatch: pytest.MonkeyPatch) -> None:
    aborted: list[str] = []
    built: list[weakref.ref[Any]] = []
    real_new_group = comm_mod.Device.new_group

    def recorded_group(self: Any, backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        pg = real_new_group(self, backend, store, rank, size, timeout)
        built.append(weakref.ref(pg))
        return _Recorded(pg, aborted, f"group {len(built)}")

    def third_fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("rendezvous of the third group failed")

    monkeypatch.setattr(comm_mod.Device, "new_group", recorded_group)
    monkeypatch.setattr(comm_mod, "gloo_group", third_fails)  # the transfer group is the third
    try:
        EpochComm(dist.HashStore(), 0, 0, 1, 30.0, transfer_members=[0])
    except RuntimeError as e:
        assert "third group" in str(e)
    else:
        raise AssertionError("the build did not fail")
    assert aborted == ["group 1", "group 2"]
    gc.collect()
    assert len(built) == 2
    _released(built, "the groups of a failed build were kept")


def test_retired_groups_are_released() -> None:
    comm = EpochComm(dist.HashStore(), 0, 0, 1, 30.0)
    refs = [weakref.ref(comm.train), weakref.ref(comm.repl)]
    assert comm.retire() is True
    assert comm.retire() is True  # a second retire does nothing
    assert comm.retirement is not None and comm.retirement.done.is_set() and not comm.retirement.errors
    del comm
    gc.collect()
    _released(refs, "retired groups are still referenced")


def _released(refs: list[weakref.ref[Any]], why: str, timeout_s: float = 10.0) -> None:
    """Every one of `refs` freed within `timeout_s` (the reaper frees them once it holds the last reference)."""
    deadline = time.monotonic() + timeout_s
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r() is None for r in refs), why


class _SlowToFree:
    """A group whose destructor blocks (a gloo group's joins its worker threads, one of which may still be
    inside an op of the failed step until the group's timeout); it records the thread it ran on."""

    freed_on: list[str] = []

    def abort(self) -> None:
        pass

    def __del__(self) -> None:
        time.sleep(1.0)
        self.freed_on.append(threading.current_thread().name)


def test_the_last_reference_to_a_retired_group_is_dropped_off_the_training_thread() -> None:
    """The training thread keeps references to the failed epoch's groups past the retirement (the closures
    and works of the abandoned step, until the next step replaces them). When it drops the last one, the
    destructor must not run on it: a stalled first step after a hot swap would cost up to the collective
    timeout."""
    _SlowToFree.freed_on.clear()
    group = _SlowToFree()
    r = retire.Retirement("e7", [("gloo", group)])
    assert r.wait(5.0)
    t0 = time.monotonic()
    del group  # the training thread's last reference: the reaper holds the group until now
    took = time.monotonic() - t0
    assert took < 0.5, f"dropping a retired group took the training thread {took:.1f}s"
    deadline = time.monotonic() + 10.0
    while not _SlowToFree.freed_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _SlowToFree.freed_on == ["phoenixft-reaper"]


_TWO_RANKS_THEN_EXIT = """
import datetime, sys, threading
import torch, torch.distributed as dist
from phoenixft.distributed.comm import EpochComm
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
got = {}
def rank(r):
    c = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    comm = EpochComm(c, 0, r, 2, 10.0)
    t = torch.ones(3) * (r + 1)
    comm.train.allreduce([t]).wait()
    got[r] = t.tolist()
    comm.retire()
ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
assert got == {0: [3.0] * 3, 1: [3.0] * 3}, got
"""


def test_a_process_that_exits_while_the_reaper_frees_groups_exits_cleanly() -> None:
    """Two ranks retire their groups and the interpreter exits at once, while the reaper is freeing them: it
    waits for the destructor in progress, so the process exits 0 rather than aborting ("terminate called
    without an active exception")."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _TWO_RANKS_THEN_EXIT], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": src})
        assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])
