"""The ZeRO-1 parameter all-gather on gloo, as all-to-all rounds instead of gloo's all-gather.

After the optimizer step every data-parallel rank holds the new parameters of its own shard (the
master row); every rank needs all of them. Gloo's `allgather` is slow at this: 21.6 MB per rank
between two processes on this machine's loopback takes 72-83 ms (0.26-0.30 GB/s per direction);
the same exchange as all-to-all rounds takes 27-33 ms (`python bench/gloo_link.py --gather --mb
21.6 --chunk-mb 4`, which also checks that both give the same bits). So on gloo the gather is N-1
rounds per chunk: in round k rank r sends its chunk to r+k and receives the chunk of r-k straight
into its place in the flat buffer (no staging copy, no arithmetic: bitwise what an all-gather
gives). `Trainer.step` posts each chunk as soon as the optimizer has computed it, so the transfer
overlaps the rest of the update; gloo runs a group's collectives in order. NCCL keeps its own
all-gather.

`Works` bundles the chunks' works into one object with the two methods `comm.wait_work` uses.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_shards", "ShardGather", "Works", "CHUNK_BYTES"]

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


class ShardGather:
    """One gather, posted a range of the shard at a time (e.g. as the optimizer finishes each chunk:
    `Trainer.step`). `out` holds n = pg.size() shards of `shard_numel` elements each."""

    def __init__(self, pg: Any, out: torch.Tensor, shard_numel: int) -> None:
        self.pg, self.out, self.size = pg, out, shard_numel
        self.n, self.r = pg.size(), pg.rank()
        if out.numel() != self.n * shard_numel:
            raise ValueError(f"gather_shards: out has {out.numel()} elements, expected {self.n} x {shard_numel}")
        self.works: list[Any] = []
        self._keep: list[torch.Tensor] = []  # send buffers stay alive until their works complete

    def post(self, part: torch.Tensor, lo: int) -> None:
        """Send `part` (this rank's shard[lo:lo+len]) to every other rank and receive theirs in place."""
        hi, n, r, size = lo + part.numel(), self.n, self.r, self.size
        self.out[r * size + lo : r * size + hi].copy_(part)
        self._keep.append(part)
        for k in range(1, n):
            dst, src = (r + k) % n, (r - k) % n
            in_splits, out_splits = [0] * n, [0] * n
            in_splits[dst] = out_splits[src] = hi - lo
            recv = self.out[src * size + lo : src * size + hi]
            self.works.append(self.pg.alltoall_base(recv, part, out_splits, in_splits, dist.AllToAllOptions()))

    def pending(self) -> Works:
        return Works(self.works)


def gather_shards(pg: Any, out: torch.Tensor, mine: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Works:
    """Fill `out` (n equal shards, n = pg.size()) with every rank's `mine`; this rank's own shard is
    copied locally. Every rank of `pg` must call it. Returns the pending works."""
    g = ShardGather(pg, out, mine.numel())
    step = max(1, chunk_bytes // max(1, mine.element_size()))
    for lo in range(0, mine.numel(), step):
        g.post(mine[lo : lo + step], lo)
    return g.pending()
