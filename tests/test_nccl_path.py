"""The NCCL failure path, checked on CPU through the device seam: an NCCL work's outcome is read without
torch's `WorkNCCL::wait()` (which aborts the communicator on the calling thread when the work failed),
only NCCL's async error handling mode 0 is accepted, and a real hot-swap with a peer SIGKILLed mid-
collective, on groups with NCCL's failure behaviour (`PHOENIXFT_DEVICE_MIRROR=nccl`,
distributed/nccl_emulation.py), aborts the failed epoch's groups only after the survivor posted its
descriptor, on the retirement's thread, and ends bitwise equal to the failure-free run."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_hotswap, run

from phoenixft.distributed import nccl
from phoenixft.distributed.comm import wait_work
from phoenixft.distributed.cuda_timing import COUNT, SKIP, CopyTiming
from phoenixft.distributed.nccl import NcclGroup, NcclWork, check_handling_mode
from phoenixft.distributed.nccl_emulation import JOURNAL_ENV, read_journal
from phoenixft.distributed.streams import StreamOrdered
from phoenixft.errors import PeerFailure


class _Raw:
    """A torch NCCL work as torch 2.11 behaves with TORCH_NCCL_ASYNC_ERROR_HANDLING=0: `is_completed()` true
    once finished or once NCCL reported an error; `wait()` would abort the communicator (must never run)."""

    def __init__(self) -> None:
        self.finished = False  # the kernel finished (the mark completes)
        self.error = False  # NCCL reported an error on the communicator
        self.ordered = 0

    def is_completed(self) -> bool:
        return self.finished or self.error

    def wait(self, timeout: Any = None) -> bool:
        raise AssertionError("WorkNCCL::wait() called: it aborts the communicator on this thread")

    def block_current_stream(self) -> None:
        self.ordered += 1


class _Mark:
    def __init__(self, raw: _Raw, lag_s: float = 0.0) -> None:
        self.raw, self.lag_s, self.since = raw, lag_s, 0.0

    def query(self) -> bool:  # completes `lag_s` after the kernel finished (the mark stream's own delay)
        if not self.raw.finished:
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= self.lag_s


def _work(lag_s: float = 0.0) -> tuple[_Raw, NcclWork]:
    raw = _Raw()
    return raw, NcclWork(raw, lambda w: _Mark(w, lag_s), 5.0)


def test_a_finished_work_is_done_and_orders_the_stream_without_wait() -> None:
    raw, w = _work()
    assert not w.is_completed()
    raw.finished = True
    assert w.is_completed() and not w.failed
    wait_work(w, "allreduce", lambda: None, 5.0)
    assert raw.ordered == 1


def test_an_error_on_the_communicator_fails_the_work_without_aborting_it() -> None:
    raw, w = _work()
    raw.error = True  # the kernel waits on a dead peer: it never finishes before an abort
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="gradient reduction: NCCL reported an error on the communicator"):
        wait_work(w, "gradient reduction", lambda: None, 5.0)
    took = time.monotonic() - t0
    assert nccl.GRACE_S <= took < nccl.GRACE_S + 1.0, took
    assert w.failed and raw.ordered == 0  # (and _Raw.wait, which aborts, never ran)
    with pytest.raises(RuntimeError, match="did not complete"):
        w.order()


def test_a_kernel_that_finishes_while_is_completed_already_says_so_is_done() -> None:
    """is_completed() true from the kernel's own end event, the mark a little later (its stream's delay):
    done, not failed."""
    raw, w = _work(lag_s=0.05)
    raw.finished = True
    wait_work(w, "all-gather", lambda: None, 5.0)
    assert not w.failed and raw.ordered == 1


def test_the_control_plane_flag_ends_a_wait_on_a_silent_dead_peer() -> None:
    """Within a host NCCL may report nothing while the kernel spins: the failure flag ends the wait."""
    raw, w = _work()
    with pytest.raises(PeerFailure, match="broadcast: recovery requested"):
        wait_work(w, "broadcast", lambda: "recovery requested", 5.0)
    assert raw.ordered == 0


def test_wait_with_a_timeout_polls_and_gives_up() -> None:
    raw, w = _work()
    with pytest.raises(RuntimeError, match="not complete after 0.2s"):
        w.wait(timedelta(seconds=0.2))
    raw.finished = True
    assert w.wait() and raw.ordered == 1


def test_stream_ordered_waits_order_the_stream_and_settle_through_the_polled_wait() -> None:
    polled: list[str] = []
    s = StreamOrdered(lambda w, what: (polled.append(what), wait_work(w, what, lambda: None, 5.0)))
    raw, w = _work()
    s(w, "tensor-parallel all-reduce")
    assert raw.ordered == 1 and len(s.kept) == 1 and polled == []  # not complete: kept, the host went on
    raw.error = True
    with pytest.raises(PeerFailure, match="NCCL reported an error"):
        s.settle()
    assert polled == ["tensor-parallel all-reduce"]


def test_the_group_wraps_every_work_and_passes_the_rest_through() -> None:
    class Pg:
        def __init__(self) -> None:
            self.aborted = False

        def allreduce(self, t: Any) -> _Raw:
            return _Raw()

        def alltoall_base(self, *a: Any) -> _Raw:
            return _Raw()

        def size(self) -> int:
            return 4

        def name(self) -> str:
            return "NCCL"

        def abort(self) -> None:
            self.aborted = True

    pg = Pg()
    g = NcclGroup(pg, lambda w: _Mark(w), 7.0)
    assert isinstance(g.allreduce([1]), NcclWork) and isinstance(g.alltoall_base(1, 2), NcclWork)
    assert g.allreduce([1]).timeout_s == 7.0
    assert g.size() == 4 and g.name() == "NCCL"
    g.abort()
    assert pg.aborted


@pytest.mark.parametrize(("env", "ok"), [
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, True),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_ASYNC_ERROR_HANDLING": "3"}, True),  # torch reads the first
    ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, True),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, False),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, False),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, False),
    ({}, False),  # torch's default is 3
])
def test_only_handling_mode_0_builds_nccl_groups(env: dict[str, str], ok: bool) -> None:
    if ok:
        check_handling_mode(env)
        return
    with pytest.raises(RuntimeError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING") as e:
        check_handling_mode(env)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- copy timing
class _Event:
    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: _Event) -> float:
        return other.t - self.t


def test_copy_timing_writes_the_timed_copies_once_their_events_completed(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "timing.jsonl"
    timing = CopyTiming(str(path), "n0.0")
    dst = torch.zeros(1000)
    lagging: list[_Event] = []
    for n in range(SKIP + COUNT + 2):
        timed = timing.measures()
        assert timing.times_ready() == (SKIP <= n <= SKIP + COUNT)
        base = 100.0 * n
        ready = _Event(base, done=n != SKIP + COUNT)  # the event after the last timed copy: not complete yet
        if not ready.done:
            lagging.append(ready)
        start, end = (_Event(base + 1.0), _Event(base + 3.0)) if timed else (None, _Event(base + 3.0))
        timing.copied(ready, start, end, dst)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["copy"] for r in recs] == list(range(SKIP, SKIP + COUNT - 1))  # the last waits for its event
    r = recs[0]
    assert r["copy_ms"] == 2.0 and r["wait_ms"] == 1.0 and r["step_ms"] == 100.0 and r["end_ms"] == 3.0
    assert r["overlapped"] and r["bytes"] == 4000 and r["pinned"] is False and r["wid"] == "n0.0"
    lagging[0].done = True
    assert timing.flush() == 1
    assert len(path.read_text().splitlines()) == COUNT


# ---------------------------------------------------------------------------------------------- a real hot-swap
@pytest.mark.parametrize(("layout", "dead"), [
    ({"nodes": 2, "workers_per_node": 2, "tp": 2}, "tensor-parallel pairs, data-parallel reduce in flight"),
    ({"nodes": 4, "workers_per_node": 1, "pp": 2}, "pipeline stages, a stage's receive in flight"),
])
def test_a_peer_killed_mid_collective_is_recovered_with_the_descriptor_before_any_abort(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: dict[str, int], dead: str) -> None:
    """Node 1 SIGKILLed as its backward begins (its peers are in, or about to enter, collectives with it),
    every training group with NCCL's failure behaviour: recovered by a hot-swap, bitwise equal to the
    failure-free run; every abort of the failed epoch's groups ran on the retirement's thread, after that
    worker's descriptor was in the store (an abort from a `wait()` on the training thread would show)."""
    monkeypatch.setenv("PHOENIXFT_DEVICE_MIRROR", "nccl")
    ref = run(tmp_path / "ref", **layout, steps=6, protect="none", spares=0)
    journal = tmp_path / "journal.jsonl"
    monkeypatch.setenv(JOURNAL_ENV, str(journal))
    rep = run(tmp_path / "kill", **layout, steps=6, spares=1, inject=["kill:node=1@step=4,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert_one_hotswap(rep, ["n1"], 4)
    assert rep["final_state_sha256"] == ref["final_state_sha256"], dead
    aborts = read_journal(str(journal))
    survivors = {f"{n}.{i}" for n in ("n0", "n2", "n3") if n in [f"n{k}" for k in range(layout["nodes"])]
                 for i in range(layout["workers_per_node"])}
    failed_epoch = [a for a in aborts if a["epoch"] == 0]
    assert {a["wid"] for a in failed_epoch} == survivors, aborts  # every survivor aborted its epoch-0 groups
    for a in aborts:
        assert a["thread"].startswith("phoenixft-abort-e"), a  # the retirement's thread, never the training one
        assert a["why"] == "abort()" and a["descriptor_posted"] is True, a


def test_a_work_torch_refuses_to_order_is_failed_not_raised_from_the_poll() -> None:
    class Refusing(_Raw):
        def block_current_stream(self) -> None:
            raise RuntimeError("NCCL communicator was aborted")

    w = NcclWork(Refusing(), lambda raw: (raw.block_current_stream(), _Mark(raw))[1], 5.0)
    assert w.is_completed() and w.failed
    with pytest.raises(PeerFailure, match="NCCL reported an error"):
        wait_work(w, "reduce", lambda: None, 5.0)
