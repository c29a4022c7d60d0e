"""The ZeRO-1 parameter all-gather on gloo, as all-to-all rounds instead of gloo's all-gather.

After the optimizer step every data-parallel rank holds the new parameters of its own shard (the
master row); every rank needs all of them. Gloo's `allgather` moves them at about 0.3 GB/s per
direction on this machine's loopback (21.6 MB per rank in 72-99 ms between two processes), its
`alltoall` at 1.5-1.6 GB/s (`python bench/gloo_link.py --gather`). So on gloo the gather is N-1
rounds, cut into chunks: in round k rank r sends its shard to r+k and receives the shard of r-k
straight into its place in the flat buffer (no staging copy, no arithmetic: bitwise what an
all-gather gives). Every round of every rank is posted at once; gloo runs a group's collectives
in order. NCCL keeps its own all-gather (`Trainer.step` chooses).

`Works` bundles the chunks' works into one object with the two methods `comm.wait_work` uses.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_shards", "Works", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20  # measured: 4 MiB chunks move 400 MB one way at 1.62 GB/s, 16 MiB at 1.46 GB/s


class Works:
    """Several c10d works waited as one: complete when all are; `wait` waits for each in order."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self._done = 0  # works[:_done] are known complete

    def is_completed(self) -> bool:
        while self._done < len(self.works) and self.works[self._done].is_completed():
            self._done += 1
        return self._done == len(self.works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        return True


def gather_shards(pg: Any, out: torch.Tensor, mine: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Works:
    """Fill `out` (n equal shards, n = pg.size()) with every rank's `mine`; this rank's own shard is
    copied locally. Every rank of `pg` must call it. Returns the pending works."""
    n, r = pg.size(), pg.rank()
    size = mine.numel()
    if out.numel() != n * size:
        raise ValueError(f"gather_shards: out has {out.numel()} elements, expected {n} x {size}")
    out[r * size : (r + 1) * size].copy_(mine)
    step = max(1, chunk_bytes // max(1, mine.element_size()))
    works: list[Any] = []
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        for lo in range(0, size, step):
            hi = min(size, lo + step)
            in_splits, out_splits = [0] * n, [0] * n
            in_splits[dst] = out_splits[src] = hi - lo
            recv = out[src * size + lo : src * size + hi]
            works.append(pg.alltoall_base(recv, mine[lo:hi], out_splits, in_splits, dist.AllToAllOptions()))
    return Works(works)
