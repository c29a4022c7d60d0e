"""Per-epoch communicators and interruptible waits.

Every recovery opens a new *epoch*; its process groups are built directly under a fresh store
prefix (`e{epoch}/train`, `e{epoch}/repl`) with `ProcessGroupGloo(PrefixStore(...))`: no
`init_process_group`, no process restart. On GPU the same seam builds NCCL groups.

A gloo collective whose peer died raises at once only on the dead peer's neighbours; the others
wait on live peers that have given up. So no wait here is a plain `work.wait()`: `wait_work`
waits in short slices and between them checks an abort condition (the control plane's failure
flag for this epoch), and gives up after a hard timeout. Abandoned groups are kept referenced
(never destroyed while a stuck op may still run inside them) and aborted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.errors import PeerFailure

__all__ = ["EpochComm", "wait_work", "connect_store", "alltoallv"]

POLL = timedelta(milliseconds=20)
_graveyard: list[Any] = []


def connect_store(addr: str, timeout_s: float = 30.0) -> dist.TCPStore:
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def wait_work(work: Any, what: str, abort: Callable[[], str | None], timeout_s: float, poll: bool = False) -> None:
    """Wait for a c10d collective; raise PeerFailure on error, on abort, or after timeout_s.

    Reduce-scatter, all-reduce and all-gather are waited in slices of `work.wait(timeout)`,
    which wakes at once on completion and leaves the work intact when a slice expires. Gloo's
    all-to-all and point-to-point works are killed by an expiring slice (and `abort()` does not
    wake them), so all-to-all (`poll=True`) is polled with `is_completed()` instead; phoenixft
    never uses point-to-point.
    """
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    nap = 0.0002
    while True:
        if poll:
            if work.is_completed():
                try:
                    work.wait()
                    return
                except RuntimeError as e:
                    raise PeerFailure(f"{what}: {str(e).splitlines()[0][:200]}") from None
            time.sleep(nap)
            nap = min(2 * nap, 0.002)
            if time.monotonic() - last < POLL.total_seconds():
                continue
            last = time.monotonic()
        else:
            try:
                work.wait(POLL)
                return
            except RuntimeError as e:
                if work.is_completed():
                    raise PeerFailure(f"{what}: {str(e).splitlines()[0][:200]}") from None
        why = abort()
        if why:
            raise PeerFailure(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"{what}: timed out after {timeout_s:.1f}s")


def alltoallv(pg: Any, world: int, sends: dict[int, torch.Tensor], recv_numel: dict[int, int],
              out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> tuple[Any, torch.Tensor, dict[int, torch.Tensor]]:
    """Targeted transfers as one collective: rank-to-tensor `sends`, and `recv_numel` floats from
    each source. Every rank of the group must call it (with empty dicts if it takes no part).
    Returns (work, output buffer, views of the output per source)."""
    in_splits = [sends[r].numel() if r in sends else 0 for r in range(world)]
    out_splits = [recv_numel.get(r, 0) for r in range(world)]
    parts = [sends[r].reshape(-1) for r in range(world) if r in sends]
    inp = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else torch.empty(0, dtype=dtype))
    total = sum(out_splits)
    if out is None or out.numel() != total:
        out = torch.empty(total, dtype=dtype)
    views: dict[int, torch.Tensor] = {}
    off = 0
    for r in range(world):
        if out_splits[r]:
            views[r] = out[off : off + out_splits[r]]
            off += out_splits[r]
    work = pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
    return work, out, views


class EpochComm:
    """The process groups of one epoch: `train` (gradients, params) and `repl` (replication)."""

    def __init__(self, store: dist.Store, epoch: int, rank: int, world: int, timeout_s: float,
                 backend: str = "gloo") -> None:
        self.epoch, self.rank, self.world = epoch, rank, world
        to = timedelta(seconds=timeout_s)
        if backend != "gloo":
            raise NotImplementedError(f"backend {backend!r}")
        self.train = dist.ProcessGroupGloo(dist.PrefixStore(f"e{epoch}/train", store), rank, world, to)
        self.repl = dist.ProcessGroupGloo(dist.PrefixStore(f"e{epoch}/repl", store), rank, world, to)

    def retire(self) -> None:
        """Abort both groups and keep them referenced: a stuck op may still be running inside."""
        for pg in (self.train, self.repl):
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort on an already broken group
                pass
            _graveyard.append(pg)
