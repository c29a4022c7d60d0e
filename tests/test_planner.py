"""The recovery planner against thousands of generated fault schedules (pure logic, milliseconds).

Each case builds an epoch's topology (nodes, workers per node, k replicas, racks), kills a random
set of nodes, promotes from a random spare pool, and gives every survivor a random but possible
history: parameter buffers holding one or two consecutive steps, its own shard at some steps (a
spare promoted in an earlier epoch may hold nothing yet), replicas of the shards the ring gives it
and of shards from earlier epochs, checksum rejections and sources that already sent bad data.
A brute-force oracle then says which steps are recoverable; the planner must agree:

- it never declares the state lost while some step has a verified copy of every shard;
- it never picks a step that some shard lacks, and it picks the newest recoverable one;
- every member of the new epoch either holds its shard and the parameters at that step, or is
  sent them by a member that holds them (with the checksum the copy was committed with);
- no dead node is a member; promoted spares come from the pool; a shrink drops only dead slots.

Mesh cases (tensor x pipeline parallel layouts) add: parameters come only from a member of the same
(pp, tp) stage, a step is recoverable only if every stage still has its parameters somewhere, and a
mesh that would have to drop a node is refused with a clear error.
"""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import replace

import pytest

from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.protect.redundancy.parity import parity_name
from phoenixft.protect.redundancy.placement import RingRank, place_groups
from phoenixft.recovery.planner import STRIPES, Descriptor, Plan, PlanInput, feasible_steps, plan_recovery

CASES = 4000


def crc_of(shard: str, step: int) -> int:
    return zlib.crc32(f"{shard}@{step}".encode()) or 1


def make_case(rng: random.Random, mesh: bool = False) -> PlanInput:
    tp, pp = (rng.choice([1, 2]), rng.choice([1, 2, 3])) if mesh else (1, 1)
    n = pp * rng.randint(2, 4) if mesh else rng.randint(2, 7)
    g = tp if mesh else rng.choice([1, 1, 2])
    racks = 1 if mesh else rng.choice([d for d in (1, 2, 3) if n % d == 0])
    k = rng.randint(1, min(3, n // pp - 1))
    gen = rng.choice([0, 0, 1])
    nodes = [f"n{i}" for i in range(n)]
    rng.shuffle(nodes)
    old = Topology(epoch=rng.randint(0, 5), nodes=nodes, workers_per_node=g, replicas=k, racks=racks,
                   resume_step=0, meta={"generation": gen} if gen else {}, tp=tp, pp=pp)
    dead = {x for x in nodes if rng.random() < 0.3}
    if not dead and rng.random() < 0.7:
        dead = {rng.choice(nodes)}
    s = rng.randint(3, 30)  # the newest committed step
    descs: dict[str, Descriptor] = {}
    restarted: set[str] = set()
    for rank in range(old.world):
        node = old.node_of_rank(rank)
        if node in dead:
            continue
        wid = f"{node}.{rank % g}"
        d = Descriptor(wid=wid, stage=old.layout.coord(rank).name())
        # parameter buffers: two consecutive steps, or one (the other being overwritten)
        newest = s - (1 if rng.random() < 0.2 else 0)
        d.params = sorted({newest, newest - 1} if rng.random() < 0.7 else {newest})
        mine = old.shard_name(rank)
        fresh = rng.random() < 0.1  # a spare promoted in an earlier epoch that never got its state
        if not fresh:
            own = {st for st in (newest, newest - 1) if rng.random() < 0.8}
            d.own[mine] = {st: crc_of(mine, st) for st in own}
        if rng.random() < 0.1:
            restarted.add(wid)
        holds = [old.sources(rank)[j] for j in range(len(old.sources(rank)))]
        if rng.random() < 0.2:  # replicas kept from an earlier epoch's ring (always of the same stage)
            holds.append(rng.choice(old.layout.dp_group(rank)))
        for src in holds:
            name = old.shard_name(src)
            for st in (s, s - 1, s - 2):
                if rng.random() < 0.6:
                    if rng.random() < 0.1:
                        d.rejected.append((name, st))  # failed its checksum: never offered
                    else:
                        d.holdings.setdefault(name, {})[st] = crc_of(name, st)
        descs[wid] = d
    # some sources already delivered a bad copy (seen by whoever received it)
    if descs and rng.random() < 0.2:
        victim = rng.choice(sorted(descs))
        w = rng.choice(sorted(descs))
        for name, steps in list(descs[w].holdings.items()) + list(descs[w].own.items()):
            for st in steps:
                if rng.random() < 0.3:
                    descs[victim].bad_sources.append((name, st, w))
    pool = [f"s{i}" for i in range(rng.randint(0, 3 + 2 * int(mesh)))]
    man = {"step": max(0, s - rng.randint(2, 8)), "shards": old.world, "numel": 100, "shard_numel": 10,
           "path": "/x"} if rng.random() < 0.4 else None
    return PlanInput(old=old, dead=dead, restarted=restarted, descs=descs, pool=pool,
                     target_nodes=n + (rng.choice([0, 1, pp, pp]) if mesh else rng.randint(0, 1)), replicas=k,
                     racks=racks, manifest=man, grow_only=not dead and rng.random() < 0.5,
                     expected=rng.choice([0, 0, 0, 1, 2]) if mesh else 0)


def oracle(pi: PlanInput) -> tuple[set[int], dict[str, dict[int, dict[str, int]]]]:
    """Brute force: every verified copy, and the steps at which all shards and the parameters exist."""
    bad = {x for d in pi.descs.values() for x in d.bad_sources}
    copies: dict[str, dict[int, dict[str, int]]] = {}
    for w, d in pi.descs.items():
        for src in (d.own, d.holdings):
            for name, steps in src.items():
                for st, crc in steps.items():
                    if (name, st, w) not in bad:
                        copies.setdefault(name, {}).setdefault(st, {})[w] = crc
    shards = [pi.old.shard_name(i) for i in range(pi.old.world)]
    stages = {pi.old.layout.coord(i).name() for i in range(pi.old.world)}
    candidates = {st for d in pi.descs.values() for st in d.params}
    ok = {st for st in candidates if all(st in copies.get(x, {}) for x in shards)
          and all(any(st in d.params and d.stage == g for d in pi.descs.values()) for g in stages)}
    return ok, copies


def wid_of(topo: Topology, rank: int) -> str:
    return f"{topo.node_of_rank(rank)}.{rank % topo.workers_per_node}"


def expected_membership(pi: PlanInput) -> tuple[list[str], list[str], str, str]:
    """promoted, dropped, class, action: a spare (in pool order) per dead slot (in slot order), the slots left
    over dropped; with none dropped a data-parallel job grows back to its target while spares last (a mesh
    never changes size). The class says what happened (a node lost, workers restarted in place, a planned
    grow), the action what the plan does about it (a shrink or a grow over anything else)."""
    dead = [x for x in pi.old.nodes if x in pi.dead]
    swapped = min(len(dead), len(pi.pool))
    dropped = dead[swapped:]
    grow, per = 0, pi.old.pp  # (a mesh grows by whole columns: one node per pipeline stage)
    if not dropped:
        grow = per * max(0, min((pi.target_nodes - len(pi.old.nodes)) // per, (len(pi.pool) - swapped) // per))
    klass = ("permanent" if pi.dead else "transient" if pi.restarted else
             "planned" if pi.grow_only or grow else "transient")
    action = ("shrink" if dropped else "grow" if grow and not pi.dead else "hotswap" if pi.dead else
              "inplace" if pi.restarted else "grow" if pi.grow_only else "reconfigure")
    return pi.pool[: swapped + grow], dropped, klass, action


def why_lost(pi: PlanInput, copies: dict[str, dict[int, dict[str, int]]], missing: list[str]) -> str:
    """What a plan without an in-memory step says: the shards with no copy left (else each shard's steps, none
    common to all), the replicas rejected by checksum, the copies that failed I3 in transit."""
    shards = [pi.old.shard_name(i) for i in range(pi.old.world)]
    held = "; ".join(f"{x}: {sorted(copies.get(x, {}))}" for x in shards)
    what = f"lost shards: {', '.join(missing)}" if missing else f"no step is held by every shard ({held})"
    rejected = sorted({x for d in pi.descs.values() for x in d.rejected})
    if rejected:
        what += f"; replicas rejected by checksum (shard, step): {[list(x) for x in rejected]}"
    bad = sorted({x for d in pi.descs.values() for x in d.bad_sources})
    if bad:
        what += ("; invariant I3 failed: copies that did not match their committed checksum in transit (shard, "
                 f"step, source): {[list(x) for x in bad]}")
    return what


def check(pi: PlanInput) -> str:
    plan = plan_recovery(pi)
    ok_steps, copies = oracle(pi)
    alive = [x for x in pi.old.nodes if x not in pi.dead]
    promoted, dropped, klass, action = expected_membership(pi)
    if pi.old.tp * pi.old.pp > 1 and len(pi.pool) < len(pi.dead) <= len(pi.pool) + pi.expected:
        assert plan.ok is False and plan.wait and plan.topo is None, plan  # (the coordinator waits, then plans again)
        return "mesh-wait"
    assert not plan.wait
    if not alive and not pi.pool:
        assert plan.ok is False and plan.error == (
            f"every node is lost ({', '.join(sorted(pi.dead))}) and no spare is ready"), plan
        return "all-lost"
    if pi.old.tp * pi.old.pp > 1 and len(pi.dead) > len(pi.pool):
        return check_mesh_short(pi, plan)
    assert plan.rejected == sorted({x for d in pi.descs.values() for x in d.rejected})
    if ok_steps:
        assert plan.ok, f"declared lost although steps {sorted(ok_steps)} are recoverable: {plan.error}"
        assert plan.action != "persistent"
        assert plan.resume_step == max(ok_steps), (plan.resume_step, ok_steps)
    else:
        missing = [x for x in (pi.old.shard_name(i) for i in range(pi.old.world)) if not copies.get(x)]
        what = why_lost(pi, copies, missing)
        assert plan.lost == missing
        if pi.manifest is None:
            assert plan.ok is False and plan.error == (
                f"in-memory state lost ({what}) and no complete persistent checkpoint"), plan
            return "lost"
        assert plan.ok and plan.action == "persistent" and plan.resume_step == pi.manifest["step"]
        assert plan.topo is not None and plan.topo.meta["reason"] == what, (plan.topo.meta, what)
    topo = plan.topo
    assert topo is not None and topo.epoch == pi.old.epoch + 1
    assert not set(topo.nodes) & pi.dead, "a dead node is a member"
    assert set(plan.promoted) <= set(pi.pool) and len(set(topo.nodes)) == len(topo.nodes)
    assert set(plan.dropped) <= pi.dead
    assert len(topo.nodes) >= len(pi.old.nodes) - len(plan.dropped)
    assert (plan.promoted, plan.dropped, plan.klass) == (promoted, dropped, klass), (plan, pi)
    assert plan.action == ("persistent" if not ok_steps else action), (plan, pi)
    assert len(topo.nodes) == len(pi.old.nodes) + len(promoted) - len(pi.dead), (topo.nodes, pi)
    assert topo.resume_step == plan.resume_step
    # the new epoch's replica rings: k kept while each ring has k other nodes, racks while they divide the nodes
    n = len(topo.nodes)
    assert topo.replicas == min(pi.replicas, n // pi.old.pp - 1)
    assert topo.racks == (pi.racks if n % pi.racks == 0 and pi.racks <= n else 1), (topo.racks, pi.racks, n)
    for rk in range(topo.world):
        assert len(set(topo.sources(rk)) - {rk}) == topo.replicas
    # what the new epoch records: the generation moves on exactly when the node count changes (no meta: 0)
    gen = int(pi.old.meta.get("generation", 0))
    assert topo.meta["generation"] == gen + (len(topo.nodes) != len(pi.old.nodes)), (topo.meta, pi.old.meta)
    assert (topo.meta["dead"], topo.meta["promoted"], topo.meta["class"], topo.meta["action"],
            topo.meta["dropped"]) == (sorted(pi.dead), plan.promoted, plan.klass, plan.action, plan.dropped)
    if plan.action == "persistent":
        return "persistent"
    r = plan.resume_step
    if "reshard" in topo.meta:
        meta = topo.meta["reshard"]
        assert sorted(int(x) for x in meta["providers"]) == list(range(pi.old.world))
        for i, (prov, kind, crc) in meta["providers"].items():
            name = pi.old.shard_name(int(i))
            w = wid_of(topo, prov)
            assert copies[name][r].get(w) == crc, f"provider {w} of {name} holds no such copy at {r}"
            assert kind == ("own" if name in pi.descs[w].own else "replica"), kind
            owner = wid_of(pi.old, int(i))
            assert owner not in copies[name][r] or w == owner, f"{name}: its owner {owner} holds it, {w} provides it"
        for rk in range(topo.world):
            d = pi.descs.get(wid_of(topo, rk))
            if d is None or r not in d.params or d.stage != topo.layout.coord(rk).name():
                src = pi.descs[wid_of(topo, meta["params_to"][str(rk)])]
                assert r in src.params and src.stage == topo.layout.coord(rk).name()
        keeps_stages(pi.old, topo)
        return "grow" if plan.action == "grow" and pi.old.tp * pi.old.pp > 1 else "reshard"
    by_dst = {t["dst"]: t for t in topo.transfers}
    assert len(by_dst) == len(topo.transfers)
    for rk in range(topo.world):
        w = wid_of(topo, rk)
        name = topo.shard_name(rk)
        stage = topo.layout.coord(rk).name()
        d = pi.descs.get(w)
        t = by_dst.get(rk)
        has_opt = d is not None and r in d.own.get(name, {})
        has_params = d is not None and r in d.params and d.stage == stage
        if t is None:
            assert has_opt and has_params, f"{w} lacks its state at {r} and gets no transfer"
            continue
        assert t["opt_src"] != rk and rk not in t["param_srcs"] and t["param_src"] != rk, f"{w} is its own source"
        if has_opt:  # its own committed shard stays; only the parameters come
            assert t["opt_src"] == -1 and not t.get("local") and t["crc"] == d.own[name][r], t  # type: ignore[union-attr]
            assert t["param_src"] >= 0, f"{w} holds its state at {r}, yet gets a transfer"
        elif t.get("local"):  # the only copy is a replica it keeps itself
            assert t["opt_src"] == -1 and list(copies[name][r]) == [w] and copies[name][r][w] == t["crc"], t
        else:
            src = wid_of(topo, t["opt_src"])
            assert copies[name][r].get(src) == t["crc"], f"{src} holds no verified {name}@{r}"
            assert src != w, f"{w} is sent {name}@{r} from itself"
        if t["param_src"] < 0:
            assert has_params and t["param_srcs"] == [], t
        else:
            src_d = pi.descs[wid_of(topo, t["param_src"])]
            assert r in src_d.params and src_d.stage == stage, f"{w} ({stage}) gets parameters of {src_d.stage}"
            # striped parameter transfers: every source holds this stage's parameters at r, the primary is one
            assert t["param_src"] in t["param_srcs"] and rk not in t["param_srcs"]
            assert t["param_srcs"] == sorted(set(t["param_srcs"]))
            for s in t["param_srcs"]:
                sd = pi.descs[wid_of(topo, s)]
                assert r in sd.params and sd.stage == stage, f"{w} ({stage}) gets a stripe from {sd.stage}"
    return "in-memory"


def keeps_stages(old: Topology, topo: Topology) -> None:
    """Every node of `old` that is a member of `topo` holds the same (pp, tp) stage there: a shrink or a grow of
    a mesh moves no survivor to another piece of the model (its parameters stay valid)."""
    g = old.workers_per_node
    for n in set(old.nodes) & set(topo.nodes):
        for lr in range(g):
            a, b = old.layout.coord(old.rank_of(n, lr)), topo.layout.coord(topo.rank_of(n, lr))
            assert (a.pp, a.tp) == (b.pp, b.tp), (n, lr, a, b)


def check_mesh_short(pi: PlanInput, plan: Plan) -> str:
    """A mesh that lost more nodes than spares are ready and expects no spares to cover the loss, against a brute
    force over the columns: it keeps as many whole data-parallel columns as the ready spares
    can complete (no other choice keeps more), drops the rest whole (their healthy nodes released), keeps every
    survivor on its stage, and repartitions the state of the newest step every shard still has on a member."""
    old = pi.old
    ring = len(old.nodes) // old.pp
    cols = [[old.nodes[p * ring + k] for p in range(old.pp)] for k in range(ring)]
    lost = [sum(x in pi.dead for x in c) for c in cols]
    best = max(len(ks) for m in range(ring + 1) for ks in itertools.combinations(range(ring), m)
               if sum(lost[k] for k in ks) <= len(pi.pool))
    if best == 0:
        assert plan.ok is False and "every data-parallel replica" in plan.error, plan
        return "mesh-none-whole"
    topo = plan.topo
    if topo is None:  # nothing recoverable from the members: stated, with the lost shards
        assert plan.ok is False and "in-memory state lost" in plan.error and pi.manifest is None, plan
        return "mesh-shrink-lost"
    kept = {k for k, c in enumerate(cols) if not set(c) & (set(plan.released) | set(plan.dropped))}
    assert len(kept) == best and sum(lost[k] for k in kept) <= len(pi.pool), (kept, lost, pi.pool)
    gone = [x for k, c in enumerate(cols) if k not in kept for x in c]
    assert plan.dropped == [x for x in old.nodes if x in gone and x in pi.dead]
    assert plan.released == [x for x in old.nodes if x in gone and x not in pi.dead]
    assert topo.meta.get("released", []) == plan.released and plan.action in ("shrink", "persistent")
    assert plan.promoted == pi.pool[: sum(lost[k] for k in kept)]
    assert len(topo.nodes) == best * old.pp and not set(topo.nodes) & (pi.dead | set(plan.released))
    assert topo.layout.dp == old.layout.dp * best // ring and topo.layout.dp >= 1
    keeps_stages(old, topo)
    members = {w: d for w, d in pi.descs.items() if w.rsplit(".", 1)[0] in topo.nodes}
    ok_steps, copies = oracle(replace(pi, descs=members))
    if not ok_steps:
        assert plan.action == "persistent" and pi.manifest is not None and plan.resume_step == pi.manifest["step"]
        return "mesh-shrink-persistent"
    r = plan.resume_step
    assert plan.ok and r == max(ok_steps) and topo.meta["generation"] == int(old.meta.get("generation", 0)) + 1
    meta = topo.meta["reshard"]
    assert meta["old_world"] == old.world and sorted(int(x) for x in meta["providers"]) == list(range(old.world))
    for i, (prov, _kind, crc) in meta["providers"].items():
        name, w = old.shard_name(int(i)), wid_of(topo, prov)
        assert copies[name][r].get(w) == crc, f"provider {w} of {name} holds no such copy at {r}"
        assert topo.layout.coord(prov).stage == old.layout.coord(int(i)).stage, "a shard provided by another stage"
    for rk in range(topo.world):
        d, stage = pi.descs.get(wid_of(topo, rk)), topo.layout.coord(rk).name()
        if d is None or r not in d.params or d.stage != stage:
            src = pi.descs[wid_of(topo, meta["params_to"][str(rk)])]
            assert r in src.params and src.stage == stage
        else:
            assert str(rk) not in meta["params_to"]
    return "mesh-shrink"


def test_planner_against_generated_schedules() -> None:
    rng = random.Random(20261129)
    seen: dict[str, int] = {}
    for _ in range(CASES):
        outcome = check(make_case(rng))
        seen[outcome] = seen.get(outcome, 0) + 1
    # the generator must reach every outcome, or the properties above were not exercised
    for outcome in ("in-memory", "reshard", "persistent", "lost"):
        assert seen.get(outcome, 0) >= 50, seen
    assert feasible_steps(make_case(rng), []) == set()  # no shard named: no step to resume at


def test_planner_mesh_layouts() -> None:
    rng = random.Random(3)
    seen: dict[str, int] = {}
    for _ in range(CASES):
        outcome = check(make_case(rng, mesh=True))
        seen[outcome] = seen.get(outcome, 0) + 1
    for outcome in ("in-memory", "persistent", "lost", "mesh-wait", "mesh-shrink", "mesh-shrink-persistent",
                    "mesh-shrink-lost", "mesh-none-whole"):
        assert seen.get(outcome, 0) >= 50, seen
    assert seen.get("grow", 0) >= 20, seen  # (and test_mesh_grows_back_by_whole_columns)


def test_mesh_grows_back_by_whole_columns() -> None:
    """A shrunk mesh and ready spares, nothing lost: it grows back a whole column (a node per pipeline stage) at
    a time, never past its configured size, never with fewer spares than a column needs; every survivor keeps
    its stage, the new nodes get their own stage's parameters, and every shard comes from its owner."""
    rng = random.Random(54)
    grew = 0
    for _ in range(2000):
        tp, pp = rng.choice([1, 2]), rng.choice([1, 2, 3])
        if tp * pp == 1:
            continue
        cols, target_cols = rng.randint(1, 3), rng.randint(1, 5)
        nodes = [f"n{i}" for i in range(cols * pp)]
        old = Topology(epoch=3, nodes=nodes, workers_per_node=tp, replicas=min(1, cols - 1), resume_step=0,
                       tp=tp, pp=pp, meta={"generation": 1})
        s = rng.randint(2, 9)
        descs = {}
        for rank in range(old.world):
            wid = wid_of(old, rank)
            name = old.shard_name(rank)
            descs[wid] = Descriptor(wid=wid, stage=old.layout.coord(rank).name(), params=[s - 1, s],
                                    own={name: {s: crc_of(name, s)}})
        pool = [f"s{i}" for i in range(rng.randint(0, 7))]
        pi = PlanInput(old=old, dead=set(), restarted=set(), descs=descs, pool=pool, target_nodes=target_cols * pp,
                       replicas=1, racks=1, grow_only=True)
        plan = plan_recovery(pi)
        add = max(0, min(target_cols - cols, len(pool) // pp))
        assert plan.ok and plan.topo is not None, plan.error
        assert plan.promoted == pool[: add * pp] and plan.dropped == plan.released == []
        assert len(plan.topo.nodes) == (cols + add) * pp
        keeps_stages(old, plan.topo)
        if not add:
            assert "reshard" not in plan.topo.meta and plan.topo.nodes == nodes
            continue
        grew += 1
        assert plan.action == "grow" and plan.resume_step == s
        topo, meta = plan.topo, plan.topo.meta["reshard"]
        for i, (prov, kind, crc) in meta["providers"].items():
            assert wid_of(topo, prov) == wid_of(old, int(i)) and kind == "own"
            assert crc == crc_of(old.shard_name(int(i)), s)
        for rk in range(topo.world):
            node, stage = topo.node_of_rank(rk), topo.layout.coord(rk).name()
            if node in pool:
                assert descs[wid_of(topo, meta["params_to"][str(rk)])].stage == stage
            else:
                assert str(rk) not in meta["params_to"]
        assert [topo.nodes[p * (cols + add) + c] for p in range(pp) for c in range(cols)] == nodes
    assert grew >= 300, grew


def test_cascade_spare_that_never_got_its_shard() -> None:
    """A cascade: epoch 1 promoted s0 into slot 3 and a survivor died during the transfer.
    s0 holds nothing of shard 3, but node 0 keeps its replica: the plan must use it."""
    old = Topology(epoch=1, nodes=["n0", "n1", "n2", "s0"], workers_per_node=1, replicas=1, resume_step=4)
    descs = {
        "n0.0": Descriptor(wid="n0.0", params=[4], own={"pp0.tp0.dp0of4": {4: 10}},
                           holdings={"pp0.tp0.dp3of4": {4: 13, 3: 23}}),
        "n2.0": Descriptor(wid="n2.0", params=[4], own={"pp0.tp0.dp2of4": {4: 12}},
                           holdings={"pp0.tp0.dp1of4": {4: 11}}),
        "s0.0": Descriptor(wid="s0.0", params=[4]),
    }
    plan = plan_recovery(PlanInput(old=old, dead={"n1"}, restarted=set(), descs=descs, pool=["s1"], target_nodes=4,
                                   replicas=1, racks=1))
    assert plan.ok, plan.error
    assert plan.topo is not None and plan.topo.nodes == ["n0", "s1", "n2", "s0"] and plan.resume_step == 4
    by_dst = {t["dst"]: t for t in plan.topo.transfers}
    assert by_dst[3]["opt_src"] == 0 and by_dst[3]["crc"] == 13 and by_dst[3]["param_src"] == -1
    assert by_dst[1]["opt_src"] == 2 and by_dst[1]["crc"] == 11


def test_bad_source_is_avoided_and_the_other_replica_used() -> None:
    old = Topology(epoch=1, nodes=["n0", "n1", "n2"], workers_per_node=1, replicas=2, resume_step=4)
    d = {f"n{i}.0": Descriptor(wid=f"n{i}.0", params=[4], own={shard_name(i, 3): {4: i}}) for i in (1, 2)}
    d["n1.0"].holdings = {"pp0.tp0.dp0of3": {4: 7}}
    d["n2.0"].holdings = {"pp0.tp0.dp0of3": {4: 7}}
    d["n2.0"].bad_sources = [("pp0.tp0.dp0of3", 4, "n1.0")]
    plan = plan_recovery(PlanInput(old=old, dead={"n0"}, restarted=set(), descs=d, pool=["s0"], target_nodes=3,
                                   replicas=2, racks=1))
    assert plan.ok and plan.topo is not None
    (t,) = plan.topo.transfers
    assert t["opt_src"] == 2


@pytest.mark.parametrize("spares", [0, 1])
def test_lost_replicas_fall_back_to_persistent_and_shrink_if_short(spares: int) -> None:
    """Two neighbours die (owner and replica holder) with fewer spares than losses."""
    old = Topology(epoch=0, nodes=["n0", "n1", "n2", "n3"], workers_per_node=1, replicas=1, resume_step=0)
    d = {f"n{i}.0": Descriptor(wid=f"n{i}.0", params=[12, 11], own={shard_name(i, 4): {12: i, 11: i}})
         for i in (0, 3)}
    d["n0.0"].holdings = {"pp0.tp0.dp3of4": {12: 3, 11: 3}}  # the ring: node i+1 keeps node i's replica
    d["n3.0"].holdings = {"pp0.tp0.dp2of4": {12: 2, 11: 2}}
    man = {"step": 10, "shards": 4, "numel": 100, "shard_numel": 25, "path": "/ckpt/step_10"}
    plan = plan_recovery(PlanInput(old=old, dead={"n1", "n2"}, restarted=set(), descs=d,
                                   pool=[f"s{i}" for i in range(spares)], target_nodes=4, replicas=1, racks=1,
                                   manifest=man))
    assert plan.ok and plan.action == "persistent" and plan.resume_step == 10
    assert plan.topo is not None and len(plan.topo.nodes) == 2 + spares
    assert plan.topo.meta["generation"] == 1 and plan.lost == ["pp0.tp0.dp1of4"]


@pytest.mark.parametrize("spares", [0, 1, 2])
def test_the_persistent_fallback_plan_whole(spares: int) -> None:
    """The persistent fallback's plan, every field: who is promoted and dropped, the new epoch's topology
    (replicas capped by the nodes left), the generation (bumped only when the node count changes), the
    manifest and the reason it carries, what is lost."""
    old = Topology(epoch=4, nodes=["n0", "n1", "n2", "n3"], workers_per_node=1, replicas=1, resume_step=12,
                   meta={"generation": 2})
    d = {f"n{i}.0": Descriptor(wid=f"n{i}.0", params=[12, 11], own={shard_name(i, 4): {12: i, 11: i}})
         for i in (0, 3)}
    d["n0.0"].holdings = {"pp0.tp0.dp3of4": {12: 3, 11: 3}}
    d["n3.0"].holdings = {"pp0.tp0.dp2of4": {12: 2, 11: 2}}
    d["n3.0"].rejected = [("pp0.tp0.dp1of4", 12)]
    man = {"step": 10, "shards": 4, "numel": 100, "shard_numel": 25, "path": "/ckpt/step_10"}
    pool = [f"s{i}" for i in range(spares)]
    plan = plan_recovery(PlanInput(old=old, dead={"n2", "n1"}, restarted=set(), descs=d, pool=pool, target_nodes=4,
                                   replicas=3, racks=1, manifest=man))
    nodes = ["n0", *pool[:2], "n3"] if spares else ["n0", "n3"]
    dropped = ["n1", "n2"][spares:]
    assert (plan.ok, plan.klass, plan.action, plan.resume_step, plan.persistent_step) == (
        True, "permanent", "persistent", 10, 10)
    assert (plan.promoted, plan.dropped, plan.lost, plan.rejected) == (
        pool, dropped, ["pp0.tp0.dp1of4"], [("pp0.tp0.dp1of4", 12)])
    assert plan.topo == Topology(
        epoch=5, nodes=nodes, workers_per_node=1, replicas=min(3, len(nodes) - 1), racks=1, resume_step=10,
        meta={"dead": ["n1", "n2"], "promoted": pool, "class": "permanent", "action": "persistent",
              "restore": "persistent", "manifest": man, "generation": 2 + (spares < 2),
              "reason": "lost shards: pp0.tp0.dp1of4; replicas rejected by checksum (shard, step): "
                        "[['pp0.tp0.dp1of4', 12]]", "dropped": dropped})


def make_unfinished_reshard(rng: random.Random) -> tuple[PlanInput, int]:
    """The last epoch repartitioned a `p`-rank state onto `q` nodes and a member was lost before it
    finished: the survivors still hold the state in the p-rank layout (own shards and ring replicas),
    the new members nothing. Returns the plan input and p."""
    p, q = rng.randint(1, 5), rng.randint(2, 6)
    while q == p:
        q = rng.randint(2, 6)
    nodes = [f"n{i}" for i in range(q)]
    old = Topology(epoch=rng.randint(1, 5), nodes=nodes, workers_per_node=1, replicas=1, racks=1, resume_step=0,
                   meta={"generation": 1, "reshard": {"old_world": p, "providers": {}, "params_to": {}}})
    src = Topology(epoch=0, nodes=[f"x{i}" for i in range(p)], workers_per_node=1, replicas=min(1, p - 1),
                   racks=1, resume_step=0)
    s = rng.randint(3, 30)
    holders = rng.sample(nodes, min(p, q))  # the members that were in the source layout (rank i of it each)
    dead = set(rng.sample(nodes, rng.randint(1, q - 1)))
    descs: dict[str, Descriptor] = {}
    for n in nodes:
        if n in dead:
            continue
        d = Descriptor(wid=f"{n}.0", stage="pp0.tp0")
        if n in holders:
            i = holders.index(n)
            d.params = sorted({s, s - 1} if rng.random() < 0.7 else {s})
            name = shard_name(i, p)
            d.own[name] = {st: crc_of(name, st) for st in (s, s - 1) if rng.random() < 0.8}
            for j in src.sources(i) if p > 1 else []:
                name = shard_name(j, p)
                d.holdings[name] = {st: crc_of(name, st) for st in (s, s - 1) if rng.random() < 0.6}
        descs[d.wid] = d
    return PlanInput(old=old, dead=dead, restarted=set(), descs=descs, pool=[], target_nodes=q, replicas=1,
                     racks=1, manifest=None), p


def test_planner_after_an_unfinished_repartition() -> None:
    """A member lost during a shrink or grow: the state is still in the layout it came from. The planner
    must plan from that layout (a repartition of every source shard onto the nodes left) whenever a
    step has a copy of every source shard, pick the newest such step, and name a provider that holds
    each shard at it; it declares the state lost only when no such step exists."""
    rng = random.Random(7)
    seen = {"planned": 0, "lost": 0}
    for _ in range(2000):
        pi, p = make_unfinished_reshard(rng)
        names = [shard_name(i, p) for i in range(p)]
        copies: dict[str, set[int]] = {}
        for d in pi.descs.values():
            for srcs in (d.own, d.holdings):
                for name, steps in srcs.items():
                    copies.setdefault(name, set()).update(steps)
        params = {st for d in pi.descs.values() for st in d.params}
        ok = {st for st in params if all(st in copies.get(x, set()) for x in names)}
        plan = plan_recovery(pi)
        if not ok:
            assert not plan.ok and "in-memory state lost" in plan.error, plan
            # named in the layout the state is in, not the new one's shards, which nobody holds yet
            assert plan.lost == [x for x in names if not copies.get(x)], (plan.lost, names)
            seen["lost"] += 1
            continue
        assert plan.ok, f"declared lost although steps {sorted(ok)} are recoverable: {plan.error}"
        assert plan.resume_step == max(ok)
        assert plan.topo is not None
        meta = plan.topo.meta["reshard"]
        assert meta["old_world"] == p and sorted(meta["providers"], key=int) == [str(i) for i in range(p)]
        for i, (rank, _kind, crc) in meta["providers"].items():
            w = f"{plan.topo.node_of_rank(rank)}.0"
            name = shard_name(int(i), p)
            held = {**pi.descs[w].own.get(name, {}), **pi.descs[w].holdings.get(name, {})}
            assert plan.resume_step in held and crc == held[plan.resume_step], (i, w)
        for rk, src in meta["params_to"].items():
            assert plan.resume_step in pi.descs[f"{plan.topo.node_of_rank(src)}.0"].params
            assert plan.resume_step not in pi.descs[f"{plan.topo.node_of_rank(int(rk))}.0"].params
        seen["planned"] += 1
    assert seen["planned"] > 300 and seen["lost"] > 100, seen


def test_descriptors_round_trip_through_their_json_form() -> None:
    """What a survivor posts is what the planner reads: every field of generated descriptors survives
    to_json -> JSON text -> from_json (step keys become strings on the way and come back as ints), and the
    fields a descriptor leaves out read back as their defaults."""
    import json

    rng = random.Random(61)
    for _ in range(300):
        pi = make_case(rng, mesh=rng.random() < 0.5)
        for d in pi.descs.values():
            d.rejected = [(shard_name(rng.randrange(4), 4), rng.randint(0, 9)) for _ in range(rng.randint(0, 2))]
            d.bad_sources = [(shard_name(0, 4), rng.randint(0, 9), f"n{rng.randint(0, 5)}.0")
                             for _ in range(rng.randint(0, 2))]
            d.t, d.error = rng.random() * 100, rng.choice(["", "peer failure: n3 lost"])
            d.parity = {f"g{rng.randint(0, 3)}.p0": {rng.randint(0, 9): {"crc": rng.randint(1, 99)}}
                        for _ in range(rng.randint(0, 2))}
            d.params_crc = {st: rng.randint(1, 2**32 - 1) for st in d.params}
            back = Descriptor.from_json(json.loads(json.dumps(d.to_json())))
            assert back == d, (back, d)
    assert Descriptor.from_json({"wid": "n1.0"}) == Descriptor(wid="n1.0")


def test_decode_jobs_name_their_group_and_the_shards_of_a_mesh_layout() -> None:
    """Erasure-coded groups on every data-parallel ring of a (tp, pp) mesh; a node is lost and a spare takes
    its slot, and each of its shards, copied nowhere, is rebuilt from its group. Each decode job names its
    group (gid, h), its members by their index in the layout (tensor and pipeline coordinates included), the
    members it rebuilds (`lost`), the pieces it reads; the transfer to each of the spare's ranks points at
    the job that rebuilds its shard."""
    rng = random.Random(5)
    for _ in range(80):
        tp, pp, dp = rng.choice([1, 2]), rng.choice([1, 2]), rng.randint(3, 5)
        h = rng.randint(1, 2)
        d = rng.randint(1, dp - h)
        old = Topology(epoch=2, nodes=[f"n{i}" for i in range(dp * pp)], workers_per_node=tp, replicas=1,
                       resume_step=0, tp=tp, pp=pp)
        lay, g, r = old.layout, tp, rng.randint(3, 20)
        rings = sorted({tuple(lay.dp_group(x)) for x in range(old.world)})
        groups = [grp for ring in rings for grp in place_groups([RingRank(rank=x, node=x // g) for x in ring], d, h)]
        dead = rng.choice(old.nodes)
        descs = {wid_of(old, x): Descriptor(wid=wid_of(old, x), stage=lay.coord(x).name(), params=[r],
                                            own={old.shard_name(x): {r: crc_of(old.shard_name(x), r)}})
                 for x in range(old.world) if old.node_of_rank(x) != dead}
        for gid, grp in enumerate(groups):
            names = [old.shard_name(m) for m in grp.members]
            for j, holder in enumerate(grp.parity):
                if wid_of(old, holder) in descs:
                    pn = parity_name(names, j)
                    descs[wid_of(old, holder)].parity[pn] = {r: {
                        "crc": crc_of(pn, r), "j": j, "h": grp.h, "gid": gid, "members": names,
                        "mcrc": [crc_of(x, r) for x in names]}}
        plan = plan_recovery(PlanInput(old=old, dead={dead}, restarted=set(), descs=descs, pool=["s0"],
                                       target_nodes=len(old.nodes), replicas=1, racks=1))
        assert plan.ok and plan.resume_step == r and plan.topo is not None, plan.error
        topo = plan.topo
        lost_ranks = [x for x in range(old.world) if old.node_of_rank(x) == dead]
        jobs = topo.meta["decode"]
        want = {gid: grp for gid, grp in enumerate(groups) if set(grp.members) & set(lost_ranks)}
        assert sorted(j["gid"] for j in jobs) == sorted(want), (jobs, want)
        for job in jobs:
            grp = want[job["gid"]]
            lost = [i for i, m in enumerate(grp.members) if m in lost_ranks]
            assert (job["world"], job["shards"], job["h"], job["lost"], job["step"]) == (
                old.world, list(grp.members), grp.h, lost, r)
            assert job["mcrc"] == [crc_of(old.shard_name(m), r) for m in grp.members]
            assert {int(i): dst for i, dst in job["to"].items()} == {i: grp.members[i] for i in lost}
            assert len(job["pieces"]) == grp.d and all(wid_of(topo, p["src"]) == p["wid"] for p in job["pieces"])
        by_dst = {t["dst"]: t for t in topo.transfers}
        for x in lost_ranks:
            t = by_dst[x]
            job = jobs[t["decode"]]
            assert x in job["shards"] and t["opt_src"] == -1 and t["crc"] == crc_of(old.shard_name(x), r)
            # the spare gets its stage's parameters, in stripes, from the stage's survivors
            assert t["param_src"] in t["param_srcs"] and all(
                lay.coord(p).name() == lay.coord(x).name() and old.node_of_rank(p) != dead for p in t["param_srcs"])
        # the evidence the restore is checked against: every shard's committed checksum at r, the rebuilt ones'
        # from their group
        ev = topo.meta["evidence"]
        assert ev["step"] == r and all(ev["opt"][str(x)][str(r)] == crc_of(old.shard_name(x), r)
                                       for x in range(old.world)), ev


def test_parameters_come_in_stripes_from_the_primary_and_the_next_holders() -> None:
    """A member that lacks the parameters gets them from STRIPES members of its stage, a stripe each: the
    primary (round-robin by its rank over the holders, in worker-id order) and the holders after it."""
    old = Topology(epoch=3, nodes=[f"n{i}" for i in range(8)], workers_per_node=1, replicas=1, resume_step=6)
    descs = {f"n{i}.0": Descriptor(wid=f"n{i}.0", params=[6], own={shard_name(i, 8): {6: 1 + i}},
                                   holdings={shard_name((i - 1) % 8, 8): {6: 1 + (i - 1) % 8}})
             for i in range(8) if i != 3}
    plan = plan_recovery(PlanInput(old=old, dead={"n3"}, restarted=set(), descs=descs, pool=["s0"], target_nodes=8,
                                   replicas=1, racks=1))
    assert plan.ok and plan.topo is not None, plan.error
    (t,) = plan.topo.transfers
    # holders n0 n1 n2 n4 n5 n6 n7; rank 3's primary is the 4th (n4, rank 4), then n5, n6, n7
    assert (t["dst"], t["param_src"], t["param_srcs"], t["opt_src"], t["crc"]) == (3, 4, [4, 5, 6, 7], 4, 4)
    assert STRIPES == 4


def test_lost_shards_are_named_in_the_layout_some_member_already_holds() -> None:
    """A repartition (2 -> 3 nodes) that did not complete and no step recoverable in either layout: the lost
    shards are named in the source layout only while no member holds a shard of the new one; once a member
    holds one, they are the new layout's shards nobody holds."""
    old = Topology(epoch=2, nodes=["n0", "n1", "n2"], workers_per_node=1, replicas=1, resume_step=5,
                   meta={"generation": 1, "reshard": {"old_world": 2, "providers": {}, "params_to": {}}})
    descs = {"n0.0": Descriptor(wid="n0.0", params=[5], own={shard_name(0, 2): {5: 1}}),
             "n1.0": Descriptor(wid="n1.0", params=[5])}
    pi = PlanInput(old=old, dead={"n2"}, restarted=set(), descs=descs, pool=[], target_nodes=3, replicas=1, racks=1)
    plan = plan_recovery(pi)
    assert plan.ok is False and plan.lost == [shard_name(1, 2)], plan
    descs["n1.0"].own = {shard_name(1, 3): {5: 2}}
    plan = plan_recovery(pi)
    assert plan.ok is False and plan.lost == [shard_name(0, 3), shard_name(2, 3)], plan
