"""Writing a drain request (`keys.drain_key`): the one helper every producer uses (`phoenixft drain`, a
node's agent on its drain signal, the `preempt:` fault), so that the coordinator reads one format; and a stop
request (`keys.STOP_REQUEST`: every node goes, the job stops with its state saved), in the same format.

The request names the node by its slot in the current epoch and carries the node id it means, so a
request that arrives after that slot changed hands is recognised as stale by the coordinator.
"""

from __future__ import annotations

import json
import time

from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import parse_int

__all__ = ["current_nodes", "request_drain", "request_stop"]


def current_nodes(store: Store) -> list[str]:
    """The node ids of the current epoch, in slot order ([] before the first epoch, or if unreadable or not
    signed with the job token bound in this process)."""
    e = parse_int(sealed.get(store, keys.EPOCH), keys.EPOCH, -1)
    if e < 0:
        return []
    from phoenixft.controlplane.auth import read_topology

    topo = read_topology(store, e, sealed.bound_token())  # (signed with the job token: a forged one names none)
    return list(topo.nodes) if topo is not None else []


def request_drain(store: Store, node: str, reason: str, source: str, deadline: float | None = None) -> int | None:
    """Ask the coordinator to drain `node` (a node id of the current epoch); the slot the request was
    written for, or None when `node` is in no slot of the current epoch (not a member: nothing to drain).
    The request is sealed with the run key (`controlplane.sealed`, bound in the caller): the coordinator
    acts on no other."""
    nodes = current_nodes(store)
    if node not in nodes:
        return None
    slot = nodes.index(node)
    sealed.put(store, keys.drain_key(slot), json.dumps({"reason": reason, "source": source, "deadline": deadline,
                                                       "t": time.time(), "node_id": node}))
    return slot


def request_stop(store: Store, reason: str, source: str, deadline: float | None = None,
                 t: float | None = None) -> None:
    """Ask the coordinator to stop the whole job at the next step boundary, its state saved in the persistent
    tier (coordinator/stop.py): the notice that every node goes (a scheduler's time limit or preemption).
    `t`: when the notice came (default: now). Sealed with the run key (bound in the caller), like a drain request."""
    sealed.put(store, keys.STOP_REQUEST, json.dumps({"reason": reason, "source": source, "deadline": deadline,
                                                     "t": time.time() if t is None else t}))
