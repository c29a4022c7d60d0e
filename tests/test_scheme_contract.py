"""One contract for every redundancy scheme (`protect.scheme.RedundancyScheme`).

A ring of real ranks (one thread each, gloo groups) protects a committed step through the scheme the
`--redundancy` text names; every rank describes what it holds; as many owners as the scheme tolerates
are lost; the recovery planner plans the next epoch from the descriptors, with a spare in each lost
slot; then every lost shard must come back bit for bit: provided as a verified copy by a survivor
(`copy_of`) or rebuilt in the new epoch's collective (`rebuild`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.protect.protection import make_scheme
from phoenixft.protect.redundancy.scheme import parse_redundancy
from phoenixft.protect.replication import Replicator
from phoenixft.protect.scheme import BadSource, RedundancyScheme
from phoenixft.protect.snapshot import Holding, ShardState, checksum
from phoenixft.recovery.planner import Descriptor, PlanInput, plan_recovery

NODES, NUMEL, STEP, TIMEOUT_S = 3, 1000, 7, 30.0


class _Rank:
    """A rank as a scheme's recovery side sees it (`protect.scheme.RankView`)."""

    def __init__(self, rank: int, pg: Any, state: ShardState, scheme: RedundancyScheme) -> None:
        self.rank, self.state, self.scheme = rank, state, scheme
        self.comm: Any = SimpleNamespace(train=pg)
        self.bad_sources: list[BadSource] = []

    def wait(self, work: Any, what: str) -> None:
        assert work.wait(timedelta(seconds=TIMEOUT_S)), what

    def copy_of(self, shard: int, shards: int, r: int) -> torch.Tensor:
        half = self.state.half_with(r)
        if half is not None and self.state.shard_of(half) == (shard, shards):
            return self.state.payload(half)
        kept = self.scheme.copy_of(shard, r)
        assert kept is not None, f"rank {self.rank} holds no copy of shard {shard}"
        return kept


def _on_ranks(world: int, fn: Callable[[int], None]) -> None:
    errors: list[str] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    assert not errors, errors


def _scheme(text: str, state: ShardState) -> RedundancyScheme:
    repl = Replicator(state, lambda s: Holding(NUMEL, None, rows=2), NUMEL // 3, lambda: None, TIMEOUT_S,
                      transport="tcp")
    return make_scheme(parse_redundancy(text), repl, lambda: None)


@pytest.mark.parametrize("text", ["replicas:1", "replicas:2", "ec:2+1", "ec:1+2"])
def test_protect_lose_owners_rebuild_bitwise(text: str) -> None:
    redundancy = parse_redundancy(text)
    nodes = [f"n{i}" for i in range(NODES)]
    old = Topology(epoch=0, nodes=nodes, workers_per_node=1, replicas=redundancy.k or 1, resume_step=STEP)
    gen = torch.Generator().manual_seed(NODES)
    states: dict[int, ShardState] = {}
    for r in range(NODES):
        st = ShardState(NUMEL, rows=3)
        st.data[0] = torch.randn(3, NUMEL, generator=gen)
        st.data[0, 1, ::9] = float("nan")  # compared as bits, not as floats
        st.commit(0, STEP, 0, (r, NODES))
        states[r] = st
    original = {r: states[r].payload(0).clone() for r in range(NODES)}
    schemes = {r: _scheme(text, states[r]) for r in range(NODES)}
    descs: dict[str, Descriptor] = {}
    store0 = dist.HashStore()

    def protect(r: int) -> None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("e0", store0), r, NODES, timedelta(seconds=TIMEOUT_S))
        scheme = schemes[r]
        scheme.configure(SimpleNamespace(repl=pg, world=NODES), old, r, STEP)  # type: ignore[arg-type]
        scheme.protect(STEP)
        scheme.wait(STEP)
        d = Descriptor(wid=f"{nodes[r]}.0", params=[STEP], stage="pp0.tp0")
        d.own[shard_name(r, NODES)] = {STEP: states[r].known_crc(0)}
        scheme.describe(d, NODES, 1, 1)
        descs[d.wid] = d

    try:
        _on_ranks(NODES, protect)
        lost = list(range(1, 1 + redundancy.tolerates))  # as many owners as the scheme tolerates
        for r in lost:
            del descs[f"{nodes[r]}.0"]
        plan = plan_recovery(PlanInput(old=old, dead={nodes[r] for r in lost}, restarted=set(), descs=descs,
                                       pool=[f"s{i}" for i in range(len(lost))], target_nodes=NODES,
                                       replicas=redundancy.k or 1, racks=1))
        assert plan.ok and plan.topo is not None and plan.resume_step == STEP, plan.error
        new = plan.topo
        recovered: dict[int, torch.Tensor] = {}
        store1 = dist.HashStore()

        def recover(r: int) -> None:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("e1", store1), r, NODES, timedelta(seconds=TIMEOUT_S))
            survivor = new.nodes[r] in nodes
            state = states[r] if survivor else ShardState(NUMEL, rows=3)
            if not survivor:  # a spare in a lost slot: nothing kept yet
                schemes[-1 - r] = _scheme(text, state)
            me = _Rank(r, pg, state, schemes[r] if survivor else schemes[-1 - r])
            for t in new.transfers:  # a lost shard provided as the verified copy a survivor keeps
                if t["opt_src"] == r:
                    copy = me.copy_of(t["shard"], NODES, STEP).reshape(-1)
                    assert checksum(copy) == t["crc"]
                    recovered[t["shard"]] = copy.clone()
            bad: list[str] = []
            rebuilt = me.scheme.rebuild(me, new, STEP, 2 * NUMEL, {}, bad) if new.meta.get("decode") else {}
            assert not bad and not me.bad_sources, bad
            for shard, (payload, crc) in rebuilt.items():
                assert checksum(payload) == crc
                recovered[shard] = payload.clone()

        _on_ranks(NODES, recover)
        assert sorted(recovered) == lost
        for r in lost:
            assert torch.equal(recovered[r].view(torch.int32), original[r].reshape(-1).view(torch.int32)), r
    finally:
        for s in schemes.values():
            s.close()
