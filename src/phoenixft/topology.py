"""The topology of one epoch: which node sits in which slot, who holds whose replicas.

Ranks are `slot * workers_per_node + local_rank`; rank i owns the logical shard `dp{i}`.
The replicas of shard i live on the same local rank of k other nodes: whole racks away first
(distinct racks from the owner and from each other while racks last), then the nearest nodes.
The coordinator publishes a `Topology` per epoch; its digest is what invariant I1 compares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Topology", "shard_name"]


def shard_name(shard: int, shards: int) -> str:
    return f"pp0.tp0.dp{shard}of{shards}"


@dataclass(kw_only=True)
class Topology:
    epoch: int
    nodes: list[str]  # node id per slot
    workers_per_node: int
    replicas: int
    resume_step: int
    racks: int = 1
    transfers: list[dict[str, int]] = field(default_factory=list)  # dst, shard, param_src, opt_src
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.nodes) * self.workers_per_node

    def slot_of(self, node: str) -> int:
        return self.nodes.index(node)

    def rank_of(self, node: str, local_rank: int) -> int:
        return self.slot_of(node) * self.workers_per_node + local_rank

    def node_of_rank(self, rank: int) -> str:
        return self.nodes[rank // self.workers_per_node]

    def rack_of(self, slot: int) -> int:
        """Racks are contiguous, equal blocks of slots."""
        return slot * self.racks // len(self.nodes)

    def _offsets(self) -> list[int]:
        """Ring offsets of the replica rounds: whole racks away first (other failure domains), then
        the nearest other nodes. Each round is a rotation of the ring, so every node sends one
        replica and keeps one per round."""
        n = len(self.nodes)
        block = n // self.racks
        far = [block * j for j in range(1, self.racks)]
        near = [o for o in range(1, n) if o not in far]
        return (far + near)[: self.replicas]

    def holders(self, shard: int) -> list[int]:
        """Ranks that keep replicas of `shard`, one per round, all on other nodes."""
        g, n = self.workers_per_node, len(self.nodes)
        slot, lr = divmod(shard, g)
        return [((slot + o) % n) * g + lr for o in self._offsets()]

    def sources(self, rank: int) -> list[int]:
        """Shards whose replicas `rank` keeps, in the same rounds as `holders(rank)`."""
        g, n = self.workers_per_node, len(self.nodes)
        slot, lr = divmod(rank, g)
        return [((slot - o) % n) * g + lr for o in self._offsets()]

    def microbatches(self, rank: int, total: int) -> tuple[int, int]:
        """This rank's microbatches of a step: the global batch is fixed, the split may be uneven."""
        return rank * total // self.world, (rank + 1) * total // self.world

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Topology:
        return cls(**json.loads(text))

    def digest(self) -> str:
        core = {k: v for k, v in asdict(self).items() if k != "meta"}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()
