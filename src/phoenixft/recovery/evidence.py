"""Evidence for the invariants I2 and I4, recorded before the failure and independent of the restore.

The planner copies into the plan (`meta["evidence"]`, in-memory plans over an unchanged world) what the
survivors reported in their descriptors before anything was restored:

- `opt`: for every logical shard (by index) and every step some survivor still holds, the checksum its
  owner committed for the shard's optimizer payload: the owner's own descriptor when it survived, else
  a replica header (written from the owner's committed half), else the checksum its erasure-coded group
  recorded for it;
- `params`: for every (pp, tp) stage and step, the checksum of the stage's parameters a survivor held.

After the restore each rank hashes what it actually installed (its optimizer shard's committed half and
its parameters) and looks the checksums up in the evidence (`Seen`): bytes that match another shard's
evidence break I2, bytes that match another step's break I4, whatever the headers the restore wrote say.

The coordinator publishes the evidence beside the topology, not in it (the topology every worker reads
stays the size of the node list): each rank's part under `evidence/<e>/<rank>` (`rank_evidence`), the
whole table under `evidence/<e>`, which a rank reads only to name the shard its bytes belong to when they
are not its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phoenixft.recovery.planner import PlanInput

__all__ = ["NO_EVIDENCE", "NO_MATCH", "NOT_READ", "Seen", "plan_evidence", "match_opt", "match_params",
           "seen_after_restore", "params_checksum", "params_checksums", "rank_evidence", "installed_seen"]

NO_EVIDENCE = -2  # (in a `Seen` field) the plan carries nothing to compare with
NO_MATCH = -1  # the installed bytes match no checksum recorded before the failure
NOT_READ = -3  # the plan published evidence for this rank, but its part is missing or does not verify


@dataclass(frozen=True)
class Seen:
    """What one rank installed, as the evidence identifies it.

    opt_shard/opt_step: the (logical shard, step) whose committed checksum the installed optimizer payload
    matches (NO_MATCH: none; NO_EVIDENCE: nothing recorded). param_step: the step whose recorded
    parameter checksum of this rank's stage the installed parameters match (same sentinels). param_crc:
    the installed parameters' checksum, compared across the data-parallel peers of the stage."""

    opt_shard: int = NO_EVIDENCE
    opt_step: int = NO_EVIDENCE
    param_step: int = NO_EVIDENCE
    param_crc: int = 0

    def row(self) -> list[int]:
        return [self.opt_shard, self.opt_step, self.param_step, self.param_crc]


def params_checksum(flat: Any, which: int | None = None) -> int:
    """Checksum of the parameters (without padding and buffer tail) in flat buffer `which` (the live one by
    default), hashed in host memory (a copy from the device first, where they are not on the host)."""
    from phoenixft.protect.snapshot import checksum

    buf = flat.params_view(which)
    return checksum(buf if buf.device.type == "cpu" else buf.cpu())


def params_checksums(flat: Any) -> dict[int, int]:
    """step -> parameter checksum of every flat buffer holding a step, for a descriptor: recorded only
    where the buffers are host memory (hashing them costs no device copy during the recovery)."""
    if flat.device.type != "cpu":
        return {}
    steps = flat.buf_step
    return {st: params_checksum(flat, b) for b, st in enumerate(steps) if st >= 0}


def _stage(wid_stage: str) -> str:
    return wid_stage or "pp0.tp0"


def plan_evidence(pi: PlanInput, r: int, decoded: dict[int, int]) -> dict[str, Any]:
    """The evidence of an in-memory plan resuming at r over the old topology's shards (`decoded`: shard
    index -> the checksum its group recorded, for shards with no copy left at r). JSON-ready."""
    old = pi.old
    bad = {(s, st, w) for d in pi.descs.values() for s, st, w in d.bad_sources}
    # shard name -> [(worker id, {step: crc})] of what the survivors hold, in worker-id order: one pass over
    # the descriptors (a scan of every descriptor per shard costs W^2: seconds at W = 4,096)
    held: dict[str, dict[str, list[tuple[str, dict[int, int]]]]] = {"own": {}, "holdings": {}}
    for w in sorted(pi.descs):
        d = pi.descs[w]
        for src in ("own", "holdings"):
            for name, steps in getattr(d, src).items():
                held[src].setdefault(name, []).append((d.wid, steps))
    opt: dict[str, dict[str, int]] = {}
    for i in range(old.world):
        name, owner = old.shard_name(i), f"{old.node_of_rank(i)}.{i % old.workers_per_node}"
        ev: dict[str, int] = {}
        # the owner's own committed state first, then any holder's replica header (first by worker id)
        for src in ("own", "holdings"):
            copies = held[src].get(name, [])
            for wid, steps in sorted(copies, key=lambda c: c[0] != owner):  # (stable: the owner first)
                for st, crc in steps.items():
                    if (name, st, wid) not in bad and crc != 0:
                        ev.setdefault(str(st), crc)
        if i in decoded:
            ev.setdefault(str(r), decoded[i])
        opt[str(i)] = ev
    params: dict[str, dict[str, int]] = {}
    for w in sorted(pi.descs):
        d = pi.descs[w]
        for st, crc in d.params_crc.items():
            params.setdefault(_stage(d.stage), {}).setdefault(str(st), crc)
    return {"step": r, "opt": opt, "params": params}


def match_opt(evidence: dict[str, Any], crc: int | None, shard: int, r: int) -> tuple[int, int]:
    """The (shard, step) whose recorded checksum `crc` matches: (shard, r) first, then any other;
    (NO_MATCH, NO_MATCH) when none does or nothing was installed (crc None)."""
    opt = evidence.get("opt", {})
    if crc is None:
        return NO_MATCH, NO_MATCH
    if opt.get(str(shard), {}).get(str(r)) == crc:
        return shard, r
    for i, steps in sorted(opt.items(), key=lambda kv: int(kv[0])):
        for st, c in sorted(steps.items(), key=lambda kv: -int(kv[0])):
            if c == crc:
                return int(i), int(st)
    return NO_MATCH, NO_MATCH


def match_params(evidence: dict[str, Any], crc: int, stage: str, r: int) -> int:
    """The step whose recorded parameter checksum of `stage` `crc` matches (r first); NO_EVIDENCE when
    nothing was recorded for the stage at r, NO_MATCH when none matches."""
    steps = evidence.get("params", {}).get(stage, {})
    if str(r) not in steps:
        return NO_EVIDENCE
    if steps[str(r)] == crc:
        return r
    return next((int(st) for st, c in steps.items() if c == crc), NO_MATCH)


def seen_after_restore(evidence: dict[str, Any] | None, opt_crc: int | None, param_crc: int, shard: int,
                       stage: str, r: int, whole: Callable[[], dict[str, Any] | None] = lambda: None) -> Seen:
    """A rank's `Seen` from the checksums of what it installed (`opt_crc`: its committed half of r, None
    when it has none), by `evidence` (this rank's part, `rank_evidence`, or the whole table; None: the plan
    recorded none). Optimizer bytes that match none of its own shard's checksums are looked up in the
    `whole` table, read only then, to name the shard they are."""
    if not evidence:
        return Seen(param_crc=param_crc)
    s, st = match_opt(evidence, opt_crc, shard, r)
    if s == NO_MATCH and opt_crc is not None:  # (not its own: another shard's, or nothing's)
        table = whole()
        if table:
            s, st = match_opt(table, opt_crc, shard, r)
    return Seen(opt_shard=s, opt_step=st, param_step=match_params(evidence, param_crc, stage, r),
                param_crc=param_crc)


def rank_evidence(evidence: dict[str, Any], rank: int, stage: str) -> dict[str, Any]:
    """The part of `evidence` rank `rank` checks its install against: its own shard's checksums (every step)
    and its stage's parameter checksums. The coordinator stores each rank's part under its own key
    (`evidence/<e>/<rank>`), so that a recovery's W ranks read O(W) bytes in all, not W times the table."""
    opt = evidence.get("opt", {})
    return {"step": evidence.get("step"), "opt": {str(rank): opt.get(str(rank), {})},
            "params": {stage: evidence.get("params", {}).get(stage, {})}}


def installed_seen(trainer: Any, topo: Any, rank: int, r: int, evidence: dict[str, Any] | None,
                   whole: Callable[[], dict[str, Any] | None] = lambda: None) -> Seen:
    """After a restore: hash what this rank installed for step r (its optimizer shard's committed half, its
    live parameters) and identify it by the plan's evidence (`seen_after_restore`). Where the (signed)
    topology says evidence was published (`meta["evidence_step"]`) and this rank's part is missing or did
    not verify (`evidence` None), nothing is identified: NOT_READ, which breaks I2 and I4 (a check is never
    skipped because a key went missing)."""
    from phoenixft.protect.snapshot import checksum

    half = trainer.state.half_with(r)
    opt_crc = checksum(trainer.state.payload(half)) if half is not None else None
    param_crc = params_checksum(trainer.flat)
    if evidence is None and "evidence_step" in topo.meta:
        return Seen(opt_shard=NOT_READ, opt_step=NOT_READ, param_step=NOT_READ, param_crc=param_crc)
    stage = topo.layout.coord(rank).name()
    return seen_after_restore(evidence, opt_crc, param_crc, rank, stage, r, whole)
