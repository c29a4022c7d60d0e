"""What silent-data-corruption detection writes to the control plane: the node a rank found corrupting
(the coordinator fences it with recovery class `sdc`), the quarantine that keeps such a node out for
the rest of the job, and the detections and verdicts the report shows (`sdc/log`)."""

from __future__ import annotations

import json
import time
from typing import Any

from phoenixft.controlplane import Store, keys, sealed

__all__ = ["SDC_LOG", "accuse", "accused", "sdc_quarantine", "quarantined", "log", "log_once"]

SDC_LOG = keys.SDC_LOG  # newline-separated JSON records: detections, verdicts, audits (the report's `sdc`)
_accused_key = keys.sdc_accused
_quarantine_key = keys.sdc_quarantine


def accuse(store: Store, epoch: int, node: str, rec: dict[str, Any]) -> None:
    """Name `node` as corrupting in epoch `epoch` (before the rank sets the epoch's failure flag: the
    coordinator reads it after its gather and fences the node)."""
    sealed.append(store, _accused_key(epoch), {"node": node, **rec})


def accused(store: Store, epoch: int) -> dict[str, dict[str, Any]]:
    """The nodes named as corrupting in epoch `epoch`, each with its first record."""
    key = _accused_key(epoch)
    if not store.check([key]):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for rec in sealed.records(key, store.get(key)):  # (a line not sealed with the run key accuses no one)
        if isinstance(rec.get("node"), str):
            out.setdefault(rec["node"], rec)
    return out


def sdc_quarantine(store: Store, node: str, reason: str) -> None:
    """Keep `node` out of this job for good: it computed wrong. Its fence already keeps that node id
    from rejoining; the quarantine record names why, for the report and for an admission that checks
    it (`quarantined`)."""
    sealed.put(store, _quarantine_key(node), json.dumps({"t": time.time(), "node": node, "reason": reason}))
    sealed.put(store, keys.fence(node), str(time.time()))


def quarantined(store: Store, node: str) -> bool:
    return sealed.has(store, _quarantine_key(node))


def log(store: Store, kind: str, event: bool = True, **fields: Any) -> None:
    """One detection or verdict: in `sdc/log` (the report) and (`event`) as an event (the live line)."""
    rec = {"t": time.time(), "kind": kind, **fields}
    sealed.append(store, SDC_LOG, rec)
    if event:
        sealed.append(store, keys.EVENTS, rec)


def log_once(store: Store, what: str, kind: str, **fields: Any) -> None:
    """`log`, by the first rank that gets here for `what` (every rank of a group reaches the same
    decision, and any of them may be interrupted right after it by another's recovery request)."""
    if sealed.claim(store, keys.sdc_logged(what)):
        log(store, kind, once=what, **fields)  # (`once`: the launcher deletes the claim once the step is past)
