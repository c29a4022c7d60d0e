"""Which collective sums the gradients over the data-parallel peers, and the NCCL reduce-scatter.

With ZeRO-1 a data-parallel rank updates only its own shard, so it needs only its shard's slice of
the summed gradient: a reduce-scatter moves half the data of an all-reduce. `gradient_reduction`
picks, per stage and backend (never per epoch):

- `"all-to-all"` on gloo: `ShardReduce` (shard_reduce.py), the reduce-scatter as one all-to-all per
  bucket and a local sum in rank order (gloo's own `reduce_scatter` is a blocking emulation that
  ignores wait timeouts);
- `"reduce-scatter"` on NCCL: `OwnerReduce` below;
- `"all-reduce"` on a stage holding a tied embedding (first and last pipeline stage): its two copies
  are summed over the whole tied range after the data-parallel sum, and the two stages cut their
  shards at different offsets of that range, so both need the whole range summed.

A bucket is a contiguous range of the flat gradient and shards are contiguous ranges in rank
order, so a bucket's part of each shard differs in size from rank to rank: no equal-chunk
`reduce_scatter_tensor` fits it without padding (which would send more than an all-reduce when a
bucket lies within one shard). `OwnerReduce` sums each part onto its owner with one NCCL reduce
(rooted at the owner; what reduce-scatter with uneven parts in `ProcessGroupNCCL.reduce_scatter`
does too): every rank sends each bucket once, as in a ring reduce-scatter, half of a ring
all-reduce. The owner's slice of the flat gradient holds the sum; elsewhere the flat gradient is
left unsummed (only the optimizer's slice is read; the global norm for clipping is summed from the
shards' squared norms in one scalar all-reduce, `Trainer._clip`).

Bits: NCCL's reduce and its all-reduce add in different orders, so the two give different bits;
so do gloo's all-to-all path and gloo's all-reduce with more than two ranks. A run never mixes
them: the choice depends only on the backend (fixed for a run: the device is) and on whether the
stage holds a tied embedding (fixed by the model and the layout), so a recovered run reduces as the
failure-free run did. Within NCCL, bitwise repetition further needs the same ranks on the same
topology (NCCL picks its algorithm and ring by size and topology), as for any NCCL collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phoenixft.train.shard_gather import Works

__all__ = ["gradient_reduction", "REDUCTIONS", "OwnerReduce"]

REDUCTIONS = ("all-to-all", "reduce-scatter", "all-reduce")


def gradient_reduction(backend: str, tied: bool) -> str:
    """The gradient reduction of a stage on `backend` (one of `REDUCTIONS`; see the module docstring)."""
    if tied:
        return "all-reduce"
    if backend == "nccl":
        return "reduce-scatter"
    if backend == "gloo":
        return "all-to-all"
    raise NotImplementedError(f"backend {backend!r}")


class OwnerReduce:
    """Reduce-scatter of `grad` (n shards of `shard_numel` in rank order) over `pg`, one bucket at a time,
    as one reduce per shard the bucket touches, rooted at the shard's owner."""

    def __init__(self, pg: Any, grad: torch.Tensor, shard_numel: int) -> None:
        self.pg, self.grad, self.size = pg, grad, shard_numel
        self.n, self.r = pg.size(), pg.rank()
        if grad.numel() != self.n * shard_numel:
            raise ValueError(f"OwnerReduce: grad has {grad.numel()} elements, expected {self.n} x {shard_numel}")

    def parts(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(owner, start, end) of every non-empty part of grad[lo:hi], in rank order."""
        out = []
        for k in range(self.n):
            a, b = max(lo, k * self.size), min(hi, (k + 1) * self.size)
            if b > a:
                out.append((k, a, b))
        return out

    def post(self, b: int, lo: int, hi: int) -> Works:
        """Start bucket `b` = grad[lo:hi]: each part summed onto its owner (every rank posts the same
        reduces in the same order)."""
        works = []
        for k, a, e in self.parts(lo, hi):
            opts = dist.ReduceOptions()  # (a sum by default)
            opts.rootRank = k
            works.append(self.pg.reduce([self.grad[a:e]], opts))
        return Works(works)

    def finish(self, b: int) -> None:
        """Nothing to do: the reduce wrote the owner's part in place."""
