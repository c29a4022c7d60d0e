"""The mesh layout of one epoch: which (pp, dp, tp) coordinate each rank has and who shares which group.

Ranks follow Megatron-LM's default order, tensor-parallel fastest, then data-parallel, then
pipeline: `rank = tp + dp * T + pp * T * D`. With `workers_per_node` a multiple of T a node holds
whole TP groups, so a node failure takes whole TP groups and a spare node brings them back; the
data-parallel peers of a rank (same pp and tp) sit on other nodes. The layout is a pure function of
(world, T, P), so every process derives the same groups from the published topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Layout", "Coord", "SHARD_ALIGN", "shard_numel_of"]

#: every shard's length is a multiple of this many elements (and so is every shard's offset): a
#: vectorized optimizer kernel (torch's fused AdamW on CPU) then never reaches its scalar tail, whose
#: rounding differs from its vector body, and an update is bitwise the same however the flat buffer
#: is cut into shards (any world size) or into the chunks Trainer.step updates (a multiple of it)
SHARD_ALIGN = 64


def shard_numel_of(numel: int, shards: int) -> int:
    """The length of each of `shards` equal shards covering `numel` elements, a multiple of SHARD_ALIGN."""
    return math.ceil(numel / shards / SHARD_ALIGN) * SHARD_ALIGN


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int

    @property
    def stage(self) -> tuple[int, int]:
        """The (pp, tp) coordinate: ranks that hold the same slice of the model."""
        return self.pp, self.tp

    def name(self) -> str:
        return f"pp{self.pp}.tp{self.tp}"


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world % (self.tp * self.pp):
            raise ValueError(f"world {self.world} is not a multiple of tp x pp = {self.tp} x {self.pp}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def trivial(self) -> bool:
        """Data-parallel only: every rank holds the whole model."""
        return self.tp == 1 and self.pp == 1

    def coord(self, rank: int) -> Coord:
        t, d = self.tp, self.dp
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        return Coord(pp=rank // (t * d), dp=(rank // t) % d, tp=rank % t)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return tp + dp * self.tp + pp * self.tp * self.dp

    # ------------------------------------------------------------------ groups (member ranks, in group order)
    def dp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.pp, d, c.tp) for d in range(self.dp)]

    def tp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.pp, c.dp, t) for t in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(p, c.dp, c.tp) for p in range(self.pp)]

    def embedding_group(self, rank: int) -> list[int]:
        """First and last stage at the same (dp, tp): they hold the tied embedding's two copies."""
        g = self.pp_group(rank)
        return [g[0], g[-1]] if self.pp > 1 else [g[0]]

    def shard_name(self, rank: int) -> str:
        """The logical id of the optimizer shard rank `rank` owns: the same on any node, in any epoch."""
        c = self.coord(rank)
        return f"pp{c.pp}.tp{c.tp}.dp{c.dp}of{self.dp}"

    def dp_rank(self, rank: int) -> int:
        return self.coord(rank).dp
