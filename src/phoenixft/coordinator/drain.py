"""Planned drains: a node that is still alive leaves at a step boundary, and a spare takes its role with
nothing lost.

A request is one store key per node slot (`keys.drain_key(slot)`, a JSON value read with
`values.parse_drain_request`): written by `phoenixft drain`, by a node's agent that received its drain
signal (`--drain-signal`, SIGUSR1 by default; SIGTERM with `--drain-on-sigterm`), by the `preempt:` fault,
or by any other producer (a straggler detector writes reason "straggler"). The coordinator is its one
consumer: `DrainDesk.pending` looks for requests (one `exists_many` every DRAIN_CHECK_S), ignores and
logs a malformed or stale one, and hands a valid one to `Decider.drain`, which

1. picks the step boundary every rank stops at (two steps past rank 0's last completed one) and writes
   the epoch's drain notice with it (`keys.drain_notice(e)`), then the epoch's failure flag: each worker's
   failure watcher sees a drain, not a failure, so the rank trains on to that boundary, stops there (no
   collective of the next step begun), lets the replication of that step finish (so the drained node's
   shard has a committed replica of it on another node) and posts its descriptor;
2. once every worker posted (bounded: a few steps' time, and half the notice left), sets the drain's end
   (`keys.drain_abort(e)`: a rank that missed the boundary leaves the step it waits in, as on a failure,
   having committed nothing of it) and gathers the descriptors as for any recovery;
3. plans the next epoch as a hot-swap with the drained node's slot given to a ready spare (or dropped:
   a shrink, when none is ready) and the drained node's descriptors left out (it is no member of the
   next epoch's groups: the spare's optimizer shard comes from its replica, its parameters from
   data-parallel peers), publishes it with class `planned`, action `drain`, and the drained node's
   workers, finding themselves `drained` in it, exit cleanly with their agent.

A drained node that dies before its drain is planned (its notice ran out) is found dead by the gather and
recovered like any failure: nothing is lost beyond what that failure loses.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from phoenixft.config import RunConfig
from phoenixft.controlplane import exists_many, keys, sealed
from phoenixft.controlplane.values import parse_drain_request
from phoenixft.coordinator.admission import Admission
from phoenixft.coordinator.shared import Job, Membership, hint_moved

__all__ = ["DRAIN_CHECK_S", "DrainDesk", "DrainRequest"]

DRAIN_CHECK_S = 0.1  # how often the coordinator looks for drain requests
STOP_WAIT_S = 5.0  # at least this long for every rank to stop at the drain's step boundary
SPARE_WAIT_S = 30.0  # at most this long for a starting spare to be ready (else the drain shrinks the job)


@dataclass
class DrainRequest:
    """One valid request, for the node in `slot` of the current epoch (`node`)."""

    slot: int
    node: str
    reason: str
    source: str
    deadline: float | None  # when the node goes (seconds since the epoch), None: no deadline
    t_notice: float  # when the notice came (the request's own time, else when the coordinator first saw it)

    def record(self) -> dict[str, object]:
        return asdict(self)


class DrainDesk:
    """Finds the drain requests of the nodes of the current epoch and says why one cannot be acted on."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership, admission: Admission) -> None:
        self.job, self.cfg, self.state, self.admission = job, cfg, state, admission
        self.store = job.store
        self._last = 0.0
        self._seen: dict[int, float] = {}  # slot -> when this coordinator first saw its request
        self._waiting: set[int] = set()  # slots whose drain waits for a starting spare (said once)
        self._raw: dict[int, bytes] = {}  # slot -> the request read there (sealed), until it is done
        self._done: set[bytes] = set()  # requests acted on or ignored: one written back (a replay) is not read again

    def pending(self) -> DrainRequest | None:
        """The first valid drain request of a node of the current epoch (throttled: None between looks)."""
        topo = self.state.topo
        now = time.monotonic()
        if topo is None or now - self._last < DRAIN_CHECK_S:
            return None
        self._last = now
        slots = list(range(len(topo.nodes)))
        for slot, there in zip(slots, exists_many(self.store, [keys.drain_key(s) for s in slots]), strict=True):
            if not there:
                continue
            req = self._read(slot)
            if req is not None:
                return req
        return None

    def _read(self, slot: int) -> DrainRequest | None:
        topo = self.state.topo
        assert topo is not None
        key = keys.drain_key(slot)
        raw = self.store.get_nowait(key)
        if raw is not None and bytes(raw) in self._done:
            self.store.delete_key(key)  # (a request this coordinator answered, written back)
            return None
        rec = parse_drain_request(sealed.unseal(key, raw), key)
        if rec is None:  # (not sealed with the run key, or not a request: logged) never acted on, and removed
            self.store.delete_key(key)
            return None
        node = topo.nodes[slot]
        self._raw[slot] = bytes(raw or b"")
        seen = self._seen.setdefault(slot, time.time())
        req = DrainRequest(slot=slot, node=node, reason=rec["reason"], source=rec["source"],
                           deadline=rec["deadline"], t_notice=rec["t"] if rec["t"] is not None else seen)
        why = self.refusal(req, rec["node_id"])
        if why:
            self.ignore(req, why)
            return None
        if self._spare_worth_waiting_for(req):
            return None  # (looked at again at the next look)
        return req

    def _spare_worth_waiting_for(self, req: DrainRequest) -> bool:
        """No spare is ready, one is starting, and the notice leaves time: wait for it (at most SPARE_WAIT_S
        and half of what is left of the notice) rather than shrink."""
        if self.admission.ready_spares():
            return False
        st = self.state
        admitted = sum(1 for m in st.members.values() if m.get("spare"))
        coming = self.admission.spare_coming(self.admission.ready_spares()) or admitted < self.cfg.spares
        waited = time.time() - self._seen.get(req.slot, time.time())
        budget = SPARE_WAIT_S if req.deadline is None else min(SPARE_WAIT_S, (req.deadline - req.t_notice) / 2)
        if coming and waited < budget:
            if req.slot not in self._waiting:
                self._waiting.add(req.slot)
                self.job.event("drain_waits_for_spare", node=req.node, slot=req.slot, at_most_s=round(budget, 1))
            return True
        return False

    def refusal(self, req: DrainRequest, node_id: str | None) -> str:
        """Why `req` cannot be carried out as a drain ('' if it can): the node it names left that slot, the
        run is unprotected, or without a ready spare the job cannot shrink (the last node; a tp x pp mesh)."""
        topo = self.state.topo
        assert topo is not None
        if node_id is not None and node_id != req.node:
            return f"it names {node_id}, and slot {req.slot} holds {req.node} now (a stale request)"
        if self.cfg.protect != "phoenix":
            return "the run is not protected (--protect none): no replica of its state to move"
        if self.boundary() >= self.cfg.steps:
            return f"the run ends (step {self.cfg.steps}) before a step boundary could drain it"
        self.admission.refresh_pool()
        if not self.admission.ready_spares():
            if len(topo.nodes) <= 1:
                return "it is the job's last node and no spare is ready"
            if topo.tp * topo.pp > 1:
                return f"no spare is ready and a {topo.tp}x{topo.pp} (tp x pp) mesh cannot drop a node"
        return ""

    def ignore(self, req: DrainRequest, why: str) -> None:
        """Say why `req` is not acted on, and remove it (the node goes on; if it dies, that is a failure)."""
        self.job.event("drain_ignored", node=req.node, slot=req.slot, reason=req.reason, source=req.source, why=why)
        self.done(req)

    def done(self, req: DrainRequest) -> None:
        self._done.add(self._raw.pop(req.slot, b""))
        self.store.delete_key(keys.drain_key(req.slot))
        self._seen.pop(req.slot, None)
        self._waiting.discard(req.slot)

    def boundary(self) -> int:
        """The step after which every rank stops: two past the last one rank 0 completed, so that every rank
        learns of the drain before it gets there (its failure watcher wakes within milliseconds); a rank that
        did not is inside the next step, waiting for the others, until the drain's end releases it."""
        return self.job.progress() + 2

    def await_stopped(self, e: int, world: int, req: DrainRequest) -> None:
        """Wait until every worker of epoch e stopped at the boundary and posted its descriptor, at most
        STOP_WAIT_S (a few steps: the last step's time counts) and half of what is left of the notice."""
        rec = sealed.get_json(self.store, keys.step(self.job.progress())) or {}
        dt = rec.get("dt")
        budget = max(STOP_WAIT_S, 6 * float(dt) if isinstance(dt, (int, float)) else 0.0)
        if req.deadline is not None:
            budget = min(budget, max(0.0, (req.deadline - time.time()) / 2))
        end = time.monotonic() + budget
        nodes = self.state.topo.nodes if self.state.topo is not None else []
        posts = sealed.Hint(keys.desc_posted(e), 0.25)  # (each worker sets it after its descriptor: "look")
        while time.monotonic() < end and not (hint_moved(posts, self.store) and self.job.posted(e, nodes)):
            time.sleep(0.005)

    def notice(self, e: int, req: DrainRequest, after: int) -> None:
        """The epoch's drain notice (before its failure flag): every rank stops after step `after`."""
        self.job.keeper.put(keys.drain_notice(e), json.dumps({**req.record(), "after_step": after}))
