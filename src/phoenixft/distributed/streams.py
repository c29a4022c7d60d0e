"""Waits that order the GPU instead of blocking the host, for collectives only kernels consume.

A tensor-parallel all-reduce's result, or an activation received from the previous pipeline stage,
is read by the next kernels, never by the host. With the polled wait (`comm.wait_work`) the host
stops at each such collective until it completed, so it cannot queue the next kernels meanwhile:
the GPU idles for the launch latency after every one (several per layer). An NCCL work's `order()`
(distributed/nccl.py: torch's `block_current_stream`, never its `wait()`, which would abort the
communicator on this thread if the work failed) instead makes the current CUDA stream wait for the
work and returns at once. `StreamOrdered` waits so and keeps the works it did not see complete; what
stays watched for failures:

- a dead peer: a kernel stuck behind the collective holds every later collective of the stream, so
  the step's next polled wait (a pipeline flush, the gradient buckets, the loss all-reduce on the
  `train` group, which every rank joins) notices the epoch's failure flag as before, and so do the
  failure watcher's hooks before every module's forward and after every gradient. The host reads
  of our own step (the last stage's loss) wait for the stream with the polled wait first
  (`StreamMark`), so they never block on a stuck kernel. A workload that reads a device value on
  the host inside its forward (`.item()`) blocks there until NCCL's own timeout aborts the group.
- an error a work ended with: `settle()` (at the end of every stream-ordered wait, for the works
  complete by then, and by the trainer before the optimizer reads the gradients, for all) waits
  each kept work with the polled wait, which rethrows the work's error as `PeerFailure`: a step
  never commits on the result of a failed collective. Works are kept only until they complete
  (each holds its tensors).

On gloo nothing changes: `stream_ordered` returns the polled wait itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.errors import PeerFailure

__all__ = ["StreamOrdered", "StreamMark", "stream_ordered"]

Wait = Callable[[Any, str], None]


class StreamMark:
    """The work queued on the current CUDA stream of `device` so far, as a work the polled wait takes."""

    def __init__(self, device: torch.device) -> None:
        self.event: Any = None  # (a CPU device queues nothing: complete at once)
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def is_completed(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self, timeout: Any = None) -> bool:
        if self.event is not None:
            self.event.synchronize()  # (called once complete: returns at once)
        return True


class StreamOrdered:
    """A wait for NCCL collectives whose results only kernels read (see the module docstring)."""

    def __init__(self, wait: Wait) -> None:
        self.polled = wait
        self.kept: list[tuple[Any, str]] = []

    def __call__(self, work: Any, what: str) -> None:
        try:
            work.order()  # the current stream waits for the work; the host goes on
        except RuntimeError as e:  # (an error already known: the communicator failed)
            raise PeerFailure(f"{what}: {str(e).splitlines()[0][:200] if str(e) else 'failed'}") from None
        self.kept.append((work, what))
        self.settle(only_completed=True)

    def settle(self, only_completed: bool = False) -> None:
        """Wait every kept work with the polled wait (raising the error one ended with); with
        `only_completed`, only those already complete."""
        keep = []
        for work, what in self.kept:
            if only_completed and not work.is_completed():
                keep.append((work, what))
                continue
            self.polled(work, what)
        self.kept = keep

    def drop(self) -> None:
        """Forget the kept works (a step abandoned by a failure: its epoch is retired)."""
        self.kept = []


def stream_ordered(wait: Wait, backend: str) -> Wait:
    """The wait for collectives only kernels consume: a `StreamOrdered` on NCCL, `wait` itself on gloo."""
    return StreamOrdered(wait) if backend == "nccl" else wait
