"""Parity holdings: the parity blocks a rank keeps for a group, ping-pong in host shared memory.

A `ParityHolding` is a `Holding` (two halves, each tagged with step, checksum and valid flag, so a
failure while the parity of step s is written leaves step s-1's half usable) with one row of
`numel` float32 (the parity block's bytes) and, per half, what the block is: its index j, the
group's members (logical shard indices, block order), the number of parity blocks h, the world
the shard indices refer to, and the checksum each member committed for that step, so that a
shard is only ever rebuilt from members and parity of the same step and verified afterwards.

Segments: `<worker base>-par<gid>.data|hdr|info` (swept with the rest of the worker's segments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phoenixft.protect.snapshot import Holding, alloc

__all__ = ["ParityHolding", "ParityInfo", "parity_name"]

_J, _D, _H, _WORLD = range(4)


def parity_name(members: Sequence[str], j: int) -> str:
    """The logical name of parity block j of the group whose members are these shards."""
    return f"parity{j}:{','.join(members)}"


@dataclass(frozen=True)
class ParityInfo:
    j: int
    h: int
    world: int
    members: tuple[int, ...]  # shard indices (in `world`), block order
    mcrc: tuple[int, ...]  # each member's committed checksum at the half's step


class ParityHolding(Holding):
    def __init__(self, numel: int, dmax: int, path: str | None = None) -> None:
        super().__init__(numel, path, rows=1)
        self.dmax = dmax
        self.info = alloc(2 * (4 + 2 * dmax), torch.int64, path and path + ".info").view(2, 4 + 2 * dmax)

    def set_info(self, half: int, j: int, h: int, world: int, members: Sequence[int], mcrc: Sequence[int]) -> None:
        d = len(members)
        if d > self.dmax or len(mcrc) != d:
            raise ValueError(f"a group of {d} members in a holding sized for {self.dmax}")
        row = self.info[half]
        row.zero_()
        row[_J], row[_D], row[_H], row[_WORLD] = j, d, h, world
        row[4 : 4 + d] = torch.tensor(list(members), dtype=torch.int64)
        row[4 + self.dmax : 4 + self.dmax + d] = torch.tensor(list(mcrc), dtype=torch.int64)

    def info_of(self, half: int) -> ParityInfo:
        row = [int(x) for x in self.info[half].tolist()]
        d = row[_D]
        return ParityInfo(j=row[_J], h=row[_H], world=row[_WORLD], members=tuple(row[4 : 4 + d]),
                          mcrc=tuple(row[4 + self.dmax : 4 + self.dmax + d]))
