"""The topology of one epoch: which node sits in which slot, who holds whose replicas.

Ranks are `slot * workers_per_node + local_rank`; rank i owns the logical shard `dp{i}`.
The replicas of shard i live on the same local rank of the next k nodes around the ring, so
they are always on other nodes (other failure domains) than the owner and than each other.
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

    def holders(self, shard: int) -> list[int]:
        """Ranks that keep replicas of `shard`, on the next `replicas` nodes of the ring."""
        g, w = self.workers_per_node, self.world
        return [(shard + g * j) % w for j in range(1, self.replicas + 1) if len(self.nodes) > j]

    def sources(self, rank: int) -> list[int]:
        """Shards whose replicas `rank` keeps, in the same ring rounds as `holders(rank)`."""
        g, w = self.workers_per_node, self.world
        return [(rank - g * j) % w for j in range(1, self.replicas + 1) if len(self.nodes) > j]

    def microbatches(self, rank: int, total: int) -> tuple[int, int]:
        per = total // self.world
        return rank * per, (rank + 1) * per

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Topology:
        return cls(**json.loads(text))

    def digest(self) -> str:
        core = {k: v for k, v in asdict(self).items() if k != "meta"}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()
