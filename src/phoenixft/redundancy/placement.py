"""Group placement for `ec:D+H`: a pure function of ONE data-parallel ring.

A ring is the list of ranks that hold the same parameters (today: the same local rank on every
node; with 3D parallelism: the same (pp, tp) coordinate), in data-parallel order, one per node.
`place_groups(ring, d, h)` cuts it into G = ceil(n / d) groups of at most d members (sizes differ
by at most one: n = 4, d = 3 gives two groups of 2, never a group of 3 and a lone member), each
member on its own node, members taken with stride G so that a group spreads over the ring (and
over racks, which are contiguous blocks of nodes). Each group's h parity blocks go to h further
distinct nodes chosen greedily, in order of preference:

1. a rack that holds no member of the group, then one that holds no parity block of it yet
   (other racks first: a rack failure then costs the group as few pieces as possible);
2. the node holding the fewest parity blocks so far (parity memory spread evenly);
3. ring distance after the group's first member (deterministic).

Any h lost pieces of a group (members or parity blocks) leave d pieces: the code rebuilds the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RingRank", "Group", "place_groups", "group_count"]


@dataclass(frozen=True)
class RingRank:
    rank: int
    node: int  # node slot: distinct within a ring
    rack: int = 0


@dataclass(frozen=True)
class Group:
    members: tuple[int, ...]  # ranks, in block order: member i is data block i
    parity: tuple[int, ...]  # parity[j] = the rank that holds parity block j

    @property
    def d(self) -> int:
        return len(self.members)

    @property
    def h(self) -> int:
        return len(self.parity)


def group_count(n: int, d: int) -> int:
    return math.ceil(n / d)


def place_groups(ring: Sequence[RingRank], d: int, h: int) -> list[Group]:
    """The groups of one ring (see the module docstring). ValueError if the ring cannot hold them."""
    n = len(ring)
    if d < 1 or h < 1:
        raise ValueError(f"ec:{d}+{h}: need d >= 1 and h >= 1")
    if len({r.node for r in ring}) != n or len({r.rank for r in ring}) != n:
        raise ValueError("a ring has one rank per node: ranks and nodes must be distinct")
    if d + h > n:
        raise ValueError(f"ec:{d}+{h} needs {d + h} nodes in the ring, it has {n}")
    g_count = group_count(n, d)
    load = [0] * n  # parity blocks per ring position
    groups = []
    for g in range(g_count):
        pos = list(range(g, n, g_count))
        member_racks = {ring[p].rack for p in pos}
        chosen: list[int] = []
        for _j in range(h):
            taken = set(pos) | set(chosen)
            parity_racks = {ring[p].rack for p in chosen}
            cands = [p for p in range(n) if p not in taken]
            best = min(cands, key=lambda p: (ring[p].rack in member_racks, ring[p].rack in parity_racks, load[p],
                                             (p - pos[0]) % n))
            chosen.append(best)
            load[best] += 1
        groups.append(Group(members=tuple(ring[p].rank for p in pos), parity=tuple(ring[p].rank for p in chosen)))
    return groups
