"""`phoenixft chaos`: a seeded fault campaign, to trust the system on your own setup before a long job.

Three parts:

- `make_schedule(cfg, faults, seed)`: a pure function of (seed, config) that draws N faults from
  kill (forward, backward, replicate or optimizer phase), crash (a worker exits and is restarted in
  place), hang (SIGSTOP; found by `--failure-timeout`), corrupt replica (bytes flipped in a replica
  at rest, then the shard's owner killed, so the checksum has to reject the copy), kill during a
  recovery (a node killed at step S, another node killed mid state transfer of that recovery),
  coordinator kill and two nodes at once. Faults are spread over the steps, at least `MIN_GAP`
  steps apart: a fault fires when training reaches its step, and training only gets there once
  the previous recovery completed (kill-during-recovery overlaps two failures on purpose). With
  N >= 7 every kind is drawn at least once. Each fault says which node slots it loses together and
  whether that is survivable *by design*: every logical shard must keep a copy (its owner or a
  replica holder; node i's replicas live on the next `--replicas` nodes of the ring, racks first)
  or a complete persistent checkpoint must exist (`--persist-every`, with a spare per lost node).
  Pairs of nodes are drawn survivable unless `allow_unsurvivable`.
- `judge(...)`: the verdict of a finished campaign against its failure-free reference: `pass`,
  `fail` (a survivable run was lost, or the final state differs) or `unsurvivable-by-design`
  (the schedule loses every copy of a shard, statically, or after the run shrank and its ring
  changed; or, with --repair-after, a host failed --quarantine-after times and was quarantined, and the
  job then ran out of spares). A campaign that ends with hosts quarantined says which
  (`quarantined_hosts`); a run that shrank for it is judged as any shrink. Bitwise equality of the
  final state is required unless the run shrank; then the loss must stay
  within `SHRINK_REL_TOL` of the reference at every step.
- `run_campaign(...)`: the reference run (`--protect none --spares 0`, no faults), then the
  campaign (live display of each fault and recovery), then the verdict; optional JSON report.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from phoenixft.config import RunConfig
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import UserError
from phoenixft.faults.kinds import Point
from phoenixft.faults.scenarios import SCENARIOS, ChaosFault, Draw, corrupt_owners
from phoenixft.faults.spec import KILL_PHASES, parse_fault
from phoenixft.recovery.invariants import invariants_hold

__all__ = [
    "KINDS", "MIN_GAP", "FIRST_STEP", "SHRINK_REL_TOL", "MAX_COORDINATOR_KILLS", "ChaosFault", "Schedule",
    "make_schedule", "format_schedule", "unsurvivable_reason", "mesh_gone", "check_campaign", "judge", "format_verdict",
    "run_campaign", "EXIT_CODES",
]

KINDS = tuple(SCENARIOS)
LOSSES = {k: x.losses for k, x in SCENARIOS.items()}  # nodes each kind takes out of the job
LABELS = {k: x.label for k, x in SCENARIOS.items()}
# beyond one of each, node faults are drawn more often than the slow coordinator restart and hang
WEIGHTS = {k: x.weight for k, x in SCENARIOS.items()}
FAULT_WAIT_S = 60.0  # how long a node fault may hold its step for the job to be whole again
MIN_GAP = 3  # steps between two faults: the replay of a recovery plus at least one clean step
FIRST_STEP = 3  # the first fault comes after two committed steps
SHRINK_REL_TOL = 1e-4  # after a shrink the reduction order changes: loss within this of the reference
MAX_COORDINATOR_KILLS = 4  # per campaign: the launcher takes 6 coordinator exits within a minute for a crash loop
PERSIST_MARGIN = 4  # steps after a multiple of --persist-every until that checkpoint is surely complete
EXIT_CODES = {"pass": 0, "fail": 1, "unsurvivable-by-design": 3}


@dataclass
class Schedule:
    seed: int
    faults: list[ChaosFault]
    notes: list[str] = field(default_factory=list)

    @property
    def inject(self) -> list[str]:
        return [s for f in self.faults for s in f.specs]

    @property
    def unsurvivable(self) -> list[ChaosFault]:
        return [f for f in self.faults if f.unsurvivable]


# ---------------------------------------------------------------------------------------------- survivability
@functools.lru_cache(maxsize=8)
def _ring(nodes: int, replicas: int, racks: int, pp: int = 1) -> Topology:
    """Node-level replica rings (with pipeline stages: one ring per stage's nodes). Cached (read only): a
    schedule asks about every pair of nodes, and built anew per pair it made the campaign's start O(n^3)."""
    return Topology(epoch=0, nodes=[f"n{i}" for i in range(nodes)], workers_per_node=1, replicas=replicas,
                    racks=racks, resume_step=0, pp=pp)


def _lost_shards(ring: Topology, lost: set[int]) -> list[int]:
    """Slots whose owner and every replica holder are in `lost` (node level: every local rank alike)."""
    return [d for d in sorted(lost) if all(h in lost for h in ring.holders(d))]


def _persistent_ok(cfg: RunConfig, step: int, lost: int) -> bool:
    """A complete persistent checkpoint exists before `step` (--resume's, from the start; else one of
    --persist-every), and the fallback gets a spare per lost node."""
    written = bool(cfg.resume) or bool(cfg.persist_every) and step >= cfg.persist_every + PERSIST_MARGIN
    return written and cfg.spares >= lost


# why a loss is unsurvivable by design: every data-parallel replica of a mesh lost a node it lacks spares for, or a
# shard lost every copy and the persistent tier cannot stand in, because there is none, too few spares to refill
# the job, or no complete checkpoint yet
MESH, NO_TIER, FEW_SPARES, NOT_YET = "mesh", "no persistent tier", "too few spares", "no checkpoint yet"


def mesh_gone(cfg: RunConfig, lost: set[int] | tuple[int, ...]) -> set[int] | None:
    """The slots a mesh without repairs loses with `lost` (its dead slots, and the healthy slots of the
    data-parallel columns it drops for want of spares, as the planner keeps the columns the spares can
    complete); None when every column lost a node the spares cannot replace (nothing whole is left)."""
    ring = cfg.nodes // cfg.pp
    dead = [sum(1 for x in lost if x % ring == k) for k in range(ring)]
    keep, budget = set(), cfg.spares
    for k in sorted(range(ring), key=lambda k: (dead[k], k)):
        if dead[k] <= budget:
            keep.add(k)
            budget -= dead[k]
    if not keep:
        return None
    return set(lost) | {x for x in range(cfg.nodes) if x % ring not in keep}


def _cause(cfg: RunConfig, lost: set[int] | tuple[int, ...], step: int) -> str | None:
    """The condition that makes losing node slots `lost` at `step` unsurvivable by design (None: survivable)."""
    gone = set(lost)
    if cfg.tp * cfg.pp > 1 and len(lost) > cfg.spares and not cfg.repair_after:  # (with repairs it waits for them)
        # it drops whole data-parallel replicas; what the released nodes hold leaves with them
        cut = mesh_gone(cfg, lost)
        if cut is None:
            return MESH
        gone = cut
    if not _lost_shards(_ring(cfg.nodes, cfg.replicas, cfg.racks, cfg.pp), gone):
        return None
    if _persistent_ok(cfg, step, len(lost)):
        return None
    if not cfg.persist_every and not cfg.resume:
        return NO_TIER
    return FEW_SPARES if cfg.spares < len(lost) else NOT_YET


def unsurvivable_reason(cfg: RunConfig, lost: set[int] | tuple[int, ...], step: int) -> str | None:
    """Why losing node slots `lost` at `step` cannot be survived by design (None: it can)."""
    cause = _cause(cfg, lost, step)
    if cause is None:
        return None
    who = ", ".join(str(x) for x in sorted(lost))
    if cause == MESH:
        return (f"nodes {who} die together: every data-parallel replica of the {cfg.tp}x{cfg.pp} (tp x pp) mesh "
                f"loses a node, and it has --spares {cfg.spares} and no repairs (--repair-after 0), so no replica is "
                "left whole to train on")
    ring = _ring(cfg.nodes, cfg.replicas, cfg.racks, cfg.pp)
    gone = set(lost)
    if cfg.tp * cfg.pp > 1 and len(lost) > cfg.spares and not cfg.repair_after:
        gone = mesh_gone(cfg, lost) or gone
    held = "; ".join(f"node {d}'s shard {shard_name(d, cfg.nodes)} lives only on node {d} and its replica "
                     f"holder(s) {', '.join(str(h) for h in ring.holders(d))}" for d in _lost_shards(ring, gone))
    if cause == NO_TIER:
        tier = "no persistent tier (--persist-every)"
    elif cause == FEW_SPARES:
        tier = (f"the persistent fallback needs a spare per lost node to refill the job, {len(lost)} spares "
                f"(--spares {cfg.spares})")
    else:
        tier = f"no complete persistent checkpoint yet at step {step} (--persist-every {cfg.persist_every})"
    return f"nodes {who} die together with --replicas {cfg.replicas}: {held}; {tier}"


def _pairs_note(cfg: RunConfig, pairs: list[tuple[int, int]], step: int) -> str:
    """Why 'two nodes at once' is not drawn, and what would change that: derived from the cause that makes
    every pair unsurvivable at `step` (the most permissive step of the campaign)."""
    causes = {_cause(cfg, p, step) for p in pairs} - {None}
    why, fixes = [], []
    if MESH in causes:
        why.append(f"every data-parallel replica of the {cfg.tp}x{cfg.pp} (tp x pp) mesh loses a node, with --spares "
                   f"{cfg.spares} and no repairs (--repair-after 0)")
        fixes.append("more --nodes, --spares >= 2 or --repair-after S")
    if causes - {MESH}:
        where = "two nodes" if cfg.pp == 1 else "two nodes of a pipeline stage"
        why.append(f"losing any {where} loses every copy of a shard with --replicas {cfg.replicas}")
        fixes.append("more --nodes or --replicas")
    if NO_TIER in causes:
        why.append("there is no persistent tier to fall back to")
        fixes.append("--persist-every" + (" with --spares >= 2" if cfg.spares < 2 else ""))
    if FEW_SPARES in causes:
        why.append(f"falling back to the persistent tier (--persist-every {cfg.persist_every}) needs a spare per lost "
                   f"node to refill the job (2), but --spares is {cfg.spares}")
        fixes.append("--spares >= 2")
    if NOT_YET in causes:
        why.append(f"no persistent checkpoint (--persist-every {cfg.persist_every}) is complete before step {step}")
        fixes.append("a smaller --persist-every or more --steps")
    return (f"'two nodes at once' not drawn: no two of {cfg.nodes} nodes survive together: {'; '.join(why)} (use "
            f"{', '.join(dict.fromkeys(fixes))}, or --allow-unsurvivable); " + (
                "'kill during recovery' kills the promoted spare itself" if cfg.spares else
                "'kill during recovery' is a plain kill (no spare is promoted, and no survivor can be lost too)"))


# ---------------------------------------------------------------------------------------------- the schedule
def check_campaign(cfg: RunConfig, faults: int) -> None:
    """What a campaign needs, whatever else the flags say: checked before `cfg.validate()`, whose messages
    about a run (e.g. --replicas for one node) would send a chaos user the wrong way."""
    if faults < 1:
        raise UserError(f"--faults={faults} is invalid: must be >= 1")
    if cfg.protect != "phoenix":
        raise UserError(f"--protect={cfg.protect!r} is invalid: chaos injects faults, which need --protect phoenix")
    if cfg.nodes < 2:
        raise UserError(f"--nodes={cfg.nodes} is invalid: a chaos campaign needs at least 2 nodes (a killed node's "
                        "shard must survive as a replica on another node)")


def _check(cfg: RunConfig, faults: int, start: int = 0) -> tuple[int, int]:
    check_campaign(cfg, faults)
    if cfg.inject:
        raise UserError("--inject is invalid here: the campaign draws its faults from --seed")
    if cfg.scheme.is_ec:  # its survivability oracle knows replica placement only (so chaos refuses ec:D+H)
        raise UserError(f"--redundancy={cfg.redundancy!r} is invalid here: chaos campaigns support replicas:K only "
                        "for now; run ec:D+H faults with `phoenixft run --inject`")
    first, last = start + FIRST_STEP, cfg.steps - 2
    need = first + 1 + faults * MIN_GAP
    if last - first + 1 < faults * MIN_GAP:
        since = f" (--resume starts after step {start})" if start else ""
        raise UserError(f"--steps={cfg.steps} is too short for --faults {faults}: faults are at least {MIN_GAP} "
                        f"steps apart from step {first} on{since}, so need --steps >= {need}")
    return first, last


def _steps(rng: random.Random, n: int, first: int, last: int) -> list[int]:
    """n steps in [first, last], one per equal bin, consecutive ones at least MIN_GAP apart."""
    width = (last - first + 1) / n
    out = []
    for i in range(n):
        lo = first + int(i * width)
        hi = first + int((i + 1) * width) - 1  # the next bin starts at hi + 1
        out.append(rng.randint(lo, max(lo, hi - MIN_GAP + 1)))
    return out


def _kinds(rng: random.Random, n: int, available: list[str]) -> list[str]:
    if n >= len(available):  # every kind at least once, the rest uniform
        kinds = list(available) + rng.choices(available, [WEIGHTS[k] for k in available], k=n - len(available))
    else:
        kinds = rng.sample(available, n)
    rng.shuffle(kinds)
    others = [k for k in available if k != "kill_coordinator"]
    seen = 0
    for i, k in enumerate(kinds):
        if k == "kill_coordinator":
            seen += 1
            if seen > MAX_COORDINATOR_KILLS:
                kinds[i] = rng.choice(others)
    return kinds


def _after_losses(cur: RunConfig, lost: int) -> RunConfig:
    """The job after losing `lost` nodes without repairs: spares replace them while there are any, then it
    shrinks (replicas and racks as the planner re-derives them for the smaller ring). A mesh drops a whole
    data-parallel column (a node per stage) per node it cannot replace, counted as if each were in a column of its
    own (the fewest nodes it can be left with), and the column's healthy nodes become its spares."""
    short = max(0, lost - cur.spares)
    nodes = cur.nodes - short * cur.pp
    spares = max(0, cur.spares - lost) + short * (cur.pp - 1)
    return cur.replace(nodes=nodes, spares=spares,
                       replicas=min(cur.replicas, nodes // cur.pp - 1),
                       racks=cur.racks if nodes % cur.racks == 0 else 1)


def make_schedule(cfg: RunConfig, faults: int, seed: int, allow_unsurvivable: bool = False, start: int = 0
                  ) -> Schedule:
    """Draw `faults` faults for this configuration, deterministically from `seed` (no I/O, no clock).
    `start`: the step the run starts after (--resume's checkpoint): faults come after it, or they would
    never fire (and fail the campaign).

    Raises UserError for a configuration a campaign cannot run on (too few steps or nodes, no protection).
    """
    first, last = _check(cfg, faults, start)
    rng = random.Random(f"phoenixft-chaos/{seed}")
    pairs0 = list(itertools.combinations(range(cfg.nodes), 2))
    notes: list[str] = []
    # without repairs (--repair-after 0) a lost node is replaced by a spare while there is one, else the job
    # shrinks for good: later faults are drawn against the job as it will be then (its slots, its spares)
    no_repair = not cfg.repair_after
    cur = cfg

    def pair_ok(pair: tuple[int, int], step: int) -> bool:
        return allow_unsurvivable or unsurvivable_reason(cur, pair, step) is None

    def ok_pairs(step: int) -> list[tuple[int, int]]:
        return [p for p in itertools.combinations(range(cur.nodes), 2) if pair_ok(p, step)]

    available = list(KINDS)
    if not ok_pairs(last):  # the most permissive step (a persistent checkpoint exists by then, if any)
        available.remove("two_nodes")
        notes.append(_pairs_note(cfg, pairs0, last))
    if not corrupt_owners(_ring(cfg.nodes, cfg.replicas, cfg.racks, cfg.pp), cfg.nodes, lambda p: pair_ok(p, last)):
        available.remove("corrupt")
        notes.append("'corrupt replica' not drawn: no node's shard survives its loss together with the copy the fault "
                     "corrupts, the one recovery would load (with --replicas 1 it is the only copy; use --replicas 2, "
                     "--persist-every, or --allow-unsurvivable)")
    kinds = _kinds(rng, faults, available)
    steps = _steps(rng, faults, first, last)
    out: list[ChaosFault] = []
    whole = True  # before the first loss without repairs, a gated fault can wait for the job to be whole
    for i, (kind, s) in enumerate(zip(kinds, steps, strict=True), 1):
        n, world, ring = cur.nodes, cur.nodes * cur.workers_per_node, _ring(cur.nodes, cur.replicas, cur.racks, cur.pp)
        phase = rng.choice(KILL_PHASES)
        if no_repair and LOSSES[kind]:
            after = _after_losses(cur, LOSSES[kind])
            mesh = cur.tp * cur.pp > 1  # (a mesh of one data-parallel column keeps no replica on another node)
            if after.nodes < 2 if not mesh else after.nodes < cur.pp or cur.nodes < 2 * cur.pp:
                kind = "crash"  # no repairs: a loss now would leave one node (a mesh: no whole replica); lose nothing
        d = Draw(i=i, s=s, n=n, world=world, ring=ring, phase=phase, rng=rng, cfg=cfg, spares=cur.spares,
                 ok_pairs=ok_pairs, pair_ok=pair_ok)
        kind = SCENARIOS[kind].fallback(d) or kind
        f = SCENARIOS[kind].draw(d)
        why = unsurvivable_reason(cur, tuple(sorted({*f.lost, *f.unusable})), s) if f.lost else None
        out.append(dataclasses.replace(f, unsurvivable=why, specs=tuple(_gated(x) if whole else x for x in f.specs)))
        if no_repair and LOSSES[f.kind]:
            whole = False  # it never is again: a gated fault would wait out its whole hold
            cur = _after_losses(cur, LOSSES[f.kind])
    if no_repair and cur is not cfg:
        notes.append(f"no repairs (--repair-after 0): the job ends with {cur.nodes} node(s) and {cur.spares} spare(s); "
                     "each fault is drawn against the job as the faults before it leave it")
    return Schedule(seed=seed, faults=out, notes=notes)


def _gated(spec: str) -> str:
    """Node faults at a step hold that step until the job is whole again (full size, and a warm spare
    ready if the job has spares), at most FAULT_WAIT_S: a cluster with --repair-after repairs between
    faults, as a real one mostly is, rather than a burst that outruns the repairs by construction. A
    coordinator kill holds the step after it until a coordinator restarted from its journal: however few
    steps are left, the run cannot end before the restart that proves the kill recovered."""
    f = parse_fault(spec)
    if f.kind_of.waits and f.point in (Point.STEP, Point.REPLICAS):
        return f"{spec},wait={FAULT_WAIT_S:g}"
    return spec


def _is_coordinator_kill(spec: str) -> bool:
    """A kill of the coordinator (the control plane's loss, not a training node's); False for a record
    whose spec does not parse."""
    try:
        return parse_fault(spec).coordinator
    except UserError:
        return False


def _corrupts(spec: str) -> bool:
    """A corruption: it acts without a fault record (the replicas it corrupted say it fired)."""
    return parse_fault(spec).point in (Point.REPLICAS, Point.TRANSFER)


def format_schedule(sched: Schedule, cfg: RunConfig) -> str:
    persist = f", --persist-every {cfg.persist_every}" if cfg.persist_every else ""
    lines = [f"chaos campaign: seed {sched.seed}, {len(sched.faults)} faults over {cfg.steps} steps; "
             f"{cfg.nodes} nodes x {cfg.workers_per_node} worker(s), {cfg.spares} spare(s), --replicas "
             f"{cfg.replicas}{persist}, lost nodes back as spares "
             f"{f'after {cfg.repair_after:g}s' if cfg.repair_after else 'never (--repair-after 0)'}, "
             f"--failure-timeout {cfg.failure_timeout:g}s",
             f"  {'#':>3} {'step':>4}  {'fault':<21} inject"]
    for f in sched.faults:
        lines.append(f"  {f.index:>3} {f.step:>4}  {LABELS[f.kind]:<21} {' + '.join(f.specs)}")
        if f.unsurvivable:
            lines.append(f"  {'':>3} {'':>4}  UNSURVIVABLE BY DESIGN: {f.unsurvivable}")
    lines += [f"  note: {n}" for n in sched.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the verdict
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _runtime_unsurvivable(cfg: RunConfig, run: dict[str, Any], events: list[dict[str, Any]],
                          metrics: list[dict[str, Any]]) -> str | None:
    """A failed run: did it lose every copy of a shard in the ring it had then (e.g. after a shrink)?"""
    err = run.get("error") or ""
    if "in-memory state lost" not in err and "every node is lost" not in err:
        return None
    if cfg.persist_every and "needs a spare" in err:
        return None  # a complete checkpoint was there: the spare pool, not the design, was short
    e_ok = max((m.get("epoch", 0) for m in metrics), default=0)  # last epoch that completed a step
    epochs = {ev["epoch"]: ev for ev in events if ev.get("kind") == "epoch"}
    if e_ok not in epochs:
        return None
    nodes, t_ok = epochs[e_ok]["nodes"], epochs[e_ok]["t"]
    lost = {ev["node"] for ev in events if ev.get("kind") == "fault" and ev.get("fault") in ("kill", "hang")
            and not _is_coordinator_kill(str(ev.get("spec", ""))) and ev["t"] >= t_ok}
    lost |= {n for ev in events if ev.get("kind") == "classified" and ev.get("epoch", -1) >= e_ok
             for n in ev.get("dead", [])}
    slots = {nodes.index(x) for x in lost if x in nodes}
    ring = _ring(len(nodes), min(cfg.replicas, len(nodes) - 1),
                 cfg.racks if len(nodes) % cfg.racks == 0 else 1)
    gone = _lost_shards(ring, slots)
    if not gone:
        return None
    where = f"epoch {e_ok}'s ring of {len(nodes)} nodes" + (" (after a shrink)" if len(nodes) < cfg.nodes else "")
    return (f"in {where}, {', '.join(nodes[d] for d in gone)} and every holder of its replicas were lost together "
            f"({', '.join(sorted(lost))}); no persistent checkpoint to fall back to")


def _quarantined(run: dict[str, Any]) -> list[str]:
    """The hosts the campaign's run quarantined (the report's `quarantine`; none in an older report)."""
    q = run.get("quarantine")
    return [str(h) for h in q.get("quarantined") or []] if isinstance(q, dict) else []


def _quarantine_outcome(cfg: RunConfig, run: dict[str, Any]) -> str | None:
    """A run that stopped for want of a spare after hosts were quarantined: the campaign drew more losses of a
    host than --quarantine-after lets the job take back, so the repairs stopped returning it. That is the
    configured policy working, not a defect; None when it does not apply."""
    err, hosts = run.get("error") or "", _quarantined(run)
    if not hosts or not any(x in err for x in ("no spare", "needs a spare", "every node is lost")):
        return None
    return (f"host(s) {', '.join(hosts)} were quarantined ({cfg.quarantine_after} failures within "
            f"{cfg.quarantine_window:g}s, --quarantine-after), so repairs stopped returning them and the job ran "
            f"out of spares: {err[:200]}")


def _restarted_after(evs: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
    """A coordinator came back from its journal after the kill fired (`coordinator_restarted`, events.jsonl):
    the evidence that a coordinator kill was recovered, not merely outlived by the run."""
    t_kill = min((float(ev.get("t", 0.0)) for ev in evs), default=None)
    return t_kill is not None and any(ev.get("kind") == "coordinator_restarted" and float(ev.get("t", -1.0)) >= t_kill
                                      for ev in events)


def _corrupted_copies(cfg: RunConfig, events: list[dict[str, Any]], spec: str, slots: tuple[int, ...]
                      ) -> list[list[Any]]:
    """[shard name, step] of each replica copy the corrupt `spec` damaged (its `corrupted_replica` events) of a
    shard owned by a node in `slots` (the owner the scenario kills: the copies recovery needs), named as a
    recovery's `replicas_rejected` names them (the shard's logical id in the job of that moment)."""
    out = []
    nodes = cfg.nodes
    for ev in events:
        if ev.get("kind") == "epoch" and ev.get("nodes"):
            nodes = len(ev["nodes"])
        if (ev.get("kind") == "corrupted_replica" and ev.get("spec") == spec
                and int(ev["shard"]) // cfg.workers_per_node in slots):
            out.append([shard_name(int(ev["shard"]), nodes * cfg.workers_per_node, cfg.tp, cfg.pp), int(ev["step"])])
    return out


def _per_fault(sched: Schedule, cfg: RunConfig, run: dict[str, Any], events: list[dict[str, Any]],
               metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each drawn fault: whether it fired (a corrupt spec: its `corrupted_replica` event) and whether it was
    recovered (a node fault: a later epoch trained; a coordinator kill: a coordinator restarted after it). A
    corrupt fault also lists the copies it damaged (`corrupted`) and whether a recovery that resumed from their
    step or an older one rejected every one of them (`corrupt_rejected`): the copy recovery would have used,
    caught by its checksum."""
    fired: dict[int, list[dict[str, Any]]] = {}
    for ev in events:
        if ev.get("kind") == "fault":
            fired.setdefault(int(ev["index"]), []).append(ev)
    corrupted = {ev.get("spec") for ev in events if ev.get("kind") == "corrupted_replica"}
    max_epoch = max((m.get("epoch", 0) for m in metrics), default=0)
    spec_index = {s: i for i, s in enumerate(sched.inject)}
    # copies a recovery rejected while it would have used them: of its resume step or newer (every descriptor
    # verifies both halves, so an older step's copy is rejected even though no recovery wanted it)
    rejected = [[str(x[0]), int(x[1])] for r in run.get("recoveries", []) for x in r.get("replicas_rejected", [])
                if r.get("resumed_step") is not None and int(x[1]) >= int(r["resumed_step"])]
    per_fault = []
    for f in sched.faults:
        evs = [ev for s in f.specs if not _corrupts(s) for ev in fired.get(spec_index[s], [])]
        injected = all((s in corrupted) if _corrupts(s) else bool(fired.get(spec_index[s])) for s in f.specs)
        if not injected:
            recovered = False
        elif SCENARIOS[f.kind].by_journal:
            recovered = _restarted_after(evs, events)
        else:
            recovered = max_epoch > max(ev.get("epoch", 0) for ev in evs)
        entry = {"index": f.index, "kind": f.kind, "step": f.step, "injected": injected, "recovered": recovered,
                 "fired": evs}
        damaged = [c for s in f.specs if _corrupts(s) for c in _corrupted_copies(cfg, events, s, f.lost)]
        if damaged:
            entry.update(corrupted=damaged, corrupt_rejected=all(c in rejected for c in damaged))
        per_fault.append(entry)
    return per_fault


def judge(sched: Schedule, cfg: RunConfig, ref: dict[str, Any], run: dict[str, Any],
          events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's verdict and numbers (a pure function of the two reports and the run's records)."""
    per_fault = _per_fault(sched, cfg, run, events, metrics)
    recs = [r for r in run.get("recoveries", []) if r.get("action") != "failed"]  # (not the one that ended it)
    shrank = any(r.get("action") == "shrink" for r in recs)
    ref_loss, loss = ref.get("loss") or [], run.get("loss") or []
    devs = [abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(loss, ref_loss, strict=False)]
    max_dev = max(devs) if devs else None
    done = run.get("state") == "done" and run.get("steps_completed") == cfg.steps
    bitwise = bool(done and ref.get("final_state_sha256")
                   and run.get("final_state_sha256") == ref.get("final_state_sha256"))
    # an epoch interrupted by another failure never establishes its invariants; the epoch that completed it must
    invariants_ok = all(invariants_hold(r) for r in recs
                        if r.get("completed_in_epoch", r.get("epoch")) == r.get("epoch"))
    unproven = [str(p["index"]) for p in per_fault
                if p["injected"] and not p["recovered"] and SCENARIOS[p["kind"]].by_journal]
    loaded = [str(p["index"]) for p in per_fault if p["injected"] and p.get("corrupt_rejected") is False]
    static = [f"fault {f.index} ({' + '.join(f.specs)}): {f.unsurvivable}" for f in sched.unsurvivable]
    if ref.get("state") not in ("done", "skipped"):
        verdict = "fail"
        reason = f"the failure-free reference run did not finish: {ref.get('error') or ref.get('state')}"
    elif static:
        verdict, reason = "unsurvivable-by-design", "; ".join(static)
        if done:
            reason += " (the run still finished: that fault did not hit as drawn)"
    elif not done:
        why = _runtime_unsurvivable(cfg, run, events, metrics) or _quarantine_outcome(cfg, run)
        if why:
            verdict, reason = "unsurvivable-by-design", why
        else:
            verdict, reason = "fail", f"the run did not finish: {run.get('error') or run.get('state')}"
    elif not invariants_ok:
        verdict, reason = "fail", "an invariant check failed after a recovery"
    elif not all(p["injected"] for p in per_fault):
        missed = [str(p["index"]) for p in per_fault if not p["injected"]]
        verdict, reason = "fail", (f"fault(s) #{', #'.join(missed)} never fired (their target was not in the job at "
                                   "their step): the campaign did not test what it drew")
    elif loaded:
        verdict, reason = "fail", (f"corrupt fault(s) #{', #'.join(loaded)}: no recovery rejected the corrupted copy "
                                   "(it was not the copy recovery would use, or it was loaded)")
    elif unproven:
        verdict, reason = "fail", (f"coordinator kill(s) #{', #'.join(unproven)}: no coordinator restarted from its "
                                   "journal after the kill, so the campaign cannot tell it was recovered")
    elif shrank:
        ok = max_dev is not None and len(loss) == len(ref_loss) and max_dev <= SHRINK_REL_TOL
        verdict = "pass" if ok else "fail"
        reason = (f"the run shrank (no spare ready); max relative loss deviation {max_dev:.2e} "
                  f"{'<=' if ok else '>'} {SHRINK_REL_TOL:g}")
    elif bitwise:
        verdict, reason = "pass", "final state bitwise equal to the failure-free reference"
    else:
        verdict, reason = "fail", "final state differs from the failure-free reference"
    return {
        "verdict": verdict, "reason": reason, "faults": len(sched.faults),
        "injected": sum(p["injected"] for p in per_fault), "recovered": sum(p["recovered"] for p in per_fault),
        "steps_lost": sum(r.get("lost_steps") or 0 for r in recs), "bitwise_equal": bitwise,
        "max_loss_rel_dev": max_dev, "shrank": shrank, "per_fault": per_fault,
        "recoveries": len(recs), "replicas_rejected": sum(len(r.get("replicas_rejected", [])) for r in recs),
        "quarantined_hosts": _quarantined(run),
    }


def format_verdict(v: dict[str, Any], ref: dict[str, Any], run: dict[str, Any], wall: dict[str, float]) -> str:
    missed = [f"#{p['index']}" for p in v["per_fault"] if not p["injected"]]
    not_rec = [f"#{p['index']}" for p in v["per_fault"] if p["injected"] and not p["recovered"]]
    sha = (run.get("final_state_sha256") or "-")[:16]
    if run.get("state") != "done":
        state = f"none: the run stopped ({run.get('state')})"
    elif v["bitwise_equal"]:
        state = f"bitwise equal to the reference (sha256 {sha})"
    elif ref.get("state") == "skipped":
        state = f"sha256 {sha} (no reference run: the schedule is unsurvivable by design)"
    else:
        state = f"differs from the reference ({sha} vs {(ref.get('final_state_sha256') or '-')[:16]})"
    dev = "-" if v["max_loss_rel_dev"] is None else f"{v['max_loss_rel_dev']:.2e}"
    lines = [
        f"chaos verdict: {v['verdict'].upper()}: {v['reason']}",
        f"  faults injected   {v['injected']} of {v['faults']}"
        + (f" (never fired: {', '.join(missed)}; "
           + ("their node or rank was not in the job when their step came)" if run.get("state") == "done"
              else "the run stopped before their step)") if missed else ""),
        f"  recovered         {v['recovered']} of {v['injected']}"
        + (f" (not: {', '.join(not_rec)})" if not_rec else "")
        + f"; {v['recoveries']} recovery epochs, {v['replicas_rejected']} corrupt replica(s) rejected",
        f"  steps lost        {v['steps_lost']} (replayed)",
        f"  final state       {state}",
        f"  shrank            {'yes' if v['shrank'] else 'no'}; max relative loss deviation per step {dev}",
        f"  wall time         {wall['total']:.1f}s (reference {wall['reference']:.1f}s, campaign "
        f"{wall['campaign']:.1f}s)",
    ]
    if v.get("quarantined_hosts"):  # an accepted outcome: the policy kept a repeat offender out
        lines.insert(-1, f"  quarantined       {', '.join(v['quarantined_hosts'])} (failed --quarantine-after times; "
                         "not admitted again)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the campaign
def run_campaign(cfg: RunConfig, faults: int, seed: int, *, allow_unsurvivable: bool = False,
                 report: str = "", out: TextIO | None = None) -> dict[str, Any]:
    """Reference run, then the campaign, then the verdict. `cfg` is the user's run configuration
    (its `seed` is used for the training too). Returns the campaign report (also written to `report`)."""
    from phoenixft.observe.display import Display
    from phoenixft.protect.persist import latest_manifest
    from phoenixft.runtime.launcher import INTERRUPTED, check_local_size, run_job

    out = out or sys.stdout
    t0 = time.monotonic()
    check_local_size(cfg)  # (before the schedule, which looks at every pair of nodes)
    cfg = cfg.replace(seed=seed, inject=[], report="")
    man = latest_manifest(cfg.resume) if cfg.resume else None  # (the run itself refuses one that is not there)
    sched = make_schedule(cfg, faults, seed, allow_unsurvivable, start=int(man["step"]) if man else 0)
    root = Path(cfg.run_dir or Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S"))
    persist_dir = str(Path(cfg.persist_dir) / f"chaos-{uuid.uuid4().hex[:8]}") if cfg.persist_every else ""
    camp = cfg.replace(inject=sched.inject, run_dir=str(root / "campaign"), persist_dir=persist_dir)
    camp.validate()
    ref_cfg = cfg.replace(protect="none", spares=0, repair_after=0.0, persist_every=0, persist_dir="",
                          spare_arrives_at_step=0, run_dir=str(root / "reference"), quiet=True,
                          json_events=False, tensorboard="", metrics_port=-1)  # (the exports are the campaign's)
    ref_cfg.validate()
    print(format_schedule(sched, camp), file=out, flush=True)
    if sched.unsurvivable:  # the verdict is fixed: show how the system stops, no reference needed
        print("[1/2] reference skipped: the schedule is unsurvivable by design, so this cannot be a pass",
              file=out, flush=True)
        ref: dict[str, Any] = {"state": "skipped"}
    else:
        print(f"[1/2] failure-free reference (--protect none --spares 0) in {ref_cfg.run_dir} ...", file=out,
              flush=True)
        ref = run_job(ref_cfg, Display(quiet=True, steps=ref_cfg.steps))
        if ref.get("state") == INTERRUPTED:  # the user stopped the campaign: no campaign run, no verdict
            raise KeyboardInterrupt
        print(f"      {ref.get('state')}: {ref.get('steps_completed', 0)} steps in {time.monotonic() - t0:.1f}s, "
              f"final state sha256 {(ref.get('final_state_sha256') or '-')[:16]}", file=out, flush=True)
    t_ref = time.monotonic() - t0
    run: dict[str, Any] = {"state": "not run", "config": json.loads(camp.to_json())}
    t1 = time.monotonic()
    if ref.get("state") in ("done", "skipped"):
        print(f"[2/2] campaign: {len(sched.inject)} fault specs in {camp.run_dir} ...", file=out, flush=True)
        run = run_job(camp, Display(quiet=camp.quiet, json_events=camp.json_events, steps=camp.steps))
        if run.get("state") == INTERRUPTED:  # stopped by the user, not lost to a fault: no verdict
            raise KeyboardInterrupt
    t_camp = time.monotonic() - t1
    run_dir = Path(run.get("run_dir") or camp.run_dir)
    events, metrics = _read_jsonl(run_dir / "events.jsonl"), _read_jsonl(run_dir / "metrics.jsonl")
    v = judge(sched, camp, ref, run, events, metrics)
    wall = {"total": time.monotonic() - t0, "reference": t_ref, "campaign": t_camp}
    print(format_verdict(v, ref, run, wall), file=out, flush=True)
    result = {
        **{k: v[k] for k in ("verdict", "reason", "faults", "injected", "recovered", "steps_lost", "bitwise_equal",
                             "max_loss_rel_dev", "shrank", "recoveries", "replicas_rejected", "per_fault",
                             "quarantined_hosts")},
        "seed": seed, "wall_s": wall["total"], "wall": wall, "schedule": [f.to_json() for f in sched.faults],
        "goodput": run.get("goodput"),  # the campaign run's (observe/goodput.py)
        "notes": sched.notes, "inject": sched.inject, "run_dir": str(root),
        "reference": {k: ref.get(k) for k in ("state", "run_id", "run_dir", "steps_completed", "final_state_sha256",
                                              "loss", "step_time_s", "error")},
        "run": run,
    }
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps(result, indent=2))
        print(f"  report            {report}", file=out, flush=True)
    return result
