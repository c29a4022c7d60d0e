"""The recovery's decision: from the gathered descriptors to the next epoch.

On a failure in epoch e (Algorithm 2 of the paper) `Decider.recover` sets the epoch's failure flag so
that every member stops at its next wait, has the `FailureDetector` gather the survivors'
descriptors (and name the dead), then `decide`s: fences the dead, picks the recovery step r (the
newest step for which every logical shard still has a committed copy somewhere: its owner, or a
verified replica; else a persistent checkpoint whose files verify), acquires one ready spare per
dead node (waiting, bounded, for the ones on their way when the planner says so; a mesh short of spares
otherwise drops whole data-parallel replicas and releases their healthy nodes as spares), and publishes
topology e+1 with the transfers through the `Publisher`. The planner itself is pure
(`phoenixft.recovery.planner`); a run that recovers again and again without completing a step, a
plan that fails, or a planner that raises fails the run in one line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import note_bad, parse_json
from phoenixft.coordinator.admission import Admission
from phoenixft.coordinator.detect import FailureDetector
from phoenixft.coordinator.drain import DrainDesk, DrainRequest
from phoenixft.coordinator.publish import Publisher
from phoenixft.coordinator.shared import Job, Membership
from phoenixft.distributed.topology import Topology
from phoenixft.errors import NOT_INSTALLED
from phoenixft.recovery.planner import Descriptor, Plan, PlanInput, plan_recovery

__all__ = ["MAX_RECOVERIES_WITHOUT_PROGRESS", "Decider", "gc_paused", "planned_drain", "verified_checkpoint"]

MAX_RECOVERIES_WITHOUT_PROGRESS = 12


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the burst of allocation between a recovery's gather and
    its publish (W descriptors parsed, a plan over them): a collection walks every object of the
    process (torch's modules included), and at W = 4,096 the burst set off collections that took as
    long as the plan itself (bench/control_plane.py). What the burst drops is freed by reference counting; the collector
    runs again once the epoch is published."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def verified_checkpoint(job: Job, roots: str | list[str], exclude: dict[str, str] | None = None
                        ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The newest checkpoint under `roots` (a directory, or several) that verifies
    (persist.verified_manifest); each newer one skipped is said, in one line, as a `checkpoint_skipped`
    event."""
    from phoenixft.protect.persist import skipped_line, verified_manifest  # (torch: see Decider)

    man: dict[str, Any] | None = None
    found: list[dict[str, Any]] = []
    for root in [roots] if isinstance(roots, str) else roots:
        m, sk = verified_manifest(root, exclude=exclude)
        found += sk
        if m is not None and (man is None or int(m["step"]) > int(man["step"])):
            man = m
    # newest first, and only those newer than the one used (an older one of another directory was not)
    skipped = sorted((x for x in found if man is None or x["step"] > int(man["step"])), key=lambda x: -x["step"])
    for x in skipped:
        job.event("checkpoint_skipped", **x,
              using=man["step"] if man is not None else None, line=skipped_line(x))
    return man, skipped


def planned_drain(plan: Plan, topo: Topology, dead: set[str], leaving: set[str], drain: DrainRequest) -> None:
    """A plan made with the drained node as if it were lost, told as what it is: class `planned`, action
    `drain` (its slot went to a spare) or `shrink` (no spare was ready); the drained node is named in the
    topology so that its workers leave cleanly (a fenced node's exit is a failure, a drained one's is not).
    A drained node that died before the plan is a failure like any other: then nothing changes."""
    if not leaving:
        return
    plan.klass = "planned"
    plan.action = "shrink" if plan.dropped else "drain"
    topo.meta.update({"class": plan.klass, "action": plan.action, "dead": sorted(dead), "drained": sorted(leaving),
                      "drain": {"reason": drain.reason, "source": drain.source}})


class _Planner:
    """One recovery's planning: the planner over the gathered descriptors and the ready spares, which
    falls back to the persistent tier only to a checkpoint whose files verify (read only then: a
    recovery from memory never waits for the disk)."""

    def __init__(self, job: Job, cfg: RunConfig, old: Topology, dead: set[str], restarted: set[str],
                 descs: dict[str, Descriptor], grow_only: bool, tiers: list[str], exclude: dict[str, str]) -> None:
        self.job, self.cfg, self.old, self.dead, self.restarted, self.descs = job, cfg, old, dead, restarted, descs
        self.grow_only, self.tiers, self.exclude = grow_only, tiers, exclude
        self.expected = 0  # spares expected within the bounded wait for them (a mesh short of spares)
        # a script whose model is sharded over its ranks (FSDP2) said so: its node count is fixed, as a mesh's
        self.fixed_size = bool(cfg.script) and sealed.has(job.store, keys.SCRIPT_FIXED_SIZE)
        self.man: dict[str, Any] | None = None
        if tiers:
            from phoenixft.protect.persist import latest_manifest

            self.man = max((m for m in map(latest_manifest, tiers) if m is not None), key=lambda m: int(m["step"]),
                           default=None)
        self.verified: list[Any] = []  # [(manifest, skipped)] once the persistent tier was verified

    def plan(self, pool: list[str]) -> Plan:
        """The recovery plan with the spares of `pool`."""
        p = self._plan_with(self.man, pool)
        if p.persistent_step is not None and not self.verified:
            good, skipped = verified_checkpoint(self.job, self.tiers, self.exclude)
            self.verified.append((good, skipped))
            if good is None or self.man is None or good["path"] != self.man["path"]:
                self.man = good
                p = self._plan_with(self.man, pool)
        return p

    def _plan_with(self, m: dict[str, Any] | None, pool: list[str]) -> Plan:
        cfg = self.cfg
        try:
            return plan_recovery(PlanInput(old=self.old, dead=self.dead, restarted=self.restarted, descs=self.descs,
                                           pool=pool, target_nodes=cfg.nodes, replicas=cfg.replicas,
                                           racks=cfg.racks, manifest=m, grow_only=self.grow_only,
                                           fixed_size=self.fixed_size, expected=self.expected))
        except Exception as ex:  # noqa: BLE001 - the planner is pure: a restarted coordinator would raise
            # again, each time, until the launcher gave up on it; so the run fails in one line instead
            traceback.print_exc(file=sys.stderr)  # (the coordinator's log: for the bug report)
            return Plan(ok=False, error=f"the recovery planner failed ({type(ex).__name__}: {str(ex)[:200]}): "
                                        "a defect of phoenixft; please report it with the run directory")

    def failure(self, error: str, refused: str) -> str:
        """Why no plan recovers: the planner's `error`, and when every complete checkpoint was skipped
        why the newest one was (`refused`: the workers' refusal of the one this epoch restored)."""
        skipped = self.verified[0][1] if self.verified else []
        if skipped:
            why = f"(the newest, step {skipped[0]['step']}: {skipped[0]['file']} {skipped[0]['why']})"
            error = (f"{refused}; no other persistent checkpoint verifies {why}" if refused and self.exclude else
                     f"{error} that verifies {why}")
        return error


class Decider:
    """Recovers the job from a failure: `recover` (flag, gather, decide) and `decide`."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership, admission: Admission,
                 detector: FailureDetector, publisher: Publisher) -> None:
        self.job = job
        self.store = job.store
        self.g = job.g
        self.cfg = cfg
        self.state = state
        self.admission = admission
        self.detector = detector
        self.publisher = publisher
        self._stuck: list[int] = []  # progress seen at each recovery since a step last completed
        self._refused: dict[str, str] = {}  # checkpoint path -> why: refused by the workers, never chosen again
        self._sdc: dict[str, dict[str, Any]] = {}  # nodes convicted of silent data corruption in this recovery
        if cfg.persist_dir or cfg.resume:  # the persistent tier's reader imports torch (seconds of CPU): now, not
            import phoenixft.protect.persist  # noqa: F401  (during a recovery; without a tier, never)

    def recover(self) -> None:
        assert self.state.topo is not None
        old = self.state.topo
        e = old.epoch
        t_start = time.time()
        self.job.keeper.put(keys.failflag(e), "1")
        self.job.keeper.drop(keys.JOB_WHOLE)
        self.store.delete_key(keys.JOB_WHOLE)  # not whole until published again
        if sealed.has(self.store, keys.drain_notice(e)):  # a drain this process did not finish (it took over since):
            self.job.keeper.put(keys.drain_abort(e), "1")  # every rank leaves its step now, as on any failure
        self.admission.health.begin(self.admission.ready_spares(pending=True))  # (stale ones check meanwhile)
        dead, fenced, restarted = self.detector.gather(e, old.nodes)
        self._sdc = self._convicted(e, old, dead, fenced)
        with gc_paused():
            self.decide(old, t_start, dead, fenced, restarted)

    def drain(self, req: DrainRequest, desk: DrainDesk) -> None:
        """A planned drain of the node `req` names (coordinator/drain.py): the epoch's drain notice (the step
        boundary every rank stops at) and failure flag; once every worker stopped there and posted (or after
        a bounded wait), the drain's end and the gather (the drained node posts too), then the decision with
        that node leaving. Had it died meanwhile (its notice ran out), the failure path takes over."""
        assert self.state.topo is not None
        old = self.state.topo
        e = old.epoch
        after = desk.boundary()
        t_start = time.time()
        self.job.event("drain_requested", epoch=e, node=req.node, slot=req.slot, reason=req.reason,
                       source=req.source, deadline=req.deadline, t_notice=req.t_notice, after_step=after)
        desk.notice(e, req, after)
        self.job.keeper.put(keys.failflag(e), "1")
        self.job.keeper.drop(keys.JOB_WHOLE)
        self.store.delete_key(keys.JOB_WHOLE)
        desk.await_stopped(e, old.world, req)
        self.job.keeper.put(keys.drain_abort(e), "1")  # (whoever is still inside a step of e leaves it now)
        dead, fenced, restarted = self.detector.gather(e, old.nodes)
        self._sdc = self._convicted(e, old, dead, fenced)
        if req.node in dead:
            self.job.event("drain_failed", epoch=e, node=req.node, why="the node was lost before its drain was "
                           "planned (its notice ran out): recovered as a failure")
        with gc_paused():
            self.decide(old, t_start, dead, fenced, restarted, drain=req)
        desk.done(req)

    def _convicted(self, e: int, old: Topology, dead: set[str], fenced: set[str]) -> dict[str, dict[str, Any]]:
        """The nodes a rank proved to compute wrong in epoch e (phoenixft.sdc): dead and fenced like a
        failed node, and their hosts quarantined for the rest of the job (phoenixft.health: never admitted
        again, whatever their failure count)."""
        from phoenixft.health import quarantine
        from phoenixft.sdc.record import accused, sdc_quarantine

        found = {n: r for n, r in accused(self.store, e).items() if n in old.nodes}
        for n, r in found.items():
            dead.add(n)
            fenced.add(n)
            why = f"silent data corruption in step {r.get('step')} ({r.get('verdict')}): {r.get('why', '')}"
            sdc_quarantine(self.store, n, why)
            if self.admission.health.injected(n) is None:  # (an injected corruption is not held against the host)
                quarantine(self.store, self.admission.health.host(n), f"{n}: {why}")
            self.job.event("sdc_fenced", epoch=e, node=n, step=r.get("step"), verdict=r.get("verdict"))
        return found

    def decide(self, old: Topology, t_start: float, dead: set[str], fenced: set[str], restarted: set[str],
               drain: DrainRequest | None = None) -> None:
        """The gather is done: fence the dead, fetch and parse the descriptors, plan, publish. `drain`: the
        epoch ended for a planned drain; its node leaves (unless it died: then it is one of `dead`)."""
        e = old.epoch
        restarted = self._fence(dead, restarted)
        self.admission.health.note_dead(dead, e)  # (the failure history of their hosts; a drained node is no failure)
        leaving = {drain.node} if drain is not None and drain.node not in dead else set()
        descs = self._descriptors(old, dead | leaving)
        stuck = self.recovery_loop(descs)
        if stuck:
            self.recovery_failed(e, t_start, dead, fenced, restarted, descs, stuck)
            self.job.fail_run(stuck)
            return
        t_first = self._failures_reported(e, t_start, descs)
        self.admission.refresh_pool()
        need = len(dead) + len(leaving) + max(0, self.cfg.nodes - len(old.nodes))
        pool = self.admission.health.vet(self.admission.ready_spares(pending=True), need)  # (a fresh verdict each)
        grow_only = (not dead and not leaving and not restarted and len(old.nodes) < self.cfg.nodes
                     and not sealed.has(self.store, keys.failflag_by_worker(e)))
        tiers, refused = self._persistent_tiers(old, descs)
        planner = _Planner(self.job, self.cfg, old, dead | leaving, restarted, descs, grow_only, tiers,
                           dict(self._refused))
        unrepairable: dict[str, str] = {}
        if (old.tp * old.pp > 1 or planner.fixed_size) and len(dead) > len(pool):
            # spares it may wait for (bounded): the lost nodes' repairs, a spare that is starting (only now: a
            # forced read of the quarantined hosts); the planner decides whether to wait or shrink
            unrepairable = self._unrepairable(dead)
            repairs = len(dead) - len(unrepairable) if self.cfg.repair_after > 0 else 0
            planner.expected = repairs + (len(dead) if self.admission.spare_coming(pool) else 0)
        plan = planner.plan(pool)
        if plan.wait:  # the expected spares cover the loss: wait for them (bounded), then plan with what came
            pool = self.admission.health.vet(self._wait_for_spares(e, dead, pool), need)
            planner.expected = 0
            plan = planner.plan(pool)
        if not plan.ok:
            plan = self.fresh_start(old, dead | leaving, descs, pool, progress=self.job.progress()) or plan
        if not plan.ok or plan.topo is None:
            error = planner.failure(plan.error, refused)
            if unrepairable:
                error += "; " + "; ".join(f"{n} cannot come back: {why}" for n, why in sorted(unrepairable.items()))
            self.recovery_failed(e, t_start, dead, fenced, restarted, descs, error)
            self.job.fail_run(f"{error} (epoch {e})")
            return
        if drain is not None:
            planned_drain(plan, plan.topo, dead, leaving, drain)
        self._publish(old, plan, plan.topo, t_start, t_first, dead, fenced, restarted, descs, drain)
        self.state.dead |= leaving  # (gone for good: never a spare again, also after a journal reload)

    def _fence(self, dead: set[str], restarted: set[str]) -> set[str]:
        """Fence the dead nodes; the restarted workers that are not on one of them."""
        for w in restarted:
            self.store.delete_key(keys.worker_exit(w))
            self.job.forget_ready(w)
        restarted = {w for w in restarted if w.split(".")[0] not in dead}
        for n in dead:
            self.job.keeper.put(keys.fence(n), str(time.time()))  # when: nothing of n may be written after it
        self.state.dead |= dead
        return restarted

    def _descriptors(self, old: Topology, dead: set[str]) -> dict[str, Descriptor]:
        """The surviving workers' descriptors of epoch `old`, fetched in one round trip."""
        live = [w for n in old.nodes if n not in dead for w in self.job.wids(n)]
        raw = self.store.multi_get([keys.desc(old.epoch, w) for w in live]) if live else []
        out = {}
        for w, r in zip(live, raw, strict=True):
            rec = parse_json(sealed.unseal(keys.desc(old.epoch, w), r), keys.desc(old.epoch, w))
            if rec is None:  # (not sealed with the run key, or not JSON: logged; its worker counts as lost)
                continue
            try:
                out[w] = Descriptor.from_json(rec)
            except (KeyError, TypeError, ValueError, AttributeError):
                note_bad(keys.desc(old.epoch, w), "not a descriptor", bytes(r))  # (its worker counts as lost)
        return out

    def _failures_reported(self, e: int, t_start: float, descs: dict[str, Descriptor]) -> float:
        """Say who reported the failure first, and when (the time is returned)."""
        t_first = min([d.t for d in descs.values()] + [t_start])
        first = min(descs.values(), key=lambda d: d.t, default=None)
        self.job.event("failures_reported", epoch=e, reports=len(descs), first=first.wid if first else None,
                       t_first=t_first, errors=sorted({d.error[:300] for d in descs.values()})[:5])
        return t_first

    def _persistent_tiers(self, old: Topology, descs: dict[str, Descriptor]) -> tuple[list[str], str]:
        """The persistent tier's directories, and the workers' refusal of the checkpoint this epoch restored
        ('' if none; that checkpoint is then never chosen again in this run)."""
        # the persistent tier: --persist-dir's checkpoints, and the one --resume started from (until this
        # run has written a newer one, it is the newest state on disk: without it, losing a shard's every
        # copy before the first new checkpoint lost a run that had just been resumed)
        tiers = [t for t in dict.fromkeys((self.cfg.persist_dir, self.cfg.resume)) if t]
        refused = next((d.error for d in descs.values() if d.error.startswith(NOT_INSTALLED)), "")
        if refused and old.meta.get("restore") == "persistent":
            # the workers refused the checkpoint this epoch restored (it changed after it was verified, or
            # their hosts cannot read it): never again in this run (the set of them, not the last one only,
            # so that the choice cannot go back and forth between two refused ones), and the newest other one
            was = str(old.meta["manifest"]["path"])
            tiers = tiers or [os.path.dirname(was)]
            self._refused[was] = f"was refused by the workers ({refused.split(': ', 1)[-1][:200]})"
        return tiers, refused

    def _unrepairable(self, dead: set[str]) -> dict[str, str]:
        """The lost nodes whose repair (--repair-after) would be refused, with why: those on a quarantined
        host (a node convicted of silent data corruption has its host quarantined at once)."""
        quarantined = self.admission.health.quarantined(force=True)
        out = {}
        for n in dead:
            host = self.admission.health.host(n)
            if host in quarantined:
                out[n] = ("convicted of silent data corruption, " if n in self._sdc else "") + \
                    f"its host {host} is quarantined"
        return out

    def _wait_for_spares(self, e: int, dead: set[str], pool: list[str]) -> list[str]:
        """The planner waits for expected spares (a mesh, or a model sharded over its ranks, short of spares):
        wait (bounded) for the repaired nodes to come back as spares, or for the spare that is starting
        (--spare-arrives-at-step) to be ready; the ready spares then."""
        self.job.event("waiting_for_spares", epoch=e, need=len(dead), ready=len(pool))
        deadline = time.monotonic() + self.cfg.mesh_spare_wait_s
        while len(pool) < len(dead) and time.monotonic() < deadline:
            time.sleep(0.1)
            self.admission.refresh_pool()
            pool = self.admission.ready_spares()
        return pool

    def _publish(self, old: Topology, plan: Plan, topo: Topology, t_start: float, t_first: float, dead: set[str],
                 fenced: set[str], restarted: set[str], descs: dict[str, Descriptor],
                 drain: DrainRequest | None = None) -> None:
        """Take the promoted spares from the pool, record the recovery for the report, publish epoch e+1."""
        e = old.epoch
        for s in plan.promoted:
            self.state.spare_pool.remove(s)
        for n in plan.released:  # the healthy nodes of a dropped data-parallel replica: spares from now on
            if n not in self.state.spare_pool:
                self.state.spare_pool.append(n)
        if plan.released:
            self.admission.health.ask(plan.released)  # (checked before a promotion, as any spare)
        if plan.dropped or plan.released:
            self.job.event("shrink", epoch=e, dropped=plan.dropped, released=plan.released, world=topo.world)
        elif plan.action == "grow":
            self.job.event("grow", epoch=e, added=plan.promoted, world=topo.world)
        if plan.persistent_step is not None:
            self.job.event("fallback_persistent", epoch=e, reason=topo.meta["reason"], step=plan.persistent_step,
                           path=topo.meta["manifest"]["path"])
        max_committed = max((max(d.params) for d in descs.values() if d.params), default=plan.resume_step)
        progress = self.job.progress()
        klass = "sdc" if set(self._sdc) & dead else plan.klass
        self.job.event("classified", epoch=e, dead=sorted(dead), fenced=sorted(fenced), restarted=sorted(restarted),
                       **{"class": klass}, action=plan.action, drained=topo.meta.get("drained", []))
        t_decided = time.time()
        rec: dict[str, Any] = {"epoch": e + 1, "failed_epoch": e, "t_start": t_start, "t_first_report": t_first,
               "t_decided": t_decided, "dead": sorted(dead), "fenced": sorted(dead), "unresponsive": sorted(fenced),
               "promoted": plan.promoted,
               "resume_step": plan.resume_step, "max_committed": max(max_committed, progress, old.resume_step),
               "class": klass, "sdc": self._sdc,
               "action": plan.action, "restarted": sorted(restarted), "dropped": plan.dropped, "world": topo.world,
               "released": plan.released,
               "errors": sorted({d.error for d in descs.values()})[:5],
               "replicas_rejected": [list(x) for x in plan.rejected],
               "bad_sources": sorted({x for d in descs.values() for x in d.bad_sources}),
               "persistent_step": plan.persistent_step}
        if drain is not None:  # the drain it answers: whether it completed as one, or fell back to a failure
            rec["drain"] = {**drain.record(), "completed": drain.node in topo.meta.get("drained", [])}
            rec["drained"] = list(topo.meta.get("drained", []))
        self.job.keeper.put(keys.recovery(e + 1), json.dumps(rec))
        self.publisher.publish(topo)
        self.job.event("recovery_planned", epoch=e + 1, resume_step=plan.resume_step, promoted=plan.promoted,
                       decide_s=t_decided - t_start)

    def fresh_start(self, old: Topology, dead: set[str], descs: dict[str, Descriptor], pool: list[str],
                    progress: int) -> Plan | None:
        """A node lost before the run's first step committed anywhere (e.g. dead before its groups were
        built): nothing is lost, since step 0 is the model as the seed builds it, which every node can
        rebuild. So the run starts afresh with ready spares in the dead nodes' slots (no shrink: the
        layout stays the configured one). None when that does not apply (the planner's answer stands)."""
        if self.cfg.resume or old.restore_path != "init" or old.resume_step != 0 or progress > 0:
            return None
        held = [st for d in descs.values() for st in d.params] + [
            st for d in descs.values() for src in (d.own, d.holdings) for steps in src.values() for st in steps]
        if any(st > 0 for st in held) or len(pool) < len(dead):
            return None
        spares = list(pool)
        nodes = [spares.pop(0) if n in dead else n for n in old.nodes]
        promoted = [n for n in nodes if n not in old.nodes]
        topo = Topology(epoch=old.epoch + 1, nodes=nodes, workers_per_node=self.g, replicas=self.cfg.replicas,
                        racks=self.cfg.racks, resume_step=0, tp=old.tp, pp=old.pp,
                        meta={"restore": "init", "dead": sorted(dead), "promoted": promoted, "class": "permanent",
                              "action": "hotswap", "generation": int(old.meta.get("generation", 0)), "dropped": []})
        return Plan(ok=True, topo=topo, klass="permanent", action="hotswap (fresh start: nothing committed yet)",
                    resume_step=0, promoted=promoted)

    def recovery_loop(self, descs: dict[str, Descriptor]) -> str:
        """Why the run must stop ('' if not): it recovers again and again without completing a step (a fault
        the planner cannot route around keeps firing), and every recovery of the loop would be the same."""
        progress = self.job.progress()
        self._stuck = [p for p in self._stuck if p == progress] + [progress]
        if len(self._stuck) <= MAX_RECOVERIES_WITHOUT_PROGRESS:
            return ""
        errors = sorted({d.error for d in descs.values()})[:3]
        return (f"{len(self._stuck)} recoveries in a row without completing a step (stuck after step "
                f"{progress}); the last errors: {'; '.join(errors)}")

    def recovery_failed(self, e: int, t_start: float, dead: set[str], fenced: set[str], restarted: set[str],
                        descs: dict[str, Descriptor], error: str) -> None:
        """The recovery of epoch e's failure ends the run: recorded (what it found, why) for the report,
        whose recoveries would otherwise end silently before the failure that ended the run. Its fields
        are named as a recovery record's (`fenced`: the nodes found dead; `unresponsive`: those fenced)."""
        self.job.keeper.put(keys.recovery_failed(e + 1), json.dumps({
            "epoch": e + 1, "failed_epoch": e, "t_start": t_start,
            "t_first_report": min([d.t for d in descs.values()] + [t_start]), "t_decided": time.time(),
            "dead": sorted(dead), "fenced": sorted(dead), "unresponsive": sorted(fenced),
            "restarted": sorted(restarted), "class": "permanent" if dead else "transient",
            "errors": sorted({d.error for d in descs.values()})[:5], "error": error,
            "max_committed": max([max(d.params) for d in descs.values() if d.params] + [self.job.progress()])}))
