"""Assemble the JSON report of a run from the control-plane store; write the run directory.

Report fields: `config`, `state`, `steps_completed`, `loss` (one value per step),
`step_time_s` (median, p90; the first two steps are warm-up and left out), `final_state_sha256`,
`recoveries` (one entry per recovery epoch: faults (every fault it answers: those that hit a node
it found lost or restarted, or else the latest one before it), fault (the latest of them), class,
action, epoch, detect_s and recovery_s (from the first of them), lost_steps, resumed_step, stage
timings, invariants, bytes_moved, `drain` (a planned drain: node, reason, source, completed,
notice_to_swapped_s; None otherwise), with `--redundancy ec:D+H` the shards `decoded` from their group,
the pieces' bytes `bytes_decoded_from` and `decode_s`),
`redundancy`, `stragglers` (each node flagged as a straggler: node, slot, ratio, first_step, flagged_step,
whether it was evicted, and by which recovery), `goodput` (goodput and badput by cause,
observe/goodput.py; each recovery's absolute `times` feed it), `scrub` (the scrubber's findings: every
held copy found corrupt at rest, the node holding it, whose shard, the step, and where its repair came
from), `health` (the spares' latest health checks: ok, reason, phase; `unhealthy`: the spares never
promoted for it), `quarantine` (each host's failures, the `quarantined` hosts), `error` when the run failed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.auth import read_topology
from phoenixft.controlplane.values import clean, note_bad, parse_int, parse_json, read_json, read_raw
from phoenixft.errors import UserError
from phoenixft.faults.spec import FaultSpec, parse_fault
from phoenixft.observe.goodput import account
from phoenixft.sdc.report import sdc_report

__all__ = ["build_report", "percentile", "read_recoveries", "write_metrics"]


def _scrub(cfg: RunConfig, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The scrubber's findings: each a held copy whose bytes no longer matched their checksum (the node
    holding it, whose shard or parity block, the step, repaired or not and from where)."""
    found = [{k: ev.get(k) for k in ("node", "rank", "copy", "shard", "step", "repaired", "repaired_from", "why_not",
                                     "repair_s", "t")} for ev in events if ev.get("kind") == "scrub_found"]
    return {"every": cfg.scrub_every, "found": len(found),
            "repaired": sum(1 for f in found if f["repaired"]), "findings": found}

def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def _get(store: Store, key: str) -> Any:
    """The JSON object sealed at `key` (controlplane.sealed); None if absent, not sealed with the run key or
    not one (logged: anyone reaching the store can write it)."""
    return sealed.get_json(store, key)


def _topo(store: Store, e: int, token: str | None) -> dict[str, Any]:
    """The topology of epoch `e` as far as the report needs it, once its signature verifies with `token`
    ({"nodes": []} if it is not a readable, signed one)."""
    topo = read_topology(store, e, token)
    return asdict(topo) if topo is not None else {"nodes": []}


def _step_record(raw: bytes | None, key: str) -> dict[str, Any] | None:
    rec = parse_json(raw, key)
    return None if rec is None else _checked_step(rec, key)


def _checked_step(rec: dict[str, Any], key: str) -> dict[str, Any] | None:
    """`rec` if it has a step record's numbers (logged and None if not)."""
    if not all(isinstance(rec.get(f), (int, float)) for f in ("step", "dt", "loss")):
        note_bad(key, "not a step record", json.dumps(rec).encode())
        return None
    return rec


STEP_BATCH = 512  # step records fetched per store round trip


def _step_records(store: Store, first: int, last: int) -> list[dict[str, Any]]:
    """The step records first..last (those present), STEP_BATCH keys per `check` + `multi_get`: the
    range is the steps that ran (a resumed run starts after its checkpoint's step; an interrupted one
    ends at its progress), never all of --steps, which took one round trip per step of a 10^11-step
    run's report, with signals held."""
    return [r for _, r in _numbered_records(store, first, last) if r is not None]


def _numbered_records(store: Store, first: int, last: int) -> list[tuple[int, dict[str, Any] | None]]:
    out: list[tuple[int, dict[str, Any] | None]] = []
    for lo in range(first, last + 1, STEP_BATCH):
        span = range(lo, min(last, lo + STEP_BATCH - 1) + 1)
        names = [keys.step(s) for s in span]
        if store.check(names):  # (multi_get blocks on a missing key: only when all are there)
            raws = store.multi_get(names)
            recs = [_step_record(sealed.unseal(n, raw), n) for n, raw in zip(names, raws, strict=True)]
        else:
            recs = [_step_record(sealed.unseal(n, read_raw(store, n)), n) for n in names]
        out.extend(zip(span, recs, strict=True))
    return out


def _run_steps(store: Store, first: int, last: int, seen: dict[str, Any]) -> list[dict[str, Any]]:
    """Each step's last execution, first..last: from the store where it still holds the record (`seen`
    "steps_from" on: the launcher deletes older ones once they are in metrics.jsonl), else from the
    launcher's durable copy (`seen` "steps": step -> record, as it read them into metrics.jsonl)."""
    history = seen.get("steps")
    if not isinstance(history, dict):
        return _step_records(store, first, last)
    lo = max(first, int(seen.get("steps_from") or first))
    held = dict(_numbered_records(store, lo, last))
    out = []
    for s in range(first, last + 1):
        rec = held.get(s)
        if rec is None and s in history:
            rec = _checked_step(history[s], f"metrics.jsonl step {s}")
        if rec is not None:
            out.append(rec)
    return out


def _parsed(spec: str) -> FaultSpec | None:
    """The fault record's spec parsed (None: not one this version parses, e.g. from another version's run)."""
    try:
        return parse_fault(spec)
    except UserError:
        return None


def _answerable(spec: str) -> bool:
    """Whether a recovery of the training job answers the fault (its kind says)."""
    f = _parsed(spec)
    return f is None or f.kind_of.answered_by_recovery(f)


def _answered(faults: list[dict[str, Any]], rec: dict[str, Any], used: set[int]) -> list[dict[str, Any]]:
    """The faults a recovery answers (oldest first; added to `used`): those before its first report that hit
    a node it found dead, restarted or unresponsive (a kill and a crash handled in one epoch are both its
    own); else the latest one before it (a NaN). A coordinator kill is the control plane's, a corruption at
    rest is answered by the kill it comes with (corruptions are not fault records: they kill nothing)."""
    cands = [f for f in faults if f["t"] <= rec["t_first_report"] + 1e-3 and f["index"] not in used
             and _answerable(f["spec"])]
    hit = {str(x).split(".")[0] for x in [*rec["dead"], *rec.get("restarted", []), *rec.get("unresponsive", []),
                                          *rec.get("drained", [])]}
    answered = sorted([f for f in cands if f.get("node") in hit or hit.intersection(f.get("nodes") or [])]
                      or ([max(cands, key=lambda f: f["t"])] if cands else []), key=lambda f: f["t"])
    used.update(f["index"] for f in answered)
    return answered


def _failed_recovery(rec: dict[str, Any], answered: list[dict[str, Any]], cfg: RunConfig) -> dict[str, Any]:
    """The report entry of the recovery that could not recover (the run failed in it): the same fields as
    a recovery's, `action` "failed" and its `error`; nothing was restored, no step followed it."""
    fault = answered[-1] if answered else None
    t0 = answered[0]["t"] if answered else rec["t_first_report"]
    return {
        "fault": fault["spec"] if fault else None, "faults": [f["spec"] for f in answered],
        "fault_step": fault.get("step") if fault else None, "class": rec["class"], "action": "failed",
        "error": rec["error"], "epoch": rec["epoch"], "completed_in_epoch": None, "dead": rec["dead"],
        "promoted": [], "restarted": rec.get("restarted", []), "detect_s": rec["t_first_report"] - t0,
        "recovery_s": None, "lost_steps": None, "replayed_steps": None, "resumed_step": None,
        "last_committed_step": rec.get("max_committed"),
        "stages": {"detect_s": rec["t_first_report"] - t0, "decide_s": rec["t_decided"] - rec["t_first_report"],
                   "reconfigure_s": None, "restore_params_s": None, "restore_optimizer_s": None, "join_s": None,
                   "first_step_s": None},
        "bytes_moved": 0, "per_rank": {}, "redundancy": cfg.redundancy, "decoded": [], "bytes_decoded_from": 0,
        "decode_s": 0.0, "invariants": {k: False for k in ("I1", "I2", "I3", "I4")}, "errors": rec.get("errors", []),
        "replicas_rejected": [], "fenced": rec.get("fenced", []), "unresponsive": rec.get("unresponsive", []),
        "bad_sources": [], "i3_failures": [], "persistent_step": None, "dropped": [], "released": [],
        "times": {"fault": t0, "first_report": rec["t_first_report"], "decided": rec["t_decided"], "joined": None,
                  "first_step": None},
    }


def _joins(store: Store, cfg: RunConfig, epoch: int, nodes: list[str]) -> list[dict[str, Any]]:
    """The join records of an epoch's members (those present)."""
    return [j for j in (_get(store, keys.join(epoch, f"{n}.{i}")) for n in nodes
                        for i in range(cfg.workers_per_node)) if j]


def _completion(store: Store, e: int) -> tuple[dict[str, Any] | None, int, bool]:
    """Which epoch completed the recovery of epoch `e`: its first step record, that epoch, and whether none
    ever will (another failure interrupted it and the recovery of that one failed: the run ended)."""
    first = _get(store, keys.first_step(e))
    done_epoch = e  # a recovery interrupted by another failure is completed by a later epoch
    while first is None and sealed.has(store, keys.recovery(done_epoch + 1)):
        done_epoch += 1
        first = _get(store, keys.first_step(done_epoch))
    never = first is None and sealed.has(store, keys.recovery_failed(done_epoch + 1))
    return first, done_epoch, never


def _recovery(store: Store, cfg: RunConfig, e: int, rec: dict[str, Any], faults: list[dict[str, Any]],
              used: set[int], token: str | None) -> dict[str, Any]:
    """The report entry of the recovery of epoch `e` (its record `rec`)."""
    topo = _topo(store, e, token)
    joins = _joins(store, cfg, e, topo["nodes"])
    own_joins = joins  # this epoch's own join records: its invariants, even if a later epoch finished it
    first, done_epoch, never = _completion(store, e)
    if done_epoch != e:
        joins = _joins(store, cfg, done_epoch, _topo(store, done_epoch, token)["nodes"])
    answered = _answered(faults, rec, used)
    fault = answered[-1] if answered else None
    t0 = answered[0]["t"] if answered else rec["t_first_report"]  # from the first of them
    joined_at = max((j["t"] for j in joins), default=rec["t_decided"])
    inv = {k: all(j["invariants"].get(k, False) for j in own_joins) and len(own_joins) == len(topo["nodes"])
           * cfg.workers_per_node for k in ("I1", "I2", "I3", "I4")}
    return {
        "fault": fault["spec"] if fault else None,  # the latest it answers; all of them in `faults`
        "faults": [f["spec"] for f in answered],
        "fault_step": fault.get("step") if fault else None,
        "class": rec["class"],
        "action": rec["action"],
        "epoch": e,
        "completed_in_epoch": None if never else done_epoch,
        "dead": rec["dead"],
        "promoted": rec["promoted"],
        "restarted": rec.get("restarted", []),
        "detect_s": rec["t_first_report"] - t0,
        "recovery_s": (first["t"] - t0) if first else None,
        "lost_steps": rec["max_committed"] - rec["resume_step"],
        "replayed_steps": rec["max_committed"] - rec["resume_step"],
        "resumed_step": rec["resume_step"],
        "stages": {
            "detect_s": rec["t_first_report"] - t0,
            "decide_s": rec["t_decided"] - rec["t_first_report"],
            "reconfigure_s": max((j["reconfigure_s"] for j in joins), default=None),
            "restore_params_s": max((j.get("restore_params_s", 0.0) for j in joins), default=None),
            "restore_optimizer_s": max((j.get("restore_opt_s", 0.0) for j in joins), default=None),
            "join_s": joined_at - rec["t_decided"],
            "first_step_s": (first["t"] - joined_at) if first else None,
        },
        "bytes_moved": sum(j.get("bytes_params", 0) + j.get("bytes_opt", 0) + j.get("bytes_ec", 0) for j in joins),
        # each member's own stage timings (the stages above are the slowest member's)
        "per_rank": {str(j.get("rank")): {k: v for k, v in j.items() if k.endswith("_s")} for j in joins},
        "redundancy": cfg.redundancy,
        # ec:D+H: shards rebuilt from their group's pieces, the pieces' bytes, the slowest decode
        "decoded": sorted({x for j in joins for x in j.get("decoded", [])}),
        "bytes_decoded_from": sum(j.get("bytes_ec", 0) for j in joins),
        "decode_s": max((j.get("decode_s", 0.0) for j in joins), default=0.0),
        "invariants": inv,
        "errors": rec.get("errors", []),
        "replicas_rejected": rec.get("replicas_rejected", []),
        "fenced": rec.get("fenced", []),
        "unresponsive": rec.get("unresponsive", []),
        "bad_sources": rec.get("bad_sources", []),
        "i3_failures": [x for j in own_joins for x in j.get("i3_failures", [])],
        "persistent_step": rec.get("persistent_step"),
        "dropped": rec.get("dropped", []),
        "world": rec.get("world"),  # ranks of the epoch it recovered into
        "released": rec.get("released", []),  # healthy nodes of a data-parallel replica a mesh dropped: spares since
        # absolute times (epoch seconds) of the fault and of the ends of detection, decision, join and first step
        "times": {"fault": t0, "first_report": rec["t_first_report"], "decided": rec["t_decided"],
                  "joined": joined_at if joins else None, "first_step": first["t"] if first else None},
        "drain": _drain(rec, first),
        "sdc": rec.get("sdc", {}),  # class sdc: the node convicted of silent data corruption, and why
    }


def _drain(rec: dict[str, Any], first: dict[str, Any] | None) -> dict[str, Any] | None:
    """A recovery that answered a drain request: the node, why, who asked, and whether it completed as a
    planned drain (else its node was lost first and this is a failure's recovery); `notice_to_swapped_s`:
    from the notice to the first step completed with the spare in the node's place (or the job shrunk)."""
    d = rec.get("drain")
    if not isinstance(d, dict):
        return None
    done = bool(d.get("completed"))
    t_notice = d.get("t_notice")
    return {"node": d.get("node"), "slot": d.get("slot"), "reason": d.get("reason"), "source": d.get("source"),
            "deadline": d.get("deadline"), "t_notice": t_notice, "completed": done,
            "notice_to_swapped_s": (first["t"] - t_notice) if done and first and isinstance(t_notice, (int, float))
            else None}


def _recoveries(store: Store, cfg: RunConfig, faults: list[dict[str, Any]], token: str | None) -> list[dict[str, Any]]:
    """One entry per recovery epoch, then the recovery that ended the run, if one did."""
    recoveries = []
    e = 1
    used: set[int] = set()
    while (rec := _get(store, keys.recovery(e))) is not None:
        recoveries.append(_recovery(store, cfg, e, rec, faults, used, token))
        e += 1
    failed = _get(store, keys.recovery_failed(e))
    if failed is not None:  # the recovery that ended the run: what it found and why it could not recover
        recoveries.append(_failed_recovery(failed, _answered(faults, failed, used), cfg))
    return recoveries


def read_recoveries(store: Store, cfg: RunConfig, token: str | None) -> list[dict[str, Any]]:
    """The report's `recoveries` as the store holds them now (read while the run goes, for its goodput);
    topologies checked with `token`."""
    faults = [f for f in (_get(store, keys.fault(i)) for i in range(len(cfg.inject or []))) if f]
    return _recoveries(store, cfg, faults, token)


def _control_plane(faults: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The control plane's faults: a member of its cluster killed, or the coordinator (its downtime, its
    successor)."""
    control_plane = []
    for f in faults:
        spec = _parsed(f["spec"])
        if spec is not None and spec.member is not None:
            control_plane.append({"fault": f["spec"], "t": f["t"], "member": f["node"]})
        if spec is not None and spec.coordinator:
            back = [ev for ev in events if ev["kind"] == "coordinator_restarted" and ev["t"] >= f["t"]]
            first = min(back, key=lambda ev: ev["t"]) if back else None
            control_plane.append({"fault": f["spec"], "t": f["t"], "downtime_s": first["t"] - f["t"] if first else None,
                                  "new_leader": first.get("leader") if first else None})
    return control_plane


def _stragglers(events: list[dict[str, Any]], recoveries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes flagged as stragglers (coordinator/stragglers.py), each with its eviction if it had one;
    the recovery that evicted one gets class `straggler`."""
    out = []
    evictions = {ev.get("node"): ev for ev in events if ev.get("kind") == "straggler_evicted"}
    for ev in (e for e in events if e.get("kind") == "straggler"):
        node, gone = ev.get("node"), evictions.get(ev.get("node"))
        rec = next((r for r in recoveries if gone is not None and r.get("epoch") == int(gone.get("epoch", -2)) + 1
                    and (node in (r.get("dead") or []) or (r.get("drain") or {}).get("node") == node)), None)
        if rec is not None:
            rec["class"] = "straggler"
        out.append({"class": "straggler", "node": node, "slot": ev.get("slot"), "ratio": ev.get("ratio"),
                    "first_step": ev.get("first_step"), "flagged_step": ev.get("step"), "factor": ev.get("factor"),
                    "window": ev.get("window"), "action": ev.get("action"), "evicted": gone is not None,
                    "evicted_at_step": gone.get("step") if gone else None,
                    "replaced_by": (rec.get("promoted") or [None])[0] if rec else None,
                    "recovery_epoch": rec.get("epoch") if rec else None})
    return out
def write_metrics(run_dir: Path, steps: list[dict[str, Any]]) -> None:
    """metrics.jsonl: one line per step, each step's last execution. Left as it is when it already holds
    exactly that (written as the run went: a `tail -f` on it sees no truncation); else replaced at once."""
    path = run_dir / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in steps)
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def build_report(store: Store, cfg: RunConfig, state: str, run_dir: Path, run_id: str,
                 final: dict[str, Any] | None | str = "store", t_launch: float | None = None,
                 token: str | None = None, events: list[dict[str, Any]] | None = None,
                 seen: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's JSON report (fields in the module docstring); writes metrics.jsonl and events.jsonl.
    `final`: the run's final-state record as the caller verified it (the launcher: signed with the run
    key), or "store" to read it unverified. `t_launch`: when the job was launched (the start of the
    goodput window; None: its first event). `token`: the job token the topologies are checked with.
    `events`: the run's events as the caller read them (None: read from the store). `seen`: what the caller
    read as the run went ("progress", "recoveries"), kept where the store no longer holds it (something other
    than the job overwrote a key since), and the step records it keeps durably ("steps": step -> record;
    "steps_from": the first step whose record the store may still hold: the older ones were deleted)."""
    seen = seen or {}
    first_topo = read_topology(store, 0, token)
    start = first_topo.resume_step if first_topo is not None else 0
    progress = max(parse_int(sealed.get(store, keys.PROGRESS), keys.PROGRESS, 0), int(seen.get("progress") or 0))
    steps = _run_steps(store, start + 1, min(cfg.steps, progress), seen)
    dts = [r["dt"] for r in steps[2:]] or [r["dt"] for r in steps]
    if final == "store":
        final = read_json(store, keys.FINAL)
    if not isinstance(final, dict) or not isinstance(final.get("sha256"), str):
        final = None
    if events is None:
        events = sealed.records(keys.EVENTS, read_raw(store, keys.EVENTS))
    told = {ev.get("index"): ev for ev in events if ev.get("kind") == "fault"}  # (each fault's event: its record)
    faults = [f for f in (_get(store, keys.fault(i)) or told.get(i) for i in range(len(cfg.inject or []))) if f]
    recoveries = _recoveries(store, cfg, faults, token)
    if len(seen.get("recoveries") or []) > len(recoveries):
        recoveries = list(seen["recoveries"])
    report: dict[str, Any] = {
        "run_id": run_id,
        "state": state,
        "config": json.loads(cfg.to_json()),
        "redundancy": cfg.redundancy,
        # the last step the run holds: its final step, its last step record, or (a resumed run that failed
        # before its first step) the step of the checkpoint it resumed from, never 0
        "steps_completed": final["step"] if final else (steps[-1]["step"] if steps else start),
        "loss": [r["loss"] for r in steps],
        "lr": [r.get("lr") for r in steps],
        "grad_norm": [r.get("grad_norm") for r in steps],
        "val_loss": {str(r["step"]): r["val_loss"] for r in steps if r.get("val_loss") is not None},
        "first_step": steps[0]["step"] if steps else None,
        "step_time_s": {"median": statistics.median(dts) if dts else None,
                        "p90": percentile(dts, 0.9) if dts else None},
        "final_state_sha256": final["sha256"] if final else None,
        "faults": faults,
        # --inject specs that never acted (their node, rank or phase was not in the job when their step came)
        "faults_not_fired": [spec for i, spec in enumerate(cfg.inject or [])
                             if not sealed.has(store, keys.fault_fired(i))
                             and not sealed.has(store, keys.fault(i)) and i not in told],
        "recoveries": recoveries,
        # nodes slower than --straggler-factor x their peers' median for --straggler-window steps
        "stragglers": _stragglers(events, recoveries),
        "control_plane": _control_plane(faults, events),
        # persistent checkpoints that will not complete: skipped (the disk was slower than --persist-every)
        # or failed to write, per rank (persist.py)
        "persist_problems": [{k: ev.get(k) for k in ("kind", "step", "rank", "why")} for ev in events
                             if ev.get("kind") in ("persist_skipped", "persist_failed")],
        # where the wall time went: goodput and badput by cause (observe/goodput.py)
        "goodput": account(steps, recoveries, events, t_launch=t_launch),
        # copies found corrupt at rest by the scrubber (--scrub-every), and where each repair came from
        "scrub": _scrub(cfg, events),
        "sdc": sdc_report(store, cfg, steps),  # silent data corruption: detections, verdicts, cost (docs/sdc.md)
        "run_dir": str(run_dir),
    }
    from phoenixft.health.summary import summarize

    report.update(summarize(store, report["config"]))  # `health` (the spares' checks) and `quarantine` (hosts)
    error = sealed.get(store, keys.RUN_ERROR) if store.check([keys.RUN_ERROR]) else None
    if error is not None:
        report["error"] = clean(error, 2000)
        failed = next((ev for ev in events if ev.get("kind") == "run_failed" and ev.get("traceback")), None)
        if failed is not None:  # an error in the user's own code: where, on which node, its traceback
            report.update(error_where=failed.get("where"), error_node=failed.get("node"),
                          error_traceback=failed["traceback"])
    write_metrics(run_dir, steps)
    if store.check([keys.EVENTS]):
        (run_dir / "events.jsonl").write_text("".join(json.dumps(ev) + "\n" for ev in events))
    return report
