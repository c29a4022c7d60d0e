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

import numpy as np

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
    # Each parity block goes to the position with the smallest key (its rack holds a member of the group,
    # its rack holds a parity block of the group already, its parity load, its distance after the group's
    # first member), over the positions outside the group. The keys are computed for the whole ring at once
    # (numpy): this runs in every worker for every epoch with ec:D+H, G = n/d groups over a ring of n nodes,
    # so a per-position Python key was O(n^2 / d) calls (22 s at n = 16,000).
    rack = np.array([r.rack for r in ring], dtype=np.int64)
    load = np.zeros(n, dtype=np.int64)  # parity blocks per ring position
    idx = np.arange(n, dtype=np.int64)
    groups = []
    for g in range(g_count):
        pos = list(range(g, n, g_count))
        in_members = np.isin(rack, rack[pos])
        dist = (idx - pos[0]) % n
        chosen: list[int] = []
        for _j in range(h):
            in_parity = np.isin(rack, rack[chosen]) if chosen else np.zeros(n, dtype=bool)
            # lexicographic (in_members, in_parity, load, dist) as one integer; dist < n is unique per position
            key = ((in_members.astype(np.int64) * 2 + in_parity) * (int(load.max()) + 1) + load) * n + dist
            key[pos] = np.iinfo(np.int64).max
            key[chosen] = np.iinfo(np.int64).max
            best = int(np.argmin(key))
            chosen.append(best)
            load[best] += 1
        groups.append(Group(members=tuple(ring[p].rank for p in pos), parity=tuple(ring[p].rank for p in chosen)))
    return groups
