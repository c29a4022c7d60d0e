"""What every part of the coordinator shares: the job's keys in the control-plane store as the
coordinator reads and writes them (`Job`: events, readiness, descriptors posted, progress, the run's
final state), and the membership it alone decides (`Membership`: the admitted nodes, the spare pool,
the dead, the epoch published last). Each part (admission, failure detection, publication, the
recovery's decision, the main loop) is handed these two objects, never a copy of their fields."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from phoenixft.controlplane import Store, exists_many, keys, sealed
from phoenixft.controlplane.keeper import Keeper
from phoenixft.controlplane.signed import env_token, run_ended, set_signed, sig_key, sign
from phoenixft.controlplane.values import clean, note_bad, parse_int
from phoenixft.distributed.topology import Topology

__all__ = ["NODE_ID", "Job", "Membership", "index", "wait_key"]

NODE_ID = re.compile(r"^([ns])(\d+)$")  # the ids the coordinator names: active slots n<i>, spares s<k>


def index(node: str) -> int:
    """The number in a node id (its order in the pool); ids not of the coordinator's naming last."""
    m = NODE_ID.match(node)
    return int(m.group(2)) if m else 1 << 30


def wait_key(store: Store, key: str, timeout_s: float) -> bytes:
    """The value of `key` once it exists; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"coordinator: no {key!r} after {timeout_s:.0f}s")
        time.sleep(0.01)
    return store.get(key)


def hint_moved(hint: sealed.Hint, store: Store) -> bool:
    """`hint.moved(store)`, False where the store did not answer it (the next look asks again)."""
    try:
        return hint.moved(store)
    except Exception:  # noqa: BLE001 - a call that timed out: no news
        return False


@dataclass
class Membership:
    """The coordinator's view of who is in the job. Fields are rebound as well as changed in place
    (a journal reload replaces `dead` and `spare_pool`): always read them through this object."""

    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # admitted nodes: id -> {name, host, spare, t}
    spare_pool: list[str] = field(default_factory=list)  # admitted spares not used yet, in id order
    gone_spares: set[str] = field(default_factory=set)  # spares of the pool whose agent exited or heartbeat is stale
    topo: Topology | None = None  # the epoch published last (None before the start)
    dead: set[str] = field(default_factory=set)

    def in_use(self, node: str) -> bool:
        return self.topo is not None and node in self.topo.nodes

    def label(self, node: str) -> str:
        m = self.members.get(node, {})
        return f"{node} ({m.get('name')}@{m.get('host')})" if m.get("name") not in (None, node) else node


class Job:
    """The job's keys, as the coordinator reads and writes them (`store`: the control-plane store;
    `g`: workers per node)."""

    def __init__(self, store: Store, g: int) -> None:
        self.store = store
        self.g = g
        self.run_id = ""  # the run's id (the key of what this process signs), set once known
        self.final_state: str | None = None  # the run's final state, once this process has seen it
        self.keeper = Keeper(store)  # what the coordinator wrote for others to find: put back if overwritten
        self._ready: set[str] = set()  # workers seen ready (a readiness overwritten since still counts)

    def event(self, kind: str, **fields: Any) -> None:
        sealed.append(self.store, keys.EVENTS, {"t": time.time(), "kind": kind, "by": "coordinator", **fields})

    def wids(self, node: str) -> list[str]:
        return [f"{node}.{i}" for i in range(self.g)]

    def ready(self, nodes: list[str]) -> bool:
        """Every worker of every one of `nodes` has announced itself (one store call while one has not). Once
        seen, a worker stays ready until `forget_ready` (restarted in place): something that overwrites its key
        afterwards does not make a ready spare look unready at the moment of a promotion."""
        todo = [w for n in nodes for w in self.wids(n) if w not in self._ready]
        if todo and not sealed.all_present(self.store, [keys.ready(w) for w in todo]):
            return False
        self._ready.update(todo)
        return True

    def forget_ready(self, wid: str) -> None:
        self._ready.discard(wid)

    def node_ready(self, node: str) -> bool:
        return self.ready([node])

    def posted(self, e: int, nodes: list[str]) -> bool:
        """Every worker of every one of `nodes` has posted its descriptor of epoch e, sealed (one store call while
        one has not)."""
        return sealed.all_present(self.store, [keys.desc(e, w) for n in nodes for w in self.wids(n)])

    def progress(self) -> int:
        return parse_int(sealed.get(self.store, keys.PROGRESS), keys.PROGRESS, 0)

    def start_failures(self, nodes: list[str], repeated: bool = False) -> dict[str, tuple[float, str, str]]:
        """node -> (t, wid, first error) of those of `nodes` with a worker that failed before the run's first
        step (`startfail/<wid>`, its earliest; with `repeated`, only a worker that failed so again after
        its restart in place); one store call while no worker has failed so."""
        if not nodes or not self.store.check([keys.START_FAILS]):
            return {}
        wids = [w for n in nodes for w in self.wids(n)]
        found: dict[str, tuple[float, str, str]] = {}
        for w, there in zip(wids, exists_many(self.store, [keys.start_failed(w) for w in wids]), strict=True):
            if there:
                rec = sealed.get_json(self.store, keys.start_failed(w), {})
                try:
                    if repeated and int(rec.get("failures", 1)) < 2:
                        continue
                    mine = (float(rec.get("t", 0.0)), w, clean(str(rec.get("error", "?")), 2000))
                except (TypeError, ValueError):
                    note_bad(keys.start_failed(w), "not a start-failure record", json.dumps(rec))
                    continue
                node = w.rsplit(".", 1)[0]
                found[node] = min(found.get(node, mine), mine)
        return found

    def failed_everywhere_at_start(self, nodes: list[str]) -> str | None:
        """The run's end, if every one of `nodes` (each active node and spare) had a worker fail before
        the run's first step, and fail again once restarted in place: a failure the same everywhere (the
        workload, its data, the environment), which restarting in place or promoting a spare only
        repeats; None otherwise (a failure once, even on every node at the same time, may be transient:
        e.g. a one-node run whose data mount came up late is healed by its restart)."""
        failed = self.start_failures(nodes, repeated=True)
        if not nodes or len(failed) < len(nodes) or self.progress() > 0:
            return None
        _, wid, error = min(failed.values())
        names = ", ".join(sorted(nodes, key=lambda n: (not n.startswith("n"), index(n))))
        return (f"every node failed before the first step ({names}), a failure no restart or spare can heal; "
                f"first {wid}: {error}")

    def fail_run(self, why: str, blamed: list[str] | None = None) -> None:
        """End the run, failed, for `why`; `blamed`: the nodes `why` names (their workers' errors first)."""
        try:  # before the first step, a worker's own error says more (e.g. only some hosts lack the data)
            if "before the first step" not in why and self.progress() == 0:
                failed = self.start_failures(sorted(sealed.get_json(self.store, keys.MEMBERS, {})))
                # (the error of a node the message names, not one an earlier start already replaced)
                failed = {n: f for n, f in failed.items() if n in (blamed or ())} or failed
                if failed:
                    _, wid, error = min(failed.values())
                    why = f"{why} (before the first step, {wid} failed: {error})"
        except Exception:  # noqa: BLE001 - the run fails all the same, with the reason it was given
            pass
        self.keeper.put(keys.RUN_ERROR, why)
        self.event("run_failed", error=why)
        set_signed(self.store, env_token(), self.run_id, keys.RUN_STATE, "failed")
        self.keeper.keep(sig_key(keys.RUN_STATE), sign(env_token(), self.run_id, keys.RUN_STATE, "failed").encode())
        self.keeper.keep(keys.RUN_STATE, b"failed")
        self.final_state = "failed"

    def over(self) -> bool:
        """The run has a final state (kept in `final_state`)."""
        v = run_ended(self.store, self.run_id) if self.store.check([keys.RUN_STATE]) else None
        if v is not None:  # (a forged end is ignored)
            self.final_state = v
        return v is not None
