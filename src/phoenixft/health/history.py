"""The failure history of each host, kept in the control-plane store, and the quarantine it decides.

Every failure of a host (a node of it declared dead, a health check of it failed) and every explicit
quarantine is one JSON line (a failure that an `--inject` fault caused says which, `injected`: it is
listed, and the rule does not count it: `phoenixft.faults.struck`) appended to `hosts/history`
(`keys.HOST_HISTORY`): appends are atomic on every backend of the `Store` protocol, so any process may
write (the coordinator, or a detector of silent data corruption calling `quarantine`), and the history
outlives a coordinator restart or a standby's takeover like the rest of the job's keys. Each record has
an `id` (a coordinator that records the same failure again after a restart writes the same id, and
reading keeps one). Lines that do not parse
are ignored and logged (`controlplane.values`).

A host's identity is the `hostid` of its agent's join request: `PHOENIXFT_HOST_ID` when set (a local
run names each simulated host so), else the machine's hostname and the address the agent's workers
listen on (`HOSTNAME@ADDRESS`: containers or network namespaces that share a hostname stay apart).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.values import clean, note_bad, read_raw
from phoenixft.health.window import quarantined_at

__all__ = ["HOST_ID_ENV", "HostRecord", "quarantine", "record_failure", "read_history", "host_records",
           "quarantined_hosts"]

HOST_ID_ENV = "PHOENIXFT_HOST_ID"  # the identity of the host an agent runs on (default: HOSTNAME@ADDRESS)


@dataclass
class HostRecord:
    """One host's history: its failures (time, node, reason, and the `injected` fault that caused it, if one
    did) and, if quarantined, when and why."""

    host: str
    failures: list[dict[str, Any]] = field(default_factory=list)
    quarantined: float | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "failures": self.failures, "quarantined_t": self.quarantined,
                "quarantined": self.quarantined is not None, "reason": self.reason}


def _append(store: Store, rec: dict[str, Any]) -> None:
    sealed.append(store, keys.HOST_HISTORY, rec)


def record_failure(store: Store, host: str, node: str, reason: str, ident: str, t: float | None = None,
                   injected: str | None = None) -> None:
    """Append one failure of `host` (its node `node`, `reason`); `ident` names the failure (the same
    failure recorded twice counts once). `injected`: the `--inject` fault that caused it (listed, never
    counted by the quarantine rule)."""
    if not host:
        return
    rec = {"kind": "failure", "host": host, "node": node, "reason": clean(reason, 300), "id": ident,
           "t": time.time() if t is None else t}
    if injected:
        rec["injected"] = clean(injected, 200)
    _append(store, rec)


def quarantine(store: Store, host: str, reason: str) -> None:
    """Quarantine `host` for the rest of the run, whatever its failure count: it is never admitted again
    (e.g. a host found corrupting data). Any process holding the job's store may call it."""
    if not host:
        return
    _append(store, {"kind": "quarantine", "host": host, "reason": clean(reason, 300), "id": f"q:{host}:{reason}",
                    "t": time.time()})


def read_history(store: Store) -> list[dict[str, Any]]:
    """The history's records, each once (by `id`), malformed ones ignored and logged."""
    out, seen = [], set()
    for rec in sealed.records(keys.HOST_HISTORY, read_raw(store, keys.HOST_HISTORY)):
        try:
            host, kind, ident, t = str(rec["host"]), str(rec["kind"]), str(rec["id"]), float(rec["t"])
        except (KeyError, TypeError, ValueError):
            note_bad(keys.HOST_HISTORY, "not a host-history record", json.dumps(rec))
            continue
        if ident in seen or kind not in ("failure", "quarantine") or not host:
            continue
        seen.add(ident)
        out.append({**rec, "host": host, "kind": kind, "t": t})
    return out


def host_records(history: list[dict[str, Any]], after: int, window: float) -> dict[str, HostRecord]:
    """Each host's failures and quarantine, from the `history` records (`read_history`), by the rule of
    `after` failures within `window` seconds (`window.quarantined_at`) and the explicit quarantines."""
    hosts: dict[str, HostRecord] = {}
    for rec in sorted(history, key=lambda r: r["t"]):
        h = hosts.setdefault(rec["host"], HostRecord(rec["host"]))
        if rec["kind"] == "failure":
            h.failures.append({"t": rec["t"], "node": str(rec.get("node", "")), "reason": str(rec.get("reason", "")),
                               **({"injected": str(rec["injected"])} if rec.get("injected") else {})})
        elif h.quarantined is None:
            h.quarantined, h.reason = rec["t"], str(rec.get("reason", ""))
    for h in hosts.values():  # (a failure an --inject fault caused is listed, never counted)
        at = quarantined_at([f["t"] for f in h.failures if not f.get("injected")], after, window)
        if at is not None and (h.quarantined is None or at < h.quarantined):
            h.quarantined = at
            h.reason = f"{after} failures within {window:g}s"
    return hosts


def quarantined_hosts(store: Store, after: int, window: float) -> dict[str, HostRecord]:
    """The quarantined hosts of the job behind `store`."""
    return {h: r for h, r in host_records(read_history(store), after, window).items() if r.quarantined is not None}
