"""A gradient sum whose bits do not depend on how the gradients were bucketed: every element summed in rank order.

gloo's ring all-reduce splits a bucket into one chunk per rank and starts each chunk's sum at another rank, so
the order an element is summed in depends on where in its bucket it lies. DistributedDataParallel reduces its
first iteration in one bucket and every later one in the buckets it rebuilt from the gradients' order; a DDP
built anew after a recovery therefore sums the first step after it in another order than the failure-free run
summed that step, and with three ranks or more (a + b is b + a; (a + b) + c is not a + (b + c)) the run
drifts from it in the last bits.

`OrderedReducer` sums each bucket as the built-in trainer reduces its gradients: an all-to-all hands every
rank its slice of every rank's bucket, the rank adds the slices in rank order (((g0 + g1) + g2) + ...), and
an all-gather returns the sums. It moves as many bytes as a ring all-reduce (twice (W-1)/W of the bucket),
and the result is the same whatever the bucket layout (with two ranks the all-reduce itself is used: a + b
is b + a), so a recovered run ends bitwise equal to the failure-free one at any data-parallel width.
Buckets are reduced in the order DDP hands them over, on one thread of the job's (so every rank posts the
same collectives in the same order, and backward computes on meanwhile); a failure of a collective fails
the bucket's future, which DDP raises at the end of backward.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["OrderedReducer", "reduce_in_rank_order"]

Wait = Callable[[Any, str], None]


def reduce_in_rank_order(group: Any, t: torch.Tensor, wait: Wait) -> None:
    """`t` (contiguous, the same shape on every rank of `group`) becomes the sum over the ranks, every element
    summed in rank order."""
    world, me = group.size(), group.rank()
    n = t.numel()
    if world == 1 or n == 0:
        return
    if world == 2:  # (a + b is b + a: the group's own all-reduce sums in rank order already, in one collective)
        wait(group.allreduce([t]), "gradient sums")
        return
    flat = t.view(-1)
    bounds = [n * i // world for i in range(world + 1)]
    sizes = [bounds[i + 1] - bounds[i] for i in range(world)]
    mine = sizes[me]
    recv = torch.empty(mine * world, dtype=t.dtype, device=t.device)
    wait(group.alltoall_base(recv, flat, [mine] * world, sizes, dist.AllToAllOptions()), "gradient slices")
    parts = recv.view(world, mine)
    acc = parts[0].clone()
    for r in range(1, world):
        acc += parts[r]
    top = max(sizes)
    send = acc if mine == top else torch.cat([acc, acc.new_zeros(top - mine)])
    out = torch.empty(top * world, dtype=t.dtype, device=t.device)
    wait(group._allgather_base(out, send), "gradient sums")
    for r in range(world):
        flat[bounds[r] : bounds[r + 1]].copy_(out[r * top : r * top + sizes[r]])


class OrderedReducer:
    """Buckets reduced with `reduce_in_rank_order`, one at a time, in the order they are submitted."""

    def __init__(self, group: Any, wait: Wait) -> None:
        self.group, self.wait = group, wait
        self._q: queue.Queue[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]] | None] = queue.Queue()
        self._t: threading.Thread | None = None

    def submit(self, t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self._t is None:
            self._t = threading.Thread(target=self._run, name="phoenixft-grad-reduce", daemon=True)
            self._t.start()
        self._q.put((t, fut))
        return fut

    def close(self) -> None:
        if self._t is not None:
            self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            t, fut = item
            try:
                reduce_in_rank_order(self.group, t, self.wait)
            except BaseException as e:  # noqa: BLE001 - handed to DDP, which raises it at the end of backward
                fut.set_exception(e)  # type: ignore[arg-type]  # (torch's stub says Tensor)
                continue
            fut.set_result(t)
