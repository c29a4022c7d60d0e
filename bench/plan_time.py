"""The recovery planner's own time against W (the coordinator's decision computation, no store).

    python bench/plan_time.py       # W = 64, 256, 1024, 4096: one 8-worker node lost, one spare

Descriptors are built as bench/control_plane.py builds them (both ping-pong steps of the
parameters, the own shard and the ring replicas, with checksums); prints {W: seconds}, the best of
2-3 calls of `plan_recovery` each, and the same with the coordinator's parsing of the posted JSON
(`Descriptor.from_json`) before it: {"plan": {...}, "parse_and_plan": {...}}.
"""

from __future__ import annotations

import json
import time
import zlib

from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.recovery.planner import Descriptor, PlanInput, plan_recovery

G, STEP = 8, 7


def crc(shard: str, step: int) -> int:
    return zlib.crc32(f"{shard}@{step}".encode())


def plan_time(w: int) -> tuple[float, float]:
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
    raws = [json.dumps(d.to_json()).encode() for d in descs.values()]
    best = best_all = float("inf")
    for _ in range(3 if w < 4096 else 2):
        t0 = time.perf_counter()
        parsed = {d.wid: d for d in (Descriptor.from_json(json.loads(r)) for r in raws)}
        pi = PlanInput(old=Topology.from_json(topo.to_json()), dead={"n1"}, restarted=set(), descs=parsed,
                       pool=["s0"], target_nodes=len(nodes), replicas=1, racks=1)
        t = time.perf_counter()
        p = plan_recovery(pi)
        best = min(best, time.perf_counter() - t)
        best_all = min(best_all, time.perf_counter() - t0)
        assert p.ok and p.action == "hotswap", p
    return best, best_all


def main() -> int:
    res = {str(w): plan_time(w) for w in (64, 256, 1024, 4096)}
    print(json.dumps({"plan": {w: round(v[0], 4) for w, v in res.items()},
                      "parse_and_plan": {w: round(v[1], 4) for w, v in res.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
