"""The recovery planner's own time against W (the coordinator's decision computation, no store).

    python bench/plan_time.py       # W = 64, 256, 1024, 4096: one 8-worker node lost, one spare

Descriptors are built as bench/control_plane.py builds them (both ping-pong steps of the
parameters, the own shard and the ring replicas, with checksums); prints {W: seconds}, the best of
2-3 calls of `plan_recovery` each.
"""

from __future__ import annotations

import json
import time
import zlib

from phoenixft.recovery.planner import Descriptor, PlanInput, plan_recovery
from phoenixft.topology import Topology, shard_name

G, STEP = 8, 7


def crc(shard: str, step: int) -> int:
    return zlib.crc32(f"{shard}@{step}".encode())


def plan_time(w: int) -> float:
    nodes = [f"n{i}" for i in range(w // G)]
    topo = Topology(epoch=0, nodes=nodes, workers_per_node=G, replicas=1, resume_step=0)
    descs = {}
    for n in nodes:
        if n == "n1":
            continue
        for lr in range(G):
            wid, rank = f"{n}.{lr}", topo.rank_of(n, lr)
            d = Descriptor(wid=wid, params=[STEP - 1, STEP])
            own = shard_name(rank, w)
            d.own[own] = {s: crc(own, s) for s in (STEP - 1, STEP)}
            for src in topo.sources(rank):
                name = shard_name(src, w)
                d.holdings[name] = {s: crc(name, s) for s in (STEP - 1, STEP)}
            descs[wid] = d
    best = float("inf")
    for _ in range(3 if w < 4096 else 2):
        pi = PlanInput(old=Topology.from_json(topo.to_json()), dead={"n1"}, restarted=set(), descs=descs,
                       pool=["s0"], target_nodes=len(nodes), replicas=1, racks=1)
        t = time.perf_counter()
        p = plan_recovery(pi)
        best = min(best, time.perf_counter() - t)
        assert p.ok and p.action == "hotswap", p
    return best


def main() -> int:
    print(json.dumps({str(w): round(plan_time(w), 4) for w in (64, 256, 1024, 4096)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
