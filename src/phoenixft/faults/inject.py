"""Deterministic fault injection inside the workers: real signals at named steps and phases.

The `--inject` specs (spec.py) that workers fire (their kind's `Point`, kinds.py) fire here, on the
rank they name, at the step and phase they name: `at(step, phase)` is called by the training step at
forward, backward, optimizer and (from the replication thread) replicate; `in_recovery(topo)` in the
middle of a recovery's transfers; `nan_at(step)` poisons a loss; `corrupt_replicas` flips bits of a
received replica at rest, and `corrupts_transfers` corrupts a copy in flight. A fault is claimed once
per run through the store, recorded as an event, then carried out by its kind (`FaultKind.act`: a real
SIGKILL / SIGSTOP / exit of the node's process group, or of the coordinator). `,wait=S` holds the step
on every rank, before it begins (`hold`), until the job is whole (full size, and a warm spare if the
job has spares), at most S seconds; the step of a fault an agent fires (a partition, a preemption's
notice) is held on every rank until that agent has taken it in hand.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import parse_int, parse_json
from phoenixft.core.context import RankContext
from phoenixft.distributed.topology import Topology
from phoenixft.faults import struck
from phoenixft.faults.kinds import Point
from phoenixft.faults.spec import FaultSpec
from phoenixft.protect.snapshot import Holding

__all__ = ["AGENT_FIRE_S", "FaultInjector"]

AGENT_FIRE_S = 30.0  # how long the workers hold a partition's step for its agent (which looks every second at most)


class FaultInjector:
    def __init__(self, ctx: RankContext) -> None:
        self.w = ctx  # the rank it runs on
        self._struck: list[str] = []  # the node ids the fault claimed last strikes (all of a rack's)
        self._slow: dict[int, float] = {}  # slow faults past their step: index -> factor on this node (1.0: not it)
        self._sdc_struck: dict[int, bool] = {}  # sdc fault index -> whether it struck this node (claimed here)

    def hold(self, step: int) -> None:
        """`,wait=S`: before step `step`, on every rank, hold until the job is whole (at most S) while a
        gated fault due now has not fired: a kill, hang or crash in this step, a corruption at rest in
        the next (it hits the replicas received during it, those of this step).

        Every rank holds, before any collective of the step, so no peer waits inside one meanwhile: a
        hold as long as the collective timeout would otherwise fail the step it means to protect
        (the peer's gloo send times out, a spurious recovery replays the step, which holds again)."""
        if self.w.topo is None:
            return
        for f in self.w.faults:
            if not f.kind_of.held_at(f, step):
                continue
            if f.point in (Point.HEARTBEAT, Point.NOTICE):  # a partition, a preemption: fired by an agent
                if any(s < len(self.w.topo.nodes) for s in f.nodes):
                    self._wait_agent(f)
            elif f.coordinator:
                if f.wait:
                    self._wait_coordinator(f)
            elif f.wait and not sealed.has(self.w.store, keys.fault_fired(f.index)):
                self._wait_whole(f)

    def at(self, step: int, phase: str, joined: Callable[[], None] | None = None) -> None:
        """Fire the faults due at (step, phase) on this rank. `joined` (the replicate phase) waits until
        every peer has entered the step's replication, so that the fault strikes at one point of the
        protocol however the ranks' threads are timed."""
        if self.w.topo is None:
            return
        slot = self.w.topo.slot_of(self.w.node_id)
        for f in self.w.faults:
            if f.point is not Point.STEP or f.step != step or f.phase != phase:
                continue
            if f.kind_of.strikes(f, self.w.rank, slot, self.w.topo):  # (a `,wait=S` fault held the step: `hold`)
                if joined is not None:
                    joined()
                self.fire(f, step=step, phase=phase)

    def slow_factor(self, step: int) -> float:
        """How many times as long this rank's compute of step `step` takes (`slow:` faults from their step on,
        on the node they first struck: a spare that takes its slot later is not slow). A fault's first step
        here claims and records it; later steps ask the store nothing."""
        factor = 1.0
        for f in self.w.faults:
            if f.point is not Point.COMPUTE or f.step is None or step < f.step or self.w.topo is None:
                continue
            if f.index not in self._slow:
                fired = sealed.has(self.w.store, keys.fault_targets(f.index))
                if not fired and self.w.topo.slot_of(self.w.node_id) in f.nodes:
                    self.fire(f, step=step, phase="compute")  # (its first firing sets the targets: this node)
                    fired = True
                if not fired:  # its node reaches the step later: ask again at the next step
                    continue
                self._slow[f.index] = f.factor if self.w.node_id in self._targets(f) else 1.0
            factor *= self._slow[f.index]
        return factor

    def _targets(self, f: FaultSpec) -> list[str]:
        """The node ids fault f strikes: fixed by its first firing, from the topology of that moment.

        A fault fires once per run: the step it names is replayed after the recovery it caused, in a
        topology whose slots may hold other nodes (a shrink renumbers them, and re-derives the racks),
        and those must not be struck again."""
        assert self.w.topo is not None
        mine = f.kind_of.target_nodes(f, self.w.node_id, self.w.topo)
        key = keys.fault_targets(f.index)
        cur = self.w.store.compare_set(key, b"", sealed.seal(key, json.dumps(mine)))  # the first to fire sets them
        got = parse_json(sealed.unseal(key, cur), key, None, list)
        if got is None:  # (not the job's: replaced by this node's)
            sealed.put(self.w.store, key, json.dumps(mine))
            return list(mine)
        return [str(n) for n in got]

    def _claim(self, f: FaultSpec) -> int:
        """Claim fault f for this node, once per run: the number of nodes it strikes, 0 if not this one
        (or already claimed here: a replayed step never fires it again)."""
        targets = self._targets(f)
        if self.w.node_id not in targets or not sealed.claim(self.w.store, keys.fault_claim(f.index, self.w.node_id)):
            return 0
        self._struck = targets
        return len(targets)

    def _record(self, f: FaultSpec, **where: Any) -> None:
        """The fault's record (its first firing: the report's `faults`) and its event (the live line)."""
        assert self.w.topo is not None
        rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": f.kind,
               "node": self.w.node_id, "nodes": self._struck, "slot": self.w.topo.slot_of(self.w.node_id),
               "rank": self.w.rank, "epoch": self.w.epoch, **where}
        if sealed.claim(self.w.store, keys.fault_fired(f.index)):
            sealed.put(self.w.store, keys.fault(f.index), json.dumps(rec))
        struck.mark(self.w.store, self.w.node_id, f)  # (its failures are the fault's, never its host's)
        sealed.append(self.w.store, keys.EVENTS, rec)

    def fire(self, f: FaultSpec, **where: Any) -> None:
        """Claim fault f for this node (once per run), record it, then act (its kind: a real signal)."""
        assert self.w.topo is not None
        targets = self._claim(f)
        if not targets:
            return
        self._together(f, targets)
        self._record(f, **where)
        # a round trip before acting: a `set` is not answered, so a kill right after it could take the record
        # with it where the store is reached through a relay of the node's own (the TLS forwarder)
        self.w.store.check([keys.fault(f.index)])
        f.kind_of.act(f, self)

    def _together(self, f: FaultSpec, targets: int, timeout_s: float = 10.0) -> None:
        """A fault on several nodes (`node=I,J`, `rack=A`) strikes them in the same instant: the first
        to arrive waits (bounded) for the others, which are in the same step, before any dies, so no
        survivor notices the first death and leaves the step before the others are hit."""
        if targets < 2:
            return
        sealed.put(self.w.store, keys.fault_together(f.index, self.w.node_id), "1")  # (one key per node: no counter)
        names = [keys.fault_together(f.index, n) for n in self._struck]
        deadline = time.monotonic() + timeout_s
        while sum(sealed.present(self.w.store, names)) < targets and time.monotonic() < deadline:
            time.sleep(0.002)

    def _wait_agent(self, f: FaultSpec) -> None:
        """A fault an agent fires at this step (a partition, a preemption's notice): hold (at most its
        `,wait=` and AGENT_FIRE_S more) until the agent of its node has taken it in hand (`fault_done`), so
        it strikes in this step, however fast the job trains, and no fault of a later step overtakes it; a
        recovery meanwhile takes the step over."""
        deadline = time.monotonic() + f.wait + AGENT_FIRE_S
        while not sealed.has(self.w.store, keys.fault_done(f.index)) and time.monotonic() < deadline:
            self.w.watcher.check()
            time.sleep(0.02)

    def _wait_whole(self, f: FaultSpec) -> None:
        """Hold (at most `,wait=S`) until the job is whole; a recovery meanwhile (the grow it waits for)
        takes the step over."""
        deadline = time.monotonic() + f.wait
        while not sealed.has(self.w.store, keys.JOB_WHOLE) and time.monotonic() < deadline:
            self.w.watcher.check()  # a recovery (the grow this waits for) takes the step over
            time.sleep(0.05)

    def _wait_coordinator(self, f: FaultSpec) -> None:
        """The step after a coordinator kill with `,wait=S`: hold (at most S) until a coordinator has (re)started
        its loop since the kill, so the run cannot end before the restart that proves the kill was recovered."""
        rec = parse_json(sealed.get(self.w.store, keys.fault(f.index)), keys.fault(f.index), None, dict) \
            if sealed.has(self.w.store, keys.fault_fired(f.index)) else None
        if rec is None:  # (not fired: nothing to wait for)
            return
        t_kill = float(rec.get("t", 0.0))
        deadline = time.monotonic() + f.wait
        while time.monotonic() < deadline:
            ready = self.w.store.get(keys.COORDINATOR_READY) if self.w.store.check([keys.COORDINATOR_READY]) else b""
            try:
                if float(ready or 0.0) >= t_kill:
                    return
            except ValueError:
                return  # (not a time: the wait proves nothing, train on)
            self.w.watcher.check()
            time.sleep(0.05)

    def kill_coordinator(self, timeout_s: float = 60.0) -> None:
        """SIGKILL the coordinator that runs now: one restarted after an earlier kill may still be
        starting (it publishes its pid when it is up), so wait for a live pid, bounded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pid = parse_int(sealed.get(self.w.store, keys.COORDINATOR_PID), keys.COORDINATOR_PID, 0)
                if pid > 0:  # (cleared by the launcher when a coordinator exits)
                    os.kill(pid, signal.SIGKILL)
                    return
            except ProcessLookupError:
                pass
            time.sleep(0.05)

    def in_recovery(self, topo: Topology) -> None:
        """kill:node=I@recovery=N and kill:...,phase=recovery fire here, mid state transfer."""
        slot = topo.slot_of(self.w.node_id)
        for f in self.w.faults:
            if f.point is not Point.RECOVERY or slot not in f.nodes:
                continue
            # by step: the recovery of a failure at step S, not a planned grow that happens to resume there
            if f.recovery == topo.epoch or (f.phase == "recovery" and f.step is not None
                                            and topo.resume_step >= f.step - 1 and topo.meta.get("class") != "planned"):
                self.fire(f, recovery=topo.epoch)

    def corrupts_transfers(self, topo: Topology) -> bool:
        slot = topo.slot_of(self.w.node_id)
        hits = [f for f in self.w.faults if f.point is Point.TRANSFER and slot in f.nodes
                and f.step is not None and topo.resume_step >= f.step - 1]
        for f in hits:
            self._fired(f)
        return bool(hits)

    def nan_at(self, step: int) -> bool:
        hits = [f for f in self.w.faults if f.point is Point.LOSS and f.step == step] if self.w.rank == 0 else []
        for f in hits:
            self._fired(f)
        return bool(hits)

    def at_rest(self, step: int) -> None:
        """sdc:node=I@step=S,target=shard fires here, on the replication thread of the node in slot I, once
        the protection of step S-1 committed (during step S): a bit of a copy it holds flips at rest."""
        if self.w.topo is None:
            return
        slot = self.w.topo.slot_of(self.w.node_id)
        for f in self.w.faults:
            if f.point is Point.AT_REST and f.step == step + 1 and f.kind_of.strikes(f, self.w.rank, slot, self.w.topo):
                self.fire(f, step=f.step, phase="at rest")

    def flip_at_rest(self, f: FaultSpec) -> None:
        """Flip one bit (f.bit, or one drawn from the run's seed) of a committed copy of step S-1 this rank
        holds; the event says which copy, element and bit."""
        from phoenixft.faults.at_rest import corrupt_at_rest

        rng = random.Random(f"{self.w.cfg.seed}/{f.index}/{self.w.wid}")
        what = corrupt_at_rest(self.w, (f.step or 1) - 1, f.bit, rng)
        self.w.event("corrupted_at_rest", spec=f.text, node=self.w.node_id, **(what or {"copy": None}))

    def _fired(self, f: FaultSpec) -> None:
        """Mark a fault that acts without `fire` (a corruption, a NaN) as fired: the report lists the
        `--inject` specs that never did (`faults_not_fired`)."""
        sealed.put(self.w.store, keys.fault_fired(f.index), "1")

    def corrupt_replicas(self, step: int, received: dict[int, Holding]) -> None:
        """corrupt:node=I@step=S: flip bytes of the replicas the node in slot I received for step S-1
        (during step S), once per run: the replication of S-1 repeated after a recovery is left intact."""
        if self.w.topo is None:
            return
        for f in self.w.faults:
            if (f.point is Point.REPLICAS and f.step == step + 1
                    and f.node == self.w.topo.slot_of(self.w.node_id)):
                halves: dict[int, tuple[Holding, int]] = {}
                for shard, h in received.items():
                    half = h.half_with(step)
                    if half is not None:
                        halves[shard] = (h, half)
                if not halves or not self._claim(f):
                    continue
                self._record(f, step=f.step, phase="at rest", replicas_of_step=step, shards=sorted(halves))
                for shard, (h, half) in halves.items():
                    h.data[half].view(-1)[:: max(1, h.numel // 7)] += 1.0  # crc now mismatches
                    self.w.event("corrupted_replica", shard=shard, step=step, spec=f.text)


    # ------------------------------------------------------------------ silent data corruption
    def sdc_due(self, step: int, target: str, first: bool = True) -> list[FaultSpec]:
        """The sdc faults that corrupt `target` on this node in step `step`: claimed (and recorded) at
        their first firing, once per run; a `,persist` one fires again every later computation on the
        node it struck first (a replacement in its slot is healthy). `first=False`: only those that
        already struck (a recomputation never takes a fault's first firing)."""
        if self.w.topo is None:
            return []
        slot = self.w.topo.slot_of(self.w.node_id)
        due = []
        for f in self.w.faults:
            if f.point is not Point.SDC or not f.kind_of.fires_at(f, step, target):  # type: ignore[attr-defined]
                continue
            if f.index in self._sdc_struck:
                if f.persist and self._sdc_struck[f.index]:
                    due.append(f)
                continue
            if not first or step != f.step or not f.kind_of.strikes(f, self.w.rank, slot, self.w.topo):
                continue
            mine = bool(self._claim(f))
            self._sdc_struck[f.index] = mine
            if mine:
                self._record(f, step=step, phase=target)
                due.append(f)
        return due

    def sdc_flip(self, f: FaultSpec, step: int, t: torch.Tensor, nonzero: bool) -> dict[str, Any]:
        """Flip one bit of one element of `t` in place (`,bit=B`, else drawn from the run's seed); the
        element drawn from the seed too (`nonzero`: among the non-zero ones, so that a gradient flip
        lands where the gradient is). Returns where, for the event."""
        import random

        rng = random.Random(f"{self.w.cfg.seed}/sdc/{f.index}/{step}/{self.w.rank}")
        flat = t.view(-1)
        bits = flat.element_size() * 8
        cand = torch.nonzero(flat).view(-1) if nonzero else None
        if cand is not None and cand.numel():
            i = int(cand[rng.randrange(cand.numel())])
        else:
            i = rng.randrange(flat.numel())
        bit = f.bit if f.bit is not None else rng.randrange(bits)
        bit = min(bit, bits - 1)
        words = flat.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[flat.element_size()])
        mask = 1 << bit
        if mask >= 1 << (bits - 1):
            mask -= 1 << bits
        before = float(flat[i])
        words[i] = int(words[i]) ^ mask
        where = {"element": i, "bit": bit, "before": before, "after": float(flat[i])}
        self.w.event("sdc_injected", spec=f.text, step=step, target=f.target, node=self.w.node_id, **where)
        return where
