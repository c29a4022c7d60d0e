"""Which nodes an `--inject` fault struck, so that the quarantine never holds a fault against a host.

A campaign (`phoenixft chaos`, or a run with `--inject`) kills, stops and cuts off nodes on purpose to
test recovery; counting those failures against the (simulated) hosts would quarantine healthy hosts, and
a campaign with repairs (`--repair-after`) would run out of nodes for a policy meant for real bad
hardware. So whoever fires a fault that can make its node fail (`FaultKind.harms_node`: the worker, the
node's agent for a partition or a preemption, a spare's health check for `sick:`) marks the node struck
first (`mark`), and the coordinator records a failure of a struck node as injected (`struck_by`): kept in
the host's history and shown, never counted by the quarantine rule (`--quarantine-injected` counts them,
to try the quarantine itself). A node id is never reused: a repaired node comes back under a new id,
unmarked, and its own failures count.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from phoenixft.controlplane import Store, keys, sealed

if TYPE_CHECKING:
    from phoenixft.faults.spec import FaultSpec

__all__ = ["mark", "struck_by"]


def mark(store: Store, node: str, f: FaultSpec) -> None:
    """`node` is struck by fault `f` (before the fault acts), if f is of a kind that can make it fail."""
    if f.kind_of.harms_node(f):
        sealed.put(store, keys.fault_struck(node), json.dumps({"spec": f.text, "index": f.index, "t": time.time()}))


def struck_by(store: Store, node: str) -> str | None:
    """The spec of the injected fault that struck `node`, or None (a mark that does not verify is no mark)."""
    key = keys.fault_struck(node)
    if not store.check([key]):  # (a TCPStore's get blocks on a missing key)
        return None
    rec = sealed.get_json(store, key)
    return str(rec.get("spec") or "an --inject fault") if rec is not None else None
