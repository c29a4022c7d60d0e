"""One rank's part in `ec:D+H` for an epoch: its group, its parity holders, the parity it keeps.

`dp_rings(topo)` lists today's data-parallel rings (one per local rank: the same local rank on
every node, in slot order, as `Topology.holders` keeps replicas); `ec_groups` places each ring
with `placement.place_groups` (with 3D parallelism the caller does it once per (pp, tp)
coordinate) and numbers the groups globally (`gid`); `ec_plan` is what the `Replicator` of one
rank needs for the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phoenixft.distributed.topology import Topology
from phoenixft.protect.redundancy.placement import Group, RingRank, place_groups
from phoenixft.protect.redundancy.scheme import Redundancy

__all__ = ["HeldBlock", "ECPlan", "dp_rings", "ec_groups", "ec_plan"]


@dataclass(frozen=True)
class HeldBlock:
    gid: int
    j: int
    members: tuple[int, ...]  # ranks = shard indices, block order
    h: int


@dataclass(kw_only=True)
class ECPlan:
    rank: int
    world: int
    gid: int
    members: list[int]  # my group's ranks, block order (rank i owns shard i)
    parity: list[int]  # parity[j] = the rank that keeps parity block j of my group
    held: list[HeldBlock] = field(default_factory=list)  # the parity blocks this rank keeps
    dmax: int = 1  # the largest group of the epoch (sizes the parity holdings' headers)

    @property
    def d(self) -> int:
        return len(self.members)

    @property
    def h(self) -> int:
        return len(self.parity)

    @property
    def i(self) -> int:
        return self.members.index(self.rank)


def dp_rings(topo: Topology) -> list[list[RingRank]]:
    """Data-parallel rings of a DP-only topology: local rank lr of every node, in slot order."""
    g, n = topo.workers_per_node, len(topo.nodes)
    return [[RingRank(rank=s * g + lr, node=s, rack=topo.rack_of(s)) for s in range(n)] for lr in range(g)]


def ec_groups(topo: Topology, scheme: Redundancy) -> list[Group]:
    """Every group of the epoch (all rings), in gid order; [] when the ring is too small to protect."""
    out: list[Group] = []
    for ring in dp_rings(topo):
        eff = scheme.for_ring(len(ring))
        if eff is None or not eff.is_ec:
            return []
        out.extend(place_groups(ring, eff.d, eff.h))
    return out


def ec_plan(topo: Topology, rank: int, scheme: Redundancy) -> ECPlan | None:
    groups = ec_groups(topo, scheme)
    if not groups:
        return None
    mine = next(gid for gid, grp in enumerate(groups) if rank in grp.members)
    grp = groups[mine]
    held = [HeldBlock(gid=gid, j=j, members=g.members, h=g.h) for gid, g in enumerate(groups)
            for j, holder in enumerate(g.parity) if holder == rank]
    return ECPlan(rank=rank, world=topo.world, gid=mine, members=list(grp.members), parity=list(grp.parity),
                  held=held, dmax=max(g.d for g in groups))
