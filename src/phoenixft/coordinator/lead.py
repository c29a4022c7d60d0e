"""Leadership, start-up and the main loop of the coordinator (`Coordinator`), and its command line
(`main`, `python -m phoenixft.coordinator`).

`Coordinator` wires the parts of the coordinator together over one `Job` and one `Membership`
(`shared.py`): `Admission` (admission.py), `FailureDetector` (detect.py), `Publisher` (publish.py)
and `Decider` (decide.py). On a store with leases it stands by until it leads (`controlplane.Election`); then it
reloads the journal or starts the job once the `--nodes` active nodes have joined and are ready
(a node lost while starting gets a ready spare in its slot), and loops: answer join requests, wake
on a failure flag (a watch thread), recover, stop the job with its state saved when asked (stop.py), drain,
keep `job/whole` up to date, until the run has a final state.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
import time

from phoenixft.config import RunConfig
from phoenixft.controlplane import (
    Election,
    Store,
    StoreUnavailable,
    auth,
    exists_many,
    keys,
    poll_interval,
    sealed,
)
from phoenixft.controlplane.signed import CONFIG_WAIT_S, wait_verified
from phoenixft.coordinator.admission import Admission
from phoenixft.coordinator.decide import Decider, verified_checkpoint
from phoenixft.coordinator.detect import FailureDetector
from phoenixft.coordinator.drain import DrainDesk
from phoenixft.coordinator.publish import Publisher, deposed
from phoenixft.coordinator.shared import Job, Membership, index, wait_key
from phoenixft.coordinator.stop import STOPPED, StopDesk
from phoenixft.coordinator.stragglers import StragglerMonitor
from phoenixft.distributed.topology import Topology

__all__ = ["ControlPlaneLost", "Coordinator", "WrongToken", "main"]

FORGED_FLAG_POLL_S = 0.02  # a failure flag not sealed with the run key is polled this often until replaced
POLL_S = 0.025  # steady state: a flag-watch thread wakes the loop at once on a failure (see _watch_flags)
JOIN_NAP_S = 0.05  # the longest the loop waiting for the nodes to join sleeps between two looks
STANDBY_GIVE_UP_S = 60.0  # a standby whose store has had no quorum for this long stops (no job outlives that)


class ControlPlaneLost(RuntimeError):
    """The replicated store has not answered for too long: nothing this process could do would reach anyone."""


class WrongToken(RuntimeError):
    """This process's job token is not the job's: what it signed, no worker would accept."""


class Coordinator:
    """The job's coordinator on `store`, signing with the job `token`; with `journal` (a file) it
    journals there too; with `election` (a store with leases) it acts only while it leads."""

    def __init__(self, store: Store, journal: str | None = None, token: str = "",
                 election: Election | None = None, run_id: str = "") -> None:
        if not token:
            raise ValueError("the coordinator needs the job token (it signs what it publishes)")
        self.store = store
        self.election = election  # this process acts only while it leads
        self.poll_s = poll_interval(store, POLL_S)  # steady state (woken by a watch thread on a failure)
        self._wake = threading.Event()
        self.gather_poll_s = min(self.poll_s, 0.01)  # while a recovery waits for descriptors
        wait_key(self.store, keys.CONFIG, 120.0)
        # the run id: given by the launcher (--run-id), else the store's, which only counts if the config verifies
        # with it: a MAC under the run key of a run id of a stranger's choosing cannot be made without the token
        self.run_id = run_id or (self.store.get(keys.RUN_ID).decode(errors="replace")
                                 if self.store.check([keys.RUN_ID]) else "")
        sealed.bind(token, self.run_id)
        self.cfg = RunConfig.from_json(self._verified_config(token))
        self.led = False  # this process acted as the job's coordinator (a standby: once it took over)
        self.g = self.cfg.workers_per_node
        self.job = Job(store, self.g)
        self.job.run_id = self.run_id
        self.job.keeper.guard = lambda: self.election is None or self.election.leading  # (a deposed one writes none)
        self.job.keeper.start(store.independent())  # (its own client: it looks also while a recovery waits)
        self.state = Membership()
        self.publisher = Publisher(self.job, self.state, journal, token, election)
        desk = auth.AdmissionDesk(store, token, run_id=self.run_id, keeper=self.job.keeper)
        self.admission = Admission(self.job, self.cfg, self.state, desk, self.run_id)
        self.detector = FailureDetector(self.job, self.cfg, self.state, self.admission, self.gather_poll_s)
        self.decider = Decider(self.job, self.cfg, self.state, self.admission, self.detector, self.publisher)
        self.stragglers = StragglerMonitor(self.job, self.cfg, self.state, self.admission, self.detector)
        self.drains = DrainDesk(self.job, self.cfg, self.state, self.admission)
        self.stops = StopDesk(self.job, self.cfg, self.state)
        self.admission.load_members()  # (again once this process leads: a standby's view is old by then)

    def _verified_config(self, token: str) -> bytes:
        """The job's config once its signature verifies with the run key (the launcher puts back one that
        something else overwrote); WrongToken after CONFIG_WAIT_S (this token, or run id, is not the job's)."""
        raw = wait_verified(self.store, token, self.run_id, keys.CONFIG, CONFIG_WAIT_S)
        if raw is None:
            raise WrongToken(f"${auth.TOKEN_ENV} is not this job's token (or {self.run_id!r} not its run id): the "
                             "job's config is not signed with them")
        return raw

    # ------------------------------------------------------------------ main loop
    def _lead(self, announce: str = "") -> bool:
        """Stand by until this process leads (under an election); False if the run ended meanwhile. `announce` is
        printed once this process stands by (its token checked, the job's config loaded)."""
        if self.election is None:
            return True
        if announce:
            print(announce, flush=True)
        t0 = time.monotonic()
        try:
            was = self.election.leader()
        except (StoreUnavailable, OSError):
            was = "(unknown: the control plane did not answer)"
        while not self.election.campaign(timeout_s=2.0):
            if self._job_ended(serializable=True):
                return False
            if time.monotonic() - self.election.last_contact > STANDBY_GIVE_UP_S:
                raise ControlPlaneLost(f"no quorum for {STANDBY_GIVE_UP_S:g}s at {self.store.address}: the job "
                                       "cannot go on without one; stopping")
        if self._job_ended(serializable=False):  # it ended meanwhile: never lead a job whose keys are gone
            self.election.resign()
            return False
        if was is not None:
            self.job.event("coordinator_takeover", previous=was, leader=self.election.ident,
                           standby_s=round(time.monotonic() - t0, 3))
        return True

    def _job_ended(self, serializable: bool) -> bool:
        """The run has a final state, or its keys are gone (it ended and its head removed them). A
        member that answers a serializable read may be behind (one just restarted): that the keys are
        gone is believed only from a linearizable read. The store not answering: not ended (stand by on)."""
        try:
            over, there = self.store.exists_many([keys.RUN_STATE, keys.CONFIG], serializable=serializable)
            if not over and not there and serializable:
                over, there = self.store.exists_many([keys.RUN_STATE, keys.CONFIG])
            if over and self.job.over():  # (a run state not signed with the run key is ignored)
                print(f"phoenixft coordinator: the run ended ({self.job.final_state or '?'}); standing down",
                      flush=True)
                return True
            if not there:
                print(f"phoenixft coordinator: the job's keys are gone from {self.store.address} (it ended); "
                      "standing down", file=sys.stderr, flush=True)
            return not there
        except (StoreUnavailable, OSError):
            return False

    def run(self, announce: str = "") -> None:
        if not self._lead(announce):
            return
        self.led = True
        self.admission.load_members()
        self.admission.health.publish_reference()
        self.job.keeper.put(keys.COORDINATOR_PID, str(os.getpid()))
        if self.publisher.reload():
            assert self.state.topo is not None
            self.job.event("coordinator_restarted", epoch=self.state.topo.epoch, spare_pool=self.state.spare_pool,
                           **({"leader": self.election.ident} if self.election is not None else {}))
            self.store.set(keys.COORDINATOR_READY, str(time.time()))
            self._loop()
            return
        deadline = time.monotonic() + self.cfg.join_timeout
        swapped: dict[str, str] = {}  # an active node that died before the start -> the spare in its slot
        # looked at every 5 ms at first, then less often (JOIN_NAP_S): agents started by hand take seconds to
        # import torch, and a join loop of several store requests every 5 ms competes with them for the CPU
        nap = 0.005
        while True:
            self.admission.admit(force=True)
            slots = sorted((n for n in self.state.members if n.startswith("n")), key=index)
            active = [swapped.get(n, n) for n in slots]
            if len(active) == self.cfg.nodes and self.job.ready(active):
                break
            if len(slots) == self.cfg.nodes:  # every node and spare failing alike: no slot will ever be ready
                why = self.job.failed_everywhere_at_start(sorted(self.state.members, key=index))
                if why is not None:
                    self.job.fail_run(why)
                    return
            if len(active) == self.cfg.nodes:
                self._replace_dead_before_start(active, swapped)
            if self.job.over():
                return
            if (stop := self.stops.requested()) is not None:  # every node goes before the job started
                self.stops.before_start(stop)
                return
            if time.monotonic() > deadline:
                waiting = [n for n in active if not self.job.node_ready(n)]
                joined = ", ".join(self.state.label(n) for n in active) or "none"
                if len(active) < self.cfg.nodes:
                    self.job.fail_run(f"only {len(active)} of {self.cfg.nodes} node(s) joined within --join-timeout="
                                      f"{self.cfg.join_timeout:g}s (joined: {joined}"
                                      + (f"; not ready yet: {', '.join(waiting)}" if waiting else "") + ")",
                                      blamed=waiting)
                else:  # every slot filled: some node never got its workers ready (and no ready spare took its slot)
                    self.job.fail_run(f"all {self.cfg.nodes} node(s) joined, but {', '.join(waiting)} did not get its "
                                      f"workers ready within --join-timeout={self.cfg.join_timeout:g}s (its agent "
                                      "stopped or died while starting, and no ready spare could take its slot; "
                                      f"joined: {joined})", blamed=waiting)
                return
            time.sleep(nap)
            nap = min(nap * 1.5, poll_interval(self.store, JOIN_NAP_S))
        self.job.event("run_start", nodes=active, spares=self.state.spare_pool)
        start, meta = 0, {}
        if self.cfg.resume:
            man, skipped = verified_checkpoint(self.job, self.cfg.resume)
            if man is None:
                why = (f"no checkpoint verifies (the newest, step {skipped[0]['step']}: {skipped[0]['file']} "
                       f"{skipped[0]['why']})" if skipped else "no complete checkpoint")
                self.job.fail_run(f"--resume {self.cfg.resume}: {why}")
                return
            start, meta = man["step"], {"restore": "persistent", "manifest": man}
        if swapped:
            meta = {**meta, "promoted": [s for s in active if s in swapped.values()]}  # (their workers wait for it)
        self.publisher.publish(Topology(epoch=0, nodes=active, workers_per_node=self.g, replicas=self.cfg.replicas,
                                        racks=self.cfg.racks, resume_step=start, meta=meta, tp=self.cfg.tp,
                                        pp=self.cfg.pp))
        self.store.set(keys.COORDINATOR_READY, str(time.time()))
        self._loop()

    def _loop(self) -> None:
        last_whole = 0.0
        # poll slowly (every poll takes CPU from training on the same machines), but wake at once when
        # the epoch's failure flag is set
        threading.Thread(target=self._watch_flags, name="phoenixft-flag-watch", daemon=True).start()
        while True:
            assert self.state.topo is not None
            # one request:
            over, flagged = exists_many(self.store, [keys.RUN_STATE, keys.failflag(self.state.topo.epoch)])
            if over and self.job.over():  # (a run state not signed with the run key is ignored)
                break
            if flagged:  # (a flag not sealed with the run key is ignored, logged)
                flagged = sealed.has(self.store, keys.failflag(self.state.topo.epoch))
            self.admission.admit()
            if flagged or self.detector.failure_pending():
                # before the first step, every node and spare failing alike (e.g. in epoch 0's join): no
                # recovery can heal that, each would restart or promote nodes that fail the same way
                why = self.job.failed_everywhere_at_start(sorted(self.state.members, key=index))
                if why is not None:
                    self.job.fail_run(why)
                    continue
                self.decider.recover()
            elif (stop := self.stops.requested()) is not None:  # (before drains: every node goes)
                self.stops.stop(stop, self.drains.boundary())
            elif (drain := self.drains.pending()) is not None:
                self.decider.drain(drain, self.drains)
            else:
                self._wake.wait(self.poll_s)
                self._wake.clear()
            if time.monotonic() - last_whole > 0.25:
                last_whole = time.monotonic()
                self._publish_whole()
                self.stragglers.poll()  # (between recoveries: an eviction is recovered at the next look)

    def _replace_dead_before_start(self, active: list[str], swapped: dict[str, str]) -> None:
        """Before the start, every active slot filled: an active node that is not ready and is gone (its
        agent's exit reported, its heartbeat stale, or no heartbeat --start-grace after its
        admission: it died while starting) gets a ready spare in its slot, and is fenced. Without this,
        a host lost during the join held its slot until --join-timeout (600 s) failed the run, with a
        ready spare waiting."""
        now = time.monotonic()
        for n in active:
            if not n.startswith("n") or self.job.node_ready(n):
                continue
            pool = [s for s in self.admission.ready_spares() if s not in swapped.values()]
            if not pool:
                return
            beat = self.store.check([keys.heartbeat(n)])
            grace = max(self.cfg.failure_timeout, self.cfg.start_grace)
            silent = time.time() - float(self.state.members[n]["t"]) > grace
            if not (self.detector.exited([n]) or (beat and self.detector.stale([n], now)) or (not beat and silent)):
                continue
            spare = pool[0]
            swapped[n] = spare
            self.state.dead.add(n)
            self.state.spare_pool.remove(spare)
            self.job.keeper.put(keys.fence(n), str(time.time()))
            self.job.event("replaced_before_start", node=n, spare=spare,
                           why="its agent exited" if n in self.detector.exited_nodes else "no heartbeat")

    def _watch_flags(self) -> None:
        """Block on the current epoch's failure flag (on a client whose wait holds up no other caller:
        `Store.independent()`) and wake the loop when it is set, so that the loop can poll slowly
        without noticing failures late. Every epoch ends by its flag being set, which frees this wait."""
        from datetime import timedelta

        store, slice_s = self.store.independent(), self.store.wait_slice_s
        forged = -1  # the epoch whose flag in the store is not sealed with the run key: polled, not waited on
        while True:
            topo = self.state.topo
            if topo is None:
                time.sleep(0.05)
                continue
            try:
                if forged != topo.epoch:
                    store.wait([keys.failflag(topo.epoch)], timedelta(seconds=slice_s))
                elif not sealed.has(store, keys.failflag(topo.epoch)):
                    time.sleep(FORGED_FLAG_POLL_S)  # (a wait would return at once: poll until it is replaced)
                    continue
                if not sealed.has(store, keys.failflag(topo.epoch)):
                    forged = topo.epoch  # set by something other than this job: ignored (logged)
                    continue
            except Exception:  # noqa: BLE001 - not set within the slice, or the cluster is briefly away
                continue
            self._wake.set()
            while self.state.topo is topo:  # until the recovery has published the next epoch
                time.sleep(0.02)

    def _publish_whole(self) -> None:
        """`job/whole`: the job has its full size and, if it was given spares, at least one warm spare
        (what `,wait=S` faults wait for). A job run without spares (--spares 0, e.g. with --repair-after:
        a repaired node returns as a spare and is grown in at once) is whole at its full size."""
        assert self.state.topo is not None
        self.admission.refresh_pool()
        ready = self.admission.ready_spares() if self.state.spare_pool else []
        self.admission.health.keep_fresh([s for s in ready if not self.state.in_use(s)])  # (background re-checks)
        whole = len(self.state.topo.nodes) == self.cfg.nodes and (self.cfg.spares == 0 or bool(ready))
        there = sealed.present(self.store, [keys.JOB_WHOLE])[0]  # (a write only when it changes)
        if whole and not there:
            self.job.keeper.put(keys.JOB_WHOLE, "1")
        elif not whole and there:
            self.job.keeper.drop(keys.JOB_WHOLE)
            self.store.delete_key(keys.JOB_WHOLE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m phoenixft.coordinator")
    ap.add_argument("--store", default="", help="connect to this store HOST:PORT (the launcher hosts it)")
    ap.add_argument("--host", default="127.0.0.1", help="host the store here when --store is not given")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", default="", help="where to write the port of the store it hosts")
    ap.add_argument("--journal", default="", help="write-ahead journal of membership, epochs and spare pool")
    ap.add_argument("--run-id", default="", help="the run's id (the run key of what it seals and checks; also makes "
                    "the process findable by it); default: the store's, if the job's config verifies with it")
    ap.add_argument("--lease-ttl", type=int, default=2, help="seconds of the leader's lease, on a control plane "
                    "with leases (a standby takes over at most this long after the leader's death)")
    ap.add_argument("--announce", default="", help="a line to print once this coordinator stands by (a "
                    "control plane with leases)")
    a = ap.parse_args(argv)
    # a job's SIGTERM is its launcher's to act on (a scheduler ending the job signals every process at once: the
    # launcher then has the job stop with its state saved, which this process carries out); the launcher ends this
    # process itself, and the kernel does when the launcher dies (a standby, `phoenixft coordinator --standby`, has no
    # launcher: SIGTERM ends it)
    if not a.announce:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    token = os.environ.get(auth.TOKEN_ENV, "")
    if not token:
        print(f"phoenixft coordinator: error: no job token in ${auth.TOKEN_ENV} (it signs what the coordinator "
              "publishes; the launcher passes one)", file=sys.stderr)
        return 2
    if a.store:
        from phoenixft.distributed.comm import connect_store

        store = connect_store(a.store)
    else:
        from phoenixft.controlplane.server import serve_store

        server = serve_store(a.host, a.port)
        store = server.as_store()
        if a.port_file:
            tmp = a.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(server.port))
            os.replace(tmp, a.port_file)
    election = Election(store, ttl_s=a.lease_ttl, on_lost=deposed) if store.has_leases else None
    gc.freeze()  # start-up's objects (torch's modules, ~250k) are never garbage: no collection walks them again
    coord: Coordinator | None = None
    rc = 0
    try:
        coord = Coordinator(store, a.journal or None, token, election, a.run_id)
        coord.run(a.announce)
    except TimeoutError as e:  # e.g. the job's config never appeared: this coordinator did not run the job
        print(f"phoenixft coordinator: error: {e}", file=sys.stderr, flush=True)
        rc = 1
    except WrongToken as e:
        print(f"phoenixft coordinator: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ControlPlaneLost as e:
        print(f"phoenixft coordinator: error: {e}", file=sys.stderr, flush=True)
        rc = 1
    if not a.store:  # keep serving the store until the launcher has read the results and stops us
        while True:
            time.sleep(3600)
    if coord is not None and coord.led and coord.job.final_state not in (None, "done", STOPPED):
        # the run this process led (or ended up leading) failed: say so to whoever started it
        print(f"phoenixft coordinator: the run ended {coord.job.final_state}", file=sys.stderr, flush=True)
        rc = 1
    return rc

