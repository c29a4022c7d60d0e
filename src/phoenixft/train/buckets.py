"""Gradient reduction in buckets, started from backward hooks and overlapped with the rest of backward.

The flat gradient is cut into buckets: contiguous ranges of the flat buffer, in reverse parameter
order (backward produces the last layers' gradients first), of about `bucket_mb` each, the last
parameter's bucket extended over the partition's padding. A post-accumulate-grad hook on every
parameter counts down its bucket; when a bucket's gradients are all there, on the step's last
microbatch, its all-reduce starts at once while backward continues with earlier layers, as
DistributedDataParallel does. With bf16 parameters each completed bucket is first added into the
fp32 accumulator (and the bf16 gradients cleared), on every microbatch.

Buckets are ranges of the same flat buffer the ZeRO-1 optimizer slices, so nothing is copied. The
bucket layout depends only on the model and `bucket_mb`, never on the world size, so a recovered
run reduces exactly as the failure-free run did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.train.zero import FlatModel

__all__ = ["GradBuckets"]


class GradBuckets:
    def __init__(self, flat: FlatModel, bucket_mb: float) -> None:
        self.flat = flat
        limit = max(1, int(bucket_mb * (1 << 20) / 4))
        offsets, off = [], 0
        for p in flat.params:
            offsets.append((off, off + p.numel()))
            off += p.numel()
        self.bucket_of: dict[int, int] = {}
        self.ranges: list[tuple[int, int]] = []
        self.sizes: list[int] = []
        cur: list[int] = []
        for i in reversed(range(len(flat.params))):
            cur.append(i)
            lo, hi = offsets[cur[-1]][0], offsets[cur[0]][1]
            if hi - lo >= limit or i == 0:
                b = len(self.ranges)
                top = flat.padded if not self.ranges else hi  # the first bucket covers the padding too
                self.ranges.append((lo, top))
                self.sizes.append(len(cur))
                for j in cur:
                    self.bucket_of[id(flat.params[j])] = b
                cur = []
        self.pending = list(self.sizes)
        self.done = [False] * len(self.ranges)
        self.last = False
        self._launch: Callable[[int], None] | None = None
        self.works: list[Any] = []

    def begin_microbatch(self, last: bool, launch: Callable[[int], None] | None) -> None:
        self.pending = list(self.sizes)
        self.done = [False] * len(self.ranges)
        self.last = last
        self._launch = launch

    def on_grad(self, p: torch.Tensor) -> None:
        b = self.bucket_of.get(id(p))
        if b is None:
            return
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._complete(b)

    def end_microbatch(self) -> None:
        """Buckets whose parameters got no gradient (unused in this forward) complete here."""
        for b in range(len(self.ranges)):
            if not self.done[b]:
                self._complete(b)

    def _complete(self, b: int) -> None:
        self.done[b] = True
        lo, hi = self.ranges[b]
        flat = self.flat
        if flat.grad32 is not flat.grad:
            flat.grad32[lo:hi].add_(flat.grad[lo:hi])
            flat.grad[lo:hi].zero_()
        if self.last and self._launch is not None:
            self._launch(b)
