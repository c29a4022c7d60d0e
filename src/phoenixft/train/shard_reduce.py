"""The ZeRO-1 gradient reduction on gloo as a reduce-scatter, bucket by bucket, in all-to-alls.

With ZeRO-1 a data-parallel rank updates only its own shard, so it needs only its shard's slice of
the summed gradient. An all-reduce (what DistributedDataParallel does, and what this project did
before) also delivers every other slice: with two ranks each sends and receives the gradient's
size twice (ring reduce-scatter, then all-gather). A reduce-scatter halves that. Gloo's own is a
blocking emulation that ignores wait timeouts (and measured 2x slower than its all-reduce here), so
here it is one all-to-all per bucket: a bucket is a contiguous range of the flat gradient, shards
are contiguous ranges in rank order, so the bucket's pieces for ranks 0..N-1 are consecutive (one
input view) and what this rank receives - every rank's piece of its own slice - is one output
region, N pieces in rank order.

`finish(b)` (once bucket b's work is complete) sums the N pieces into the flat gradient, in rank
order (a fixed order: the result depends on nothing but the inputs and N). With two ranks this is
bitwise what gloo's all-reduce gives (one addition, commutative); with more it may differ from
gloo's ring order in the last bit, but every run of the same configuration sums alike.
Outside this rank's slice the flat gradient is left unsummed: only the optimizer's slice is read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShardReduce"]


class ShardReduce:
    """Reduce-scatter of `grad` (n shards of `shard_numel` in rank order) over `pg`, one bucket at a time."""

    def __init__(self, pg: Any, grad: torch.Tensor, shard_numel: int) -> None:
        self.pg, self.grad, self.size = pg, grad, shard_numel
        self.n, self.r = pg.size(), pg.rank()
        if grad.numel() != self.n * shard_numel:
            raise ValueError(f"ShardReduce: grad has {grad.numel()} elements, expected {self.n} x {shard_numel}")
        # what this rank receives: for each part of its slice, n pieces in rank order (its own included)
        self.recv = torch.empty(self.n * shard_numel, dtype=grad.dtype, device=grad.device)
        self._posted: dict[int, tuple[int, int]] = {}  # bucket -> the range of this rank's slice it covers

    def _overlap(self, lo: int, hi: int, rank: int) -> tuple[int, int]:
        a, b = max(lo, rank * self.size), min(hi, (rank + 1) * self.size)
        return (a, b) if b > a else (a, a)

    def post(self, b: int, lo: int, hi: int) -> Any:
        """Start bucket `b` = grad[lo:hi]: send each rank its part, receive every rank's part of mine."""
        in_splits = [max(0, e - s) for s, e in (self._overlap(lo, hi, k) for k in range(self.n))]
        mlo, mhi = self._overlap(lo, hi, self.r)
        at = self.n * (mlo - self.r * self.size)  # this part's place in `recv` (the slice's parts are disjoint)
        out = self.recv[at : at + self.n * (mhi - mlo)]
        self._posted[b] = (mlo, mhi)
        return self.pg.alltoall_base(out, self.grad[lo:hi], [mhi - mlo] * self.n, in_splits, dist.AllToAllOptions())

    def finish(self, b: int) -> None:
        """Bucket `b`'s work is complete: its part of this rank's slice = the sum of the n pieces, in rank order."""
        mlo, mhi = self._posted.pop(b)
        if mhi == mlo:
            return
        at, k = self.n * (mlo - self.r * self.size), mhi - mlo
        pieces = self.recv[at : at + self.n * k].view(self.n, k)
        dst = self.grad[mlo:mhi]
        if self.n == 2:
            torch.add(pieces[0], pieces[1], out=dst)
            return
        dst.copy_(pieces[0])
        for i in range(1, self.n):
            dst.add_(pieces[i])
