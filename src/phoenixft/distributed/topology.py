"""The topology of one epoch: which node sits in which slot, who holds whose replicas.

Ranks are `slot * workers_per_node + local_rank`; their (pp, dp, tp) coordinates follow the mesh
layout (parallel/layout.py: tensor-parallel fastest, then data-parallel, then pipeline), and rank i
owns the logical shard `pp{p}.tp{t}.dp{d}of{D}`. The replicas of shard i live on the same local rank
of k other nodes of the same pipeline stage (its data-parallel peers at the same (pp, tp)): whole
racks away first (distinct racks from the owner and from each other while racks last), then the
nearest nodes.
The coordinator publishes a `Topology` per epoch; its digest is what invariant I1 compares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from phoenixft.parallel.layout import Layout

__all__ = ["Topology", "shard_name"]


def shard_name(shard: int, shards: int, tp: int = 1, pp: int = 1) -> str:
    """The logical id of shard `shard` of a `shards`-rank mesh with tensor/pipeline sizes tp, pp."""
    return Layout(shards, tp, pp).shard_name(shard)


@dataclass(kw_only=True)
class Topology:
    epoch: int
    nodes: list[str]  # node id per slot
    workers_per_node: int
    replicas: int
    resume_step: int
    racks: int = 1
    transfers: list[dict[str, Any]] = field(default_factory=list)  # dst, shard, param_src(s), opt_src, crc
    meta: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return len(self.nodes) * self.workers_per_node

    @property
    def layout(self) -> Layout:
        return Layout(self.world, self.tp, self.pp)

    def shard_name(self, rank: int) -> str:
        return self.layout.shard_name(rank)

    def param_need(self) -> dict[int, list[int]]:
        """Receiver rank -> the ranks it takes the parameters from (striped), for this plan's transfers."""
        return {t["dst"]: sorted(set(t.get("param_srcs") or [t["param_src"]]))
                for t in self.transfers if t["param_src"] >= 0}

    def opt_need(self) -> dict[int, list[int]]:
        """Receiver rank -> the one rank it takes its optimizer shard from, for this plan's transfers."""
        return {t["dst"]: [t["opt_src"]] for t in self.transfers if t["opt_src"] >= 0}

    @property
    def restore_path(self) -> str:
        """Which restore this epoch's plan takes: "reshard", "persistent", "init" (epoch 0, or a fresh
        start with nothing committed) or "in_place" (recovery/restore.py)."""
        if "reshard" in self.meta:
            return "reshard"
        if self.meta.get("restore") == "persistent":
            return "persistent"
        return "init" if self.epoch == 0 or self.meta.get("restore") == "init" else "in_place"

    def transfer_ranks(self) -> list[int]:
        """The ranks that send or receive in this plan's recovery transfers, in rank order."""
        ranks: set[int] = set()
        for need in (self.param_need(), self.opt_need()):
            for dst, srcs in need.items():
                ranks.add(dst)
                ranks.update(srcs)
        return sorted(ranks)

    def slot_of(self, node: str) -> int:
        """The node's slot, from an index built once (a plan asks this for every rank: O(1), not O(W));
        the cached answer is checked against `nodes`, and the index rebuilt when `nodes` changed."""
        idx: dict[str, int] | None = self.__dict__.get("_slot_index")
        i = idx.get(node) if idx is not None else None
        if i is None or i >= len(self.nodes) or self.nodes[i] != node:
            idx = {n: k for k, n in reversed(list(enumerate(self.nodes)))}  # the first slot, as list.index
            self.__dict__["_slot_index"] = idx
            if node not in idx:
                raise ValueError(f"{node!r} is not in list")
            i = idx[node]
        return i

    def rank_of(self, node: str, local_rank: int) -> int:
        return self.slot_of(node) * self.workers_per_node + local_rank

    def node_of_rank(self, rank: int) -> str:
        return self.nodes[rank // self.workers_per_node]

    def rack_of(self, slot: int) -> int:
        """Racks are contiguous, equal blocks of slots."""
        return slot * self.racks // len(self.nodes)

    @property
    def ring_nodes(self) -> int:
        """Nodes of one pipeline stage: the ring over which a shard's replicas rotate."""
        return len(self.nodes) // self.pp

    def _offsets(self) -> list[int]:
        """Ring offsets of the replica rounds: whole racks away first (other failure domains), then
        the nearest other nodes. Each round is a rotation of the ring, so every node sends one
        replica and keeps one per round. With pipeline stages the ring is one stage's nodes (the
        data-parallel peers); racks are then not taken into account."""
        n = self.ring_nodes
        racks = self.racks if self.pp == 1 else 1
        block = n // racks
        far = [block * j for j in range(1, racks)]
        out = far[: self.replicas]
        o = 1  # then the nearest others, only as many as needed (this runs per rank: O(W) calls)
        while len(out) < self.replicas and o < n:
            if o not in far:
                out.append(o)
            o += 1
        return out

    def _ring(self, rank: int) -> tuple[int, int, int]:
        """(first slot of rank's stage ring, rank's position in it, local rank)."""
        slot, lr = divmod(rank, self.workers_per_node)
        n = self.ring_nodes
        return slot // n * n, slot % n, lr

    def holders(self, shard: int) -> list[int]:
        """Ranks that keep replicas of `shard`, one per round, all on other nodes of its stage."""
        base, i, lr = self._ring(shard)
        n, g = self.ring_nodes, self.workers_per_node
        return [(base + (i + o) % n) * g + lr for o in self._offsets()]

    def sources(self, rank: int) -> list[int]:
        """Shards whose replicas `rank` keeps, in the same rounds as `holders(rank)`."""
        base, i, lr = self._ring(rank)
        n, g = self.ring_nodes, self.workers_per_node
        return [(base + (i - o) % n) * g + lr for o in self._offsets()]

    def microbatches(self, rank: int, total: int) -> tuple[int, int]:
        """This rank's microbatches of a step: the global batch is fixed and split over the data-parallel
        ranks (every stage and tensor-parallel rank of a data-parallel column runs the same ones); the
        split may be uneven."""
        lay = self.layout
        d = lay.dp_rank(rank)
        return d * total // lay.dp, (d + 1) * total // lay.dp

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Topology:
        return cls(**json.loads(text))

    @classmethod
    def parse(cls, raw: str | bytes | None, key: str = "topo") -> Topology | None:
        """The topology in `raw` if it is one (every field of its type, within bounds); None (logged) if it is
        not: for a reader of a value nobody signed, or before acting on one that verified."""
        from phoenixft.controlplane.values import note_bad, parse_json

        d = parse_json(raw, key)
        if d is None:
            return None
        why = _shape_problem(d)
        if why:
            note_bad(key, f"not a topology ({why})", raw or b"")
            return None
        return cls(**d)

    def digest(self) -> str:
        core = {k: v for k, v in asdict(self).items() if k != "meta"}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


_INT_FIELDS = {"epoch": 0, "workers_per_node": 1, "replicas": 0, "resume_step": 0, "racks": 1, "tp": 1, "pp": 1}


def _shape_problem(d: dict[str, Any]) -> str:
    """Why `d` is not a topology's fields ('' if it is)."""
    known = {f for f in Topology.__dataclass_fields__}
    if set(d) - known:
        return f"unknown field {sorted(set(d) - known)[0]!r}"
    for f, least in _INT_FIELDS.items():
        v = d.get(f, least)
        if f in ("epoch", "workers_per_node", "replicas", "resume_step") and f not in d:
            return f"no {f}"
        if not isinstance(v, int) or isinstance(v, bool) or not least <= v < 1 << 62:
            return f"{f} is not an integer >= {least}"
    nodes = d.get("nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        return "nodes is not a list of node ids"
    if not isinstance(d.get("transfers", []), list) or not all(isinstance(t, dict) for t in d.get("transfers", [])):
        return "transfers is not a list of objects"
    if not isinstance(d.get("meta", {}), dict):
        return "meta is not an object"
    return ""
