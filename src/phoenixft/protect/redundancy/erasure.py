"""`ec:D+H`: parity blocks of groups of D shards on H other nodes, instead of full copies.

The per-step job is the group's distributed encode (`protect.ErasureProtector.protect`, run by the
`Replicator` thread); in a recovery a shard with no copy left is rebuilt from its group's pieces of
the same step (`recovery.rebuild.run_decodes`). No replica is kept, so nothing is offered as a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.distributed.comm import EpochComm
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.protect import shm
from phoenixft.protect.redundancy.parity import ParityHolding, parity_name
from phoenixft.protect.redundancy.plan import ec_plan
from phoenixft.protect.redundancy.protect import ErasureProtector
from phoenixft.protect.redundancy.scheme import Redundancy
from phoenixft.protect.replication import ReplicaPlan, Replicator
from phoenixft.protect.scheme import RankView, RedundancyScheme
from phoenixft.protect.scrub import HeldCopy
from phoenixft.protect.snapshot import INVALID
from phoenixft.recovery import rebuild
from phoenixft.recovery.planner import Descriptor

__all__ = ["ErasureScheme"]


class ErasureScheme(RedundancyScheme):
    def __init__(self, repl: Replicator, redundancy: Redundancy, path: Callable[[int], str | None]) -> None:
        """`path(gid)`: the shared-memory base of the parity block of group gid (None: private memory)."""
        super().__init__(repl)
        self.redundancy = redundancy
        self.ec = ErasureProtector(lambda gid, numel, dmax: ParityHolding(numel, dmax, path(gid)))

    def configure(self, comm: EpochComm, topo: Topology, rank: int, r: int) -> None:
        ecp = ec_plan(topo, rank, self.redundancy)
        self.ec.plan = ecp
        # a ring of one node has no group (ecp None) and no other node: the plain ring plan there moves nothing
        self.repl.configure(comm, ReplicaPlan(shard=rank, send_to=topo.holders(rank),
                                              recv_from=[(x, x) for x in topo.sources(rank)]),
                            self.ec if ecp is not None else None)
        self.invalidate_after(r)

    def describe(self, d: Descriptor, shards: int, tp: int, pp: int) -> None:
        for gid, ph in self.ec.parity.items():
            for x in (0, 1):
                st = ph.step_of(x)
                if st == INVALID:
                    continue
                info = ph.info_of(x)
                members = [shard_name(i, info.world, tp, pp) for i in info.members]
                name = parity_name(members, info.j)
                if ph.verify(x):
                    d.parity.setdefault(name, {})[st] = {"crc": ph.crc_of(x), "j": info.j, "h": info.h, "gid": gid,
                                                         "members": members, "mcrc": list(info.mcrc)}
                else:
                    d.rejected.append((name, st))

    def held(self) -> list[HeldCopy]:
        return [HeldCopy("parity", gid, ph) for gid, ph in list(self.ec.parity.items())]

    def drop(self) -> None:
        self.ec.parity = {}

    def invalidate_after(self, r: int) -> None:
        for ph in self.ec.parity.values():
            ph.invalidate_after(r)

    def adopt(self, run_id: str, wid: str, gen: int) -> None:
        self.ec.adopt(shm.SHM_DIR.glob(shm.parity_glob(run_id, wid, gen)))

    def keep(self, topo: Topology, rank: int, r: int, fill: Callable[[int, torch.Tensor], Any]) -> None:
        """Nothing at once: the parity of step r needs the group's exchange, its next job encodes it."""

    def rebuild(self, rank: RankView, topo: Topology, r: int, n: int, timings: dict[str, Any],
                bad: list[str]) -> dict[int, tuple[torch.Tensor, int]]:
        return rebuild.run_decodes(rank, self.ec, topo, r, n, timings, bad)
