"""`replicas:K`: full copies of every committed shard on K peers of other nodes.

The copies are moved by the `Replicator` itself (replication.py) into its holdings, one ping-pong
`Holding` per shard this rank keeps (the ring: `Topology.holders` / `Topology.sources`). In a
recovery a kept copy is offered as it is (`copy_of`) and sent by the plan's transfers: nothing has
to be rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.distributed.comm import EpochComm
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.protect import shm
from phoenixft.protect.replication import ReplicaPlan
from phoenixft.protect.scheme import RankView, RedundancyScheme
from phoenixft.protect.scrub import HeldCopy
from phoenixft.protect.snapshot import H_VALID, INVALID, checksum
from phoenixft.recovery.planner import Descriptor

__all__ = ["ReplicaScheme"]


class ReplicaScheme(RedundancyScheme):
    def configure(self, comm: EpochComm, topo: Topology, rank: int, r: int) -> None:
        self.repl.configure(comm, ReplicaPlan(shard=rank, send_to=topo.holders(rank),
                                              recv_from=[(x, x) for x in topo.sources(rank)]))
        self.invalidate_after(r)

    def describe(self, d: Descriptor, shards: int, tp: int, pp: int) -> None:
        for shard, h in self.repl.holdings.items():
            for x in (0, 1):
                st = h.step_of(x)
                if st == INVALID:
                    continue
                idx, count = h.shard_of(x)
                name = shard_name(idx if count else shard, count or shards * tp * pp, tp, pp)
                if h.verify(x):
                    d.holdings.setdefault(name, {})[st] = h.crc_of(x)
                else:
                    d.rejected.append((name, st))

    def held(self) -> list[HeldCopy]:
        return [HeldCopy("replica", shard, h) for shard, h in list(self.repl.holdings.items())]

    def drop(self) -> None:
        self.repl.holdings = {}

    def invalidate_after(self, r: int) -> None:
        for h in self.repl.holdings.values():
            h.invalidate_after(r)

    def adopt(self, run_id: str, wid: str, gen: int) -> None:
        for f in shm.SHM_DIR.glob(shm.holding_glob(run_id, wid, gen)):
            self.repl.holding(int(f.name.rsplit("-hold", 1)[1].split(".")[0]))

    def copy_of(self, shard: int, r: int) -> torch.Tensor | None:
        h = self.repl.holdings.get(shard)
        if h is None:
            return None
        hh = h.verified_half(r)  # (the descriptor just verified it, as a rule: not hashed again)
        return h.payload(hh) if hh is not None else None

    def keep(self, topo: Topology, rank: int, r: int, fill: Callable[[int, torch.Tensor], Any]) -> None:
        """Commit, as step r, the replica of every shard the ring gives this rank."""
        for src in topo.sources(rank):
            h = self.repl.holding(src)
            h.begin_write(0)
            fill(src, h.payload(0))
            h.commit(0, r, checksum(h.payload(0)), (src, topo.world))
            h.header[1, H_VALID] = 0

    def rebuild(self, rank: RankView, topo: Topology, r: int, n: int, timings: dict[str, Any],
                bad: list[str]) -> dict[int, tuple[torch.Tensor, int]]:
        """Nothing to rebuild: every lost shard the plan restores has a kept copy (`copy_of`)."""
        return {}
