"""The stream-ordered wait of NCCL collectives only kernels consume (distributed/streams.py), with fake works:
it never waits on the host, it checks every work's outcome with the polled wait once complete, and a
failed work stops the step before its gradients are used; gloo keeps the polled wait."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from phoenixft.distributed.comm import wait_work
from phoenixft.distributed.device import Device
from phoenixft.distributed.streams import StreamOrdered, stream_ordered
from phoenixft.errors import PeerFailure


class _Work:
    """An NCCL work as the device seam hands it out (distributed/nccl.py's `NcclWork`): `order()` orders the
    stream (returns at once, recorded); `wait()`, once complete, returns or raises the error it ended with."""

    def __init__(self, error: str | None = None) -> None:
        self.done, self.error = False, error
        self.stream_waits = self.host_waits = 0

    def is_completed(self) -> bool:
        return self.done

    def order(self) -> None:
        self.stream_waits += 1

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.host_waits += 1
        if self.error:
            raise RuntimeError(self.error)
        return True


def _polled(work: Any, what: str) -> None:
    wait_work(work, what, lambda: None, 5.0)


def test_gloo_keeps_the_polled_wait() -> None:
    assert stream_ordered(_polled, "gloo") is _polled
    assert isinstance(stream_ordered(_polled, "nccl"), StreamOrdered)


def test_stream_ordered_wait_never_blocks_the_host_and_settles_each_work() -> None:
    w = StreamOrdered(_polled)
    a, b = _Work(), _Work()
    w(a, "tensor-parallel partial sums")
    assert (a.stream_waits, a.host_waits) == (1, 0) and w.kept == [(a, "tensor-parallel partial sums")]
    a.done = True
    w(b, "activation of microbatch 0")  # a completed meanwhile: its outcome is checked now; b is kept
    assert a.host_waits == 1 and b.host_waits == 0 and [x for x, _ in w.kept] == [b]
    b.done = True
    w.settle()
    assert b.host_waits == 1 and w.kept == []


def test_a_failed_collective_stops_the_step_when_settled() -> None:
    w = StreamOrdered(_polled)
    bad = _Work(error="NCCL error: remote process exited")
    w(bad, "tensor-parallel input gradient")
    bad.done = True
    with pytest.raises(PeerFailure, match="tensor-parallel input gradient: NCCL error"):
        w.settle()


def test_an_error_known_at_the_wait_is_a_peer_failure() -> None:
    class _Aborted(_Work):
        def order(self) -> None:
            raise RuntimeError("NCCL communicator was aborted")

    with pytest.raises(PeerFailure, match="communicator was aborted"):
        StreamOrdered(_polled)(_Aborted(), "tensor-parallel partial sums")


def test_the_trainer_waits_stream_ordered_only_on_nccl() -> None:
    from phoenixft.config import RunConfig
    from phoenixft.parallel.stage import WholeModel
    from phoenixft.train.trainer import Trainer
    from phoenixft.workload import WorkloadContext, load_workload

    class _NcclLike(Device):
        @property
        def backend(self) -> str:
            return "nccl"

    cfg = RunConfig(nodes=1, steps=1, spares=0, device="cpu")
    wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
    plain = Trainer(cfg, wl, WholeModel(wl.build_model(), wl.loss))
    assert plain.device_wait(_polled) is _polled and plain._ordered is None
    nccl = Trainer(cfg, wl, WholeModel(wl.build_model(), wl.loss), device=_NcclLike("cpu"))
    first = nccl.device_wait(_polled)
    assert isinstance(first, StreamOrdered) and nccl._ordered is first
    assert nccl.device_wait(_polled) is not first  # each epoch binds a fresh one
