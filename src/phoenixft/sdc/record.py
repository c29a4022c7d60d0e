"""What silent-data-corruption detection writes to the control plane: the node a rank found corrupting
(the coordinator fences it with recovery class `sdc`), the quarantine that keeps such a node out for
the rest of the job, and the detections and verdicts the report shows (`sdc/log`)."""

from __future__ import annotations

import json
import time
from typing import Any

from phoenixft.controlplane import Store, keys
from phoenixft.controlplane.values import parse_json

__all__ = ["SDC_LOG", "accuse", "accused", "sdc_quarantine", "quarantined", "log", "log_once"]

SDC_LOG = "sdc/log"  # newline-separated JSON records: detections, verdicts, audits (the report's `sdc`)


def _accused_key(epoch: int) -> str:
    return f"sdc/accused/{epoch}"


def _quarantine_key(node: str) -> str:
    return f"sdc/quarantine/{node}"


def accuse(store: Store, epoch: int, node: str, rec: dict[str, Any]) -> None:
    """Name `node` as corrupting in epoch `epoch` (before the rank sets the epoch's failure flag: the
    coordinator reads it after its gather and fences the node)."""
    store.append(_accused_key(epoch), json.dumps({"node": node, **rec}) + "\n")


def accused(store: Store, epoch: int) -> dict[str, dict[str, Any]]:
    """The nodes named as corrupting in epoch `epoch`, each with its first record."""
    key = _accused_key(epoch)
    if not store.check([key]):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in store.get(key).decode(errors="replace").splitlines():
        rec = parse_json(line.encode(), key)
        if isinstance(rec, dict) and isinstance(rec.get("node"), str):
            out.setdefault(rec["node"], rec)
    return out


def sdc_quarantine(store: Store, node: str, reason: str) -> None:
    """Keep `node` out of this job for good: it computed wrong. Its fence already keeps that node id
    from rejoining; the quarantine record names why, for the report and for an admission that checks
    it (`quarantined`)."""
    store.set(_quarantine_key(node), json.dumps({"t": time.time(), "node": node, "reason": reason}))
    store.set(keys.fence(node), str(time.time()))


def quarantined(store: Store, node: str) -> bool:
    return store.check([_quarantine_key(node)])


def log(store: Store, kind: str, event: bool = True, **fields: Any) -> None:
    """One detection or verdict: in `sdc/log` (the report) and (`event`) as an event (the live line)."""
    rec = {"t": time.time(), "kind": kind, **fields}
    store.append(SDC_LOG, json.dumps(rec) + "\n")
    if event:
        store.append(keys.EVENTS, json.dumps(rec) + "\n")


def log_once(store: Store, what: str, kind: str, **fields: Any) -> None:
    """`log`, by the first rank that gets here for `what` (every rank of a group reaches the same
    decision, and any of them may be interrupted right after it by another's recovery request)."""
    if store.add(f"sdc/logged/{what}", 1) == 1:
        log(store, kind, **fields)
