"""The recovery planner: a pure function from what survives to the next epoch's plan.

The coordinator gathers one *descriptor* per surviving worker (which steps its parameter
buffers hold, which steps of which logical shards it holds as its own committed state or as
verified replicas, with their checksums) and decides which nodes are dead; `plan_recovery`
then decides everything else, without any I/O, so that it can be property-tested over
thousands of generated fault schedules (tests/test_planner.py):

- membership: each dead node's slot gets a ready spare; without one the job shrinks (the slot is
  dropped) and later grows back when spares are ready again. Under 3D parallelism a node is a piece of
  one pipeline, so a mesh short of spares waits (a `wait` plan) when the spares it expects cover the
  loss, and otherwise shrinks by whole data-parallel replicas: every column of the mesh (the k-th node
  of each stage) that lost a node and gets no spare leaves, its healthy nodes are released as spares,
  and the state is repartitioned over the survivors from the copies they hold; it grows back a whole
  column at a time. A script's model sharded over its ranks cannot shrink (a clear error);
- the recovery step r: the newest step for which every logical shard has a verified copy
  *somewhere* (its owner, a spare that completed its transfer in an earlier epoch, any replica
  holder - whatever happened in earlier epochs) and some member still holds the parameters;
- sources: for every member that lacks its shard or the parameters at r, a transfer from a
  member that has them, with the checksum the shard's owner committed for (shard, r), so the
  receiver verifies it (invariant I3); sources that already delivered a bad copy are excluded;
- erasure-coded groups (`ec:D+H`): a shard with no copy left is still recoverable at a step where
  its group holds d pieces of that step (`redundancy.decodable`); the plan then carries a decode
  job (`meta["decode"]`: which pieces, from which ranks, rebuilt for which destination);
- when no step is held by every shard: the newest complete persistent checkpoint (on whatever
  nodes are left, shrinking if spares are short), else a failure naming the lost shards.

Shards are named by their logical id (`pp{p}.tp{t}.dp{i}of{D}`), never by rank: a rank number
means nothing across epochs, a logical id does. Parameters are per (pp, tp) *stage*: a member that
lacks them gets them from a member of the same stage (its data-parallel peer).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.protect.redundancy.decodable import DecodeJob, decode_options
from phoenixft.recovery.evidence import plan_evidence

__all__ = ["Descriptor", "PlanInput", "Plan", "plan_recovery", "feasible_steps", "columns", "mesh_membership",
           "grown", "STRIPES"]

STRIPES = 4  # at most this many peers send a member its parameters, a stripe each (recovery/transfer.py)


@dataclass(kw_only=True)
class Descriptor:
    """What one surviving worker reports at the start of a recovery."""

    wid: str
    params: list[int] = field(default_factory=list)  # steps whose full parameters (of its stage) it holds
    stage: str = ""  # the (pp, tp) coordinate its parameters belong to, "pp0.tp0" when data-parallel only
    own: dict[str, dict[int, int]] = field(default_factory=dict)  # shard -> {step: crc}, its committed state
    holdings: dict[str, dict[int, int]] = field(default_factory=dict)  # shard -> {step: crc}, verified replicas
    params_crc: dict[int, int] = field(default_factory=dict)  # step -> checksum of its parameters (host-resident)
    parity: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # ec: parity name -> {step: entry}
    rejected: list[tuple[str, int]] = field(default_factory=list)  # replicas whose checksum failed
    bad_sources: list[tuple[str, int, str]] = field(default_factory=list)  # (shard, step, wid) that sent bad data
    t: float = 0.0
    error: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Descriptor:
        def steps(m: dict[str, Any]) -> dict[str, dict[int, int]]:
            return {s: {int(k): int(v) for k, v in x.items()} for s, x in m.items()}

        return cls(wid=d["wid"], params=[int(x) for x in d.get("params", [])], own=steps(d.get("own", {})),
                   holdings=steps(d.get("holdings", {})), rejected=[(a, int(b)) for a, b in d.get("rejected", [])],
                   bad_sources=[(a, int(b), c) for a, b, c in d.get("bad_sources", [])], t=float(d.get("t", 0.0)),
                   error=str(d.get("error", "")), stage=str(d.get("stage", "")),
                   parity={p: {int(k): v for k, v in x.items()} for p, x in d.get("parity", {}).items()},
                   params_crc={int(k): int(v) for k, v in d.get("params_crc", {}).items()})

    def to_json(self) -> dict[str, Any]:
        return {"wid": self.wid, "params": self.params,
                "own": {s: {str(k): v for k, v in x.items()} for s, x in self.own.items()},
                "holdings": {s: {str(k): v for k, v in x.items()} for s, x in self.holdings.items()},
                "rejected": [list(x) for x in self.rejected], "bad_sources": [list(x) for x in self.bad_sources],
                "t": self.t, "error": self.error, "stage": self.stage,
                "parity": {p: {str(k): v for k, v in x.items()} for p, x in self.parity.items()},
                "params_crc": {str(k): v for k, v in self.params_crc.items()}}


@dataclass(kw_only=True)
class PlanInput:
    old: Topology
    dead: set[str]  # nodes declared dead (exited, fenced)
    restarted: set[str]  # workers restarted in place by their agent
    descs: dict[str, Descriptor]  # wid -> descriptor, every worker of every live node of `old`
    pool: list[str]  # ready spare nodes, in order of preference
    target_nodes: int  # the configured node count (grow back up to it)
    replicas: int
    racks: int
    manifest: dict[str, Any] | None = None  # newest complete persistent checkpoint, if any
    grow_only: bool = False  # nothing failed: a spare arrived after a shrink
    fixed_size: bool = False  # the job cannot change its node count (a script's model sharded over its ranks)
    expected: int = 0  # spares expected to be ready within the coordinator's bounded wait (repairs, starting spares)


@dataclass(kw_only=True)
class Plan:
    ok: bool
    error: str = ""
    topo: Topology | None = None
    klass: str = ""
    action: str = ""
    resume_step: int = -1
    promoted: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    rejected: list[tuple[str, int]] = field(default_factory=list)
    persistent_step: int | None = None
    released: list[str] = field(default_factory=list)  # healthy nodes of dropped replicas: spares from now on
    wait: bool = False  # not ok yet: wait (bounded) for the expected spares, then plan again


def _copies(pi: PlanInput) -> dict[str, dict[int, dict[str, int]]]:
    """shard -> step -> {holder wid: crc}: every verified copy of every shard, minus bad sources."""
    bad = {(s, st, w) for d in pi.descs.values() for s, st, w in d.bad_sources}
    out: dict[str, dict[int, dict[str, int]]] = {}
    for w, d in pi.descs.items():
        for src in (d.own, d.holdings):
            for shard, steps in src.items():
                for st, crc in steps.items():
                    if (shard, st, w) not in bad:
                        out.setdefault(shard, {}).setdefault(st, {})[w] = crc
    return out


def _stage(d: Descriptor) -> str:
    return d.stage or "pp0.tp0"


def _stages(topo: Topology) -> list[str]:
    lay = topo.layout
    return sorted({lay.coord(r).name() for r in range(topo.world)})


def _decodable(pi: PlanInput, copies: dict[str, dict[int, dict[str, int]]]) -> dict[str, dict[int, DecodeJob]]:
    """shard -> step -> the decode job that rebuilds it from its group (ec), where it has no copy."""
    bad = {(s, st, w) for d in pi.descs.values() for s, st, w in d.bad_sources}
    return decode_options(copies, {w: d.parity for w, d in pi.descs.items() if d.parity}, bad)


def feasible_steps(pi: PlanInput, shards: list[str]) -> set[int]:
    """Steps at which every shard has a verified copy (or can be rebuilt from its group) and, for every
    stage, some live member holds that stage's parameters."""
    copies = _copies(pi)
    dec = _decodable(pi, copies)
    per_shard = [set(copies.get(s, {})) | set(dec.get(s, {})) for s in shards]
    common = set.intersection(*per_shard) if per_shard else set()
    for stage in _stages(pi.old):
        common &= {st for d in pi.descs.values() if _stage(d) == stage for st in d.params}
    return common


def _wid(topo: Topology, rank: int) -> str:
    return f"{topo.node_of_rank(rank)}.{rank % topo.workers_per_node}"


def plan_recovery(pi: PlanInput) -> Plan:
    old, g = pi.old, pi.old.workers_per_node
    shards = [old.shard_name(i) for i in range(old.world)]
    rejected = sorted({x for d in pi.descs.values() for x in d.rejected})
    # --- membership: a spare per dead slot, else drop the slot (a mesh: its data-parallel replicas); grow back
    mesh, lost_nodes = old.tp * old.pp > 1, len(pi.dead & set(old.nodes))
    if (mesh or pi.fixed_size) and len(pi.pool) < lost_nodes <= len(pi.pool) + pi.expected:
        # a node of a mesh (or of a model sharded over the ranks) is a piece of the model: the spares it expects
        # cover the loss, so it waits for them (bounded) rather than drop whole replicas
        return Plan(ok=False, wait=True, error=f"{', '.join(sorted(pi.dead))} lost with {len(pi.pool)} spare(s) "
                                               f"ready: waiting for {lost_nodes - len(pi.pool)} more")
    if mesh and not pi.fixed_size and lost_nodes > len(pi.pool) and (set(old.nodes) - pi.dead or pi.pool):
        cut = mesh_membership(pi)
        if isinstance(cut, Plan):
            return cut
        nodes, promoted, dropped, released = cut
        pi = _members_only(pi, nodes)
    else:
        nodes, promoted, dropped, released = _slot_membership(pi)
    if not nodes:
        return Plan(ok=False, error=f"every node is lost ({', '.join(sorted(pi.dead))}) and no spare is ready")
    if pi.fixed_size and dropped:
        return Plan(ok=False, error=f"{', '.join(dropped)} lost and no spare ready: the script's model is sharded over "
                                    "its ranks (FSDP), which cannot drop one (run with more --spares, or "
                                    "--repair-after)")
    grew = False
    if not dropped and not pi.fixed_size:  # back to the configured size while spares last (a mesh: whole columns)
        nodes, added = grown(old, nodes, pi.pool[len(promoted):], pi.target_nodes)
        promoted += added
        grew = bool(added)
    if pi.dead:
        klass, action = "permanent", "hotswap"
    elif pi.restarted:
        klass, action = "transient", "inplace"
    elif pi.grow_only or grew:
        klass, action = "planned", "grow"
    else:
        klass, action = "transient", "reconfigure"
    if dropped:
        action = "shrink"
    elif grew and not pi.dead:
        action = "grow"
    # --- the recovery step
    copies = _copies(pi)
    steps = feasible_steps(pi, shards)
    src_world = old.world
    if not steps and "reshard" in old.meta:
        # the last epoch's repartition did not complete (a member lost during it): the state is still in
        # the layout it came from, so plan from that one, as a repartition onto the nodes left
        prev = int(old.meta["reshard"]["old_world"])
        prev_shards = [shard_name(i, prev, old.tp, old.pp) for i in range(prev)]
        prev_steps = feasible_steps(pi, prev_shards)
        if prev_steps or not any(copies.get(s) for s in shards):
            # (and when no step is recoverable either, what is lost is named in that layout: no member
            # holds any shard of the new one yet, so naming those would call every shard lost)
            shards, steps, src_world = prev_shards, prev_steps, prev
    dec = _decodable(pi, copies)
    lost = [s for s in shards if not copies.get(s) and not dec.get(s)]
    if not steps:
        held = "; ".join(f"{s}: {sorted(copies.get(s, {}))}" for s in shards)
        what = f"lost shards: {', '.join(lost)}" if lost else f"no step is held by every shard ({held})"
        if rejected:
            what += f"; replicas rejected by checksum (shard, step): {[list(x) for x in rejected]}"
        bad = sorted({x for d in pi.descs.values() for x in d.bad_sources})
        if bad:
            what += ("; invariant I3 failed: copies that did not match their committed checksum in transit "
                     f"(shard, step, source): {[list(x) for x in bad]}")
        if pi.manifest is None:
            return Plan(ok=False, error=f"in-memory state lost ({what}) and no complete persistent checkpoint",
                        lost=lost, rejected=rejected)
        return _released(_persistent(pi, nodes, promoted, dropped, klass, what, rejected, lost), released)
    r = max(steps)
    return _released(_in_memory(pi, r, copies, nodes, promoted, dropped, klass, action, rejected, g, src_world),
                     released)


def _released(plan: Plan, released: list[str]) -> Plan:
    """The plan, naming the healthy nodes of the dropped replicas (their workers wait to be promoted again)."""
    plan.released = list(released)
    if plan.topo is not None and released:
        plan.topo.meta["released"] = list(released)
    return plan


def _slot_membership(pi: PlanInput) -> tuple[list[str], list[str], list[str], list[str]]:
    """(nodes, promoted, dropped, released): a ready spare per dead slot in slot order, the slots left over
    dropped (a data-parallel job, where a node is a whole replica)."""
    pool = list(pi.pool)
    nodes, promoted, dropped = [], [], []
    for n in pi.old.nodes:
        if n not in pi.dead:
            nodes.append(n)
        elif pool:
            nodes.append(pool.pop(0))
            promoted.append(nodes[-1])
        else:
            dropped.append(n)
    return nodes, promoted, dropped, []


def columns(topo: Topology) -> list[list[str]]:
    """The mesh's columns: column k is the k-th node of every pipeline stage's block of slots. A column holds
    whole data-parallel replicas (workers_per_node / tp of them, every tp x pp rank of each) and nothing else,
    so dropping one leaves a mesh of the same tp x pp with fewer data-parallel ranks, in which every other
    node keeps its stage."""
    n = topo.ring_nodes
    return [[topo.nodes[p * n + k] for p in range(topo.pp)] for k in range(n)]


def mesh_membership(pi: PlanInput) -> tuple[list[str], list[str], list[str], list[str]] | Plan:
    """A mesh lost more nodes than spares are ready, and expects no spares that would cover the loss: shrink by
    whole data-parallel replicas. The columns with the fewest lost nodes are
    kept (their lost nodes get the ready spares, so that as many replicas as possible survive), the others
    dropped: their lost nodes leave, their healthy nodes are released as spares. (nodes, promoted, dropped,
    released) in the layout's slot order, or a failed plan when no replica is left whole."""
    old, dead = pi.old, pi.dead & set(pi.old.nodes)
    cols = columns(old)
    lost = [sum(n in dead for n in c) for c in cols]
    keep, budget = set(), len(pi.pool)
    for k in sorted(range(len(cols)), key=lambda k: (lost[k], k)):
        if lost[k] <= budget:
            keep.add(k)
            budget -= lost[k]
    if not keep:
        return Plan(ok=False, error=f"{', '.join(sorted(dead))} lost and no spare ready: every data-parallel replica "
                                    f"of the {old.tp}x{old.pp} (tp x pp) mesh lost a node, none is left to train on "
                                    "(run with more --spares, or --repair-after)")
    pool = list(pi.pool)
    nodes, promoted = [], []
    for p in range(old.pp):
        for k in sorted(keep):
            n = cols[k][p]
            if n in dead:
                n = pool.pop(0)
                promoted.append(n)
            nodes.append(n)
    gone = [n for k, c in enumerate(cols) if k not in keep for n in c]
    dropped = [n for n in old.nodes if n in gone and n in dead]
    released = [n for n in old.nodes if n in gone and n not in dead]
    return nodes, promoted, dropped, released


def _members_only(pi: PlanInput, nodes: list[str]) -> PlanInput:
    """`pi` with the descriptors of the new epoch's members only: what the released nodes hold leaves with them
    (a provider must be a member of the epoch that repartitions the state)."""
    keep = set(nodes)
    return replace(pi, descs={w: d for w, d in pi.descs.items() if w.rsplit(".", 1)[0] in keep})


def grown(old: Topology, nodes: list[str], pool: list[str], target: int) -> tuple[list[str], list[str]]:
    """`nodes` grown back towards `target` with spares of `pool` while they last: one node at a time when
    data-parallel only, a whole column (one node at the end of every stage's block) at a time in a mesh.
    (nodes, the spares added)."""
    per, free = old.pp, list(pool)
    add = min((target - len(nodes)) // per, len(free) // per) if target > len(nodes) else 0
    if add <= 0:
        return nodes, []
    n = len(nodes) // per
    out, added = [], []
    for p in range(per):
        out += nodes[p * n : (p + 1) * n]
        for _ in range(add):
            added.append(free.pop(0))
            out.append(added[-1])
    return out, added


def _new_topo(pi: PlanInput, nodes: list[str], r: int, meta: dict[str, Any],
              transfers: list[dict[str, Any]] | None = None) -> Topology:
    n = len(nodes)
    old = pi.old
    replicas = min(pi.replicas, n // old.pp - 1)
    racks = pi.racks if n % pi.racks == 0 and pi.racks <= n else 1
    return Topology(epoch=old.epoch + 1, nodes=nodes, workers_per_node=old.workers_per_node,
                    replicas=replicas, racks=racks, resume_step=r, transfers=transfers or [], meta=meta,
                    tp=old.tp, pp=old.pp)


def _persistent(pi: PlanInput, nodes: list[str], promoted: list[str], dropped: list[str], klass: str, what: str,
                rejected: list[tuple[str, int]], lost: list[str]) -> Plan:
    man = pi.manifest
    assert man is not None
    gen = int(pi.old.meta.get("generation", 0)) + (1 if len(nodes) != len(pi.old.nodes) else 0)
    meta = {"dead": sorted(pi.dead), "promoted": promoted, "class": klass, "action": "persistent",
            "restore": "persistent", "manifest": man, "generation": gen, "reason": what, "dropped": dropped}
    topo = _new_topo(pi, nodes, int(man["step"]), meta)
    return Plan(ok=True, topo=topo, klass=klass, action="persistent", resume_step=int(man["step"]),
                promoted=promoted, dropped=dropped, lost=lost, rejected=rejected, persistent_step=int(man["step"]))


def _pick(candidates: dict[str, int], k: int, prefer: set[str]) -> tuple[str, int]:
    """A holder of a copy (round-robin by k), preferring `prefer` (the owner itself)."""
    names = sorted(candidates)
    own = [w for w in names if w in prefer]
    w = own[0] if own else names[k % len(names)]
    return w, candidates[w]


def _opt_source(new: Topology, rk: int, wid: str, held: dict[str, int], own_crc: int | None) -> dict[str, Any]:
    """Where rank rk (member wid) gets its optimizer shard from, among the verified copies `held` ({holder: crc}):
    nowhere when it holds it committed itself (`own_crc`: a worker restarted in place whose copy of the
    parameters had not committed when it died gets only those), from the copy its own scheme keeps when no
    other member holds one (`local`), else from another holder; never from itself over the wire."""
    if own_crc is not None:
        return {"opt_src": -1, "crc": own_crc}
    others = {w: c for w, c in held.items() if w != wid}
    if not others:
        return {"opt_src": -1, "crc": held[wid], "local": True}
    w, crc = _pick(others, rk, set())
    return {"opt_src": new.rank_of(*_split(w)), "crc": crc}


def _in_memory(pi: PlanInput, r: int, copies: dict[str, dict[int, dict[str, int]]], nodes: list[str],
               promoted: list[str], dropped: list[str], klass: str, action: str,
               rejected: list[tuple[str, int]], g: int, src_world: int | None = None) -> Plan:
    """The plan from in-memory copies of step r. `src_world`: the data-parallel world whose layout the
    state is in (the last topology's unless its repartition did not complete); when it differs, the
    state is repartitioned onto the new nodes, whatever their number."""
    old = pi.old
    src_world = old.world if src_world is None else src_world
    gen = int(old.meta.get("generation", 0))
    base_meta: dict[str, Any] = {"dead": sorted(pi.dead), "promoted": promoted, "class": klass, "action": action,
                                 "dropped": dropped}
    by_stage: dict[str, list[str]] = {}
    for w, dd in sorted(pi.descs.items()):
        if r in dd.params:
            by_stage.setdefault(_stage(dd), []).append(w)
    dec = _decodable(pi, copies)
    jobs: list[dict[str, Any]] = []  # meta["decode"]: the decode jobs this plan runs

    def job_for(shard: str, dst: int) -> int:
        """Index of the decode job that rebuilds `shard` for rank dst (one job per group and step)."""
        job = dec[shard][r]
        for x, j in enumerate(jobs):
            if j["key"] == list(job.key):
                j["to"][str(job.members.index(shard))] = dst
                return x
        # the shards are named in the layout the state is in: after a repartition that did not complete,
        # the one it came from (src_world), not the last topology's
        ids = {shard_name(k, src_world, old.tp, old.pp): k for k in range(src_world)}
        jobs.append({"key": list(job.key), "step": r, "gid": job.gid, "h": job.h, "world": src_world,
                     "shards": [ids[x] for x in job.members], "mcrc": job.mcrc, "lost": job.lost,
                     "pieces": [{"index": p.index, "name": p.name, "wid": p.holder, "crc": p.crc,
                                 "src": new.rank_of(*_split(p.holder))} for p in job.pieces],
                     "to": {str(job.members.index(shard)): dst}})
        return len(jobs) - 1

    if len(nodes) == len(old.nodes) and src_world == old.world:
        new = _new_topo(pi, nodes, r, {**base_meta, "generation": gen})
        lay = new.layout
        transfers: list[dict[str, Any]] = []
        for rk in range(new.world):
            wid = _wid(new, rk)
            shard = new.shard_name(rk)
            stage = lay.coord(rk).name()
            d = pi.descs.get(wid)
            has_opt = d is not None and r in d.own.get(shard, {})
            has_params = d is not None and r in d.params and _stage(d) == stage
            if has_opt and has_params:
                continue
            peers = by_stage[stage]
            par_src = -1 if has_params else new.rank_of(*_split(peers[rk % len(peers)]))
            # members holding this stage's parameters at r send a stripe each (they are identical): the
            # primary and the next ones round the stage, at most STRIPES (a receiver's link saturates)
            par_srcs = [] if has_params else sorted({new.rank_of(*_split(p)) for p in
                                                     (peers[(rk + i) % len(peers)] for i in range(STRIPES))
                                                     if p != wid})
            if r not in copies.get(shard, {}):  # no copy left anywhere: rebuilt from its group's pieces
                x = job_for(shard, rk)
                transfers.append({"dst": rk, "shard": rk, "param_src": par_src, "param_srcs": par_srcs,
                                  "opt_src": -1, "crc": dec[shard][r].mcrc[dec[shard][r].members.index(shard)],
                                  "decode": x})
                continue
            own_crc = d.own[shard][r] if d is not None and has_opt else None
            transfers.append({"dst": rk, "shard": rk, "param_src": par_src, "param_srcs": par_srcs,
                              **_opt_source(new, rk, wid, copies[shard][r], own_crc)})
        new.transfers = transfers
        new.meta["evidence"] = plan_evidence(pi, r, {t["shard"]: t["crc"] for t in transfers if "decode" in t})
        if jobs:
            new.meta["decode"] = jobs
        return Plan(ok=True, topo=new, klass=klass, action=action, resume_step=r, promoted=promoted,
                    dropped=dropped, rejected=rejected)
    # the world changes size: repartition (every old shard gets one provider in the new epoch)
    new = _new_topo(pi, nodes, r, {**base_meta, "generation": gen + 1})
    providers: dict[str, list[Any]] = {}
    for i in range(src_world):
        shard = shard_name(i, src_world, old.tp, old.pp)
        owner = _wid(old, i) if src_world == old.world else ""  # (the source layout's owners are not known)
        if r not in copies.get(shard, {}):  # rebuilt from its group by the holder of the first piece
            job = dec[shard][r]
            decoder = new.rank_of(*_split(job.pieces[0].holder))
            job_for(shard, decoder)
            providers[str(i)] = [decoder, "decode", job.mcrc[job.members.index(shard)]]
            continue
        w, crc = _pick(copies[shard][r], i, {owner})
        providers[str(i)] = [new.rank_of(*_split(w)), "own" if shard in pi.descs[w].own else "replica", crc]
    params_to = {}
    for rk in range(new.world):  # a member without its stage's parameters at r gets them from one that has them
        d, stage = pi.descs.get(_wid(new, rk)), new.layout.coord(rk).name()
        if d is None or r not in d.params or _stage(d) != stage:
            peers = by_stage[stage]
            params_to[str(rk)] = new.rank_of(*_split(peers[rk % len(peers)]))
    new.meta["reshard"] = {"old_world": src_world, "providers": providers, "params_to": params_to}
    if jobs:
        new.meta["decode"] = jobs
    return Plan(ok=True, topo=new, klass=klass, action=action, resume_step=r, promoted=promoted,
                dropped=dropped, rejected=rejected)


def _split(wid: str) -> tuple[str, int]:
    node, lr = wid.rsplit(".", 1)
    return node, int(lr)
