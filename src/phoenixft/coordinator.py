"""The coordinator: control plane, out of process.

It works on the control-plane store every process meets at (`phoenixft.controlplane`: torch's
TCPStore served by the launcher, or etcd) and owns membership,
failure detection on the node level (agent exits reported by the launcher, missed heartbeats),
recovery epochs and the spare pool. On a failure in epoch e (Algorithm 2 of the paper):

1. set the epoch's failure flag so every member stops at its next wait;
2. collect a *descriptor* from every surviving worker (which steps its ping-pong halves hold,
   which replicas it keeps) and decide which nodes are dead: reported exits, stale heartbeats,
   or workers that did not answer within `--failure-timeout` (those nodes are fenced);
3. pick the recovery step r: the newest step for which every logical shard still has a
   committed copy somewhere (its owner, or a verified replica);
4. acquire one spare per dead node, put it in the dead node's slot and publish topology e+1
   with the transfers (parameters from a healthy DP peer, optimizer shard from a replica
   holder, matched by logical shard id).

Its cost per poll does not grow with the number of workers W: while it waits for descriptors it
polls one counter that workers bump when they post (`desc_posted/<e>`), plus the launcher's exit
counter and the agents' restart counter; the descriptors are checked in one call when the counter
says they may be complete and fetched with one `multi_get`; heartbeats are read with one
`multi_get`; single keys are looked at only when something happened (an exit, a restart, a stale
node) or, after the deadline, to name the nodes that did not answer. `bench/control_plane.py`
measures it with up to 4,096 simulated workers.

Membership is the coordinator's alone: an agent is a member only once it has answered the
admission challenge with the job token (`phoenixft.auth.AdmissionDesk`); the coordinator names
its id (`n<i>` active slots first, then spares `s<k>`), keeps the spare pool in id order, and starts
the job when the `--nodes` active nodes have joined and are ready (`--join-timeout`). Every topology
it publishes is signed (`topo/<e>/sig`, written first). Heartbeats are judged on its own clock (when
it last saw a node's heartbeat change), never by comparing another host's clock with its own.

On etcd several coordinators may run (`--coordinators N`, `phoenixft coordinator --standby`): each
campaigns for `coordinator/leader` (`controlplane.Election`), only the leader acts, and every
topology it publishes goes out in one transaction with its journal record, guarded on it still
leading; a standby that wins reloads the journal from etcd and carries on (an epoch whose failure
flag is set but unanswered is recovered by it). A leader that cannot renew its lease exits.

Run as `python -m phoenixft.coordinator --store HOST:PORT|etcd://...` with the job token in
PHOENIXFT_TOKEN (the launcher and `phoenixft coordinator` do this).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from phoenixft import auth, keys
from phoenixft.config import RunConfig
from phoenixft.controlplane import (
    Election,
    EtcdUnavailable,
    exists_many,
    get_nowait,
    guarded_set,
    is_etcd,
    multi_get_nowait,
    poll_interval,
)
from phoenixft.persist import NOT_INSTALLED, latest_manifest, skipped_line, verified_manifest
from phoenixft.recovery.planner import Descriptor, Plan, PlanInput, plan_recovery
from phoenixft.topology import Topology

__all__ = ["Coordinator", "main"]

POLL_S = 0.025  # steady state: a flag-watch thread wakes the loop at once on a failure (see _watch_flags)
MAX_RECOVERIES_WITHOUT_PROGRESS = 12
HB_CHECK_S = 0.25  # heartbeats are read this often in steady state
HB_RECOVER_S = 0.05  # ... and this often while a recovery waits for descriptors
ADMIT_POLL_S = 0.025  # join requests are looked at this often (one counter read) while training
_ID = re.compile(r"^([ns])(\d+)$")
START_BEAT_GRACE_S = 15.0  # an active node admitted this long ago that never heartbeated died while starting
ALL_SILENT_WAIT_S = 15.0  # every node (and spare) silent at once: how much longer before they are judged dead
STANDBY_GIVE_UP_S = 60.0  # a standby whose etcd has had no quorum for this long stops (no job outlives that)


class ControlPlaneLost(RuntimeError):
    """etcd has not answered for too long: nothing this process could do would reach anyone."""


class WrongToken(RuntimeError):
    """This process's job token is not the job's: what it signed, no worker would accept."""


def _deposed() -> None:
    """This process no longer leads (its lease expired): another coordinator may act already."""
    print("phoenixft coordinator: lost the leadership (lease expired); exiting so the leader acts alone",
          file=sys.stderr, flush=True)
    os._exit(3)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


def _index(node: str) -> int:
    m = _ID.match(node)
    return int(m.group(2)) if m else 1 << 30


class Coordinator:
    def __init__(self, store: Any, journal: str | None = None, token: str = "",
                 election: Election | None = None) -> None:
        if not token:
            raise ValueError("the coordinator needs the job token (it signs what it publishes)")
        self.store = store
        self.journal = journal
        self.token = token
        self.election = election  # etcd: this process acts only while it leads
        self.poll_s = poll_interval(store, POLL_S)  # steady state (etcd: 150 ms, woken by a watch; a TCPStore: 3 ms)
        self._wake = threading.Event()
        self.gather_poll_s = min(self.poll_s, 0.01)  # while a recovery waits for descriptors
        raw_cfg = self._wait(keys.CONFIG, 120.0)
        if auth.token_matches_job(store, token) is False:
            raise WrongToken(f"${auth.TOKEN_ENV} is not this job's token: the job's config is not signed with it")
        self.cfg = RunConfig.from_json(raw_cfg)
        self.final_state: str | None = None  # the run's final state, once this process has seen it
        self.led = False  # this process acted as the job's coordinator (a standby: once it took over)
        self.run_id = self.store.get(keys.RUN_ID).decode() if self.store.check([keys.RUN_ID]) else ""
        self.g = self.cfg.workers_per_node
        self.desk = auth.AdmissionDesk(store, token)
        self.members: dict[str, dict[str, Any]] = {}  # admitted nodes: id -> {name, host, spare, t}
        self.spare_pool: list[str] = []  # admitted spares not used yet, in id order
        self._gone_spares: set[str] = set()  # spares of the pool whose agent exited or whose heartbeat is stale
        self.topo: Topology | None = None
        self.dead: set[str] = set()
        self._last_hb_check = 0.0
        self._stuck: list[int] = []  # progress seen at each recovery since a step last completed
        self._last_grow_check = 0.0
        self._exits_seen = 0
        self._exited_nodes: set[str] = set()  # nodes whose exit the launcher reported (exit keys stay)
        self._exit_checked: set[str] = set()  # nodes whose exit key was looked at since the counter moved
        self._restarts_seen = 0
        self._hb_seen: set[str] = set()  # nodes whose heartbeat key exists (it is never deleted)
        self._hb_last: dict[str, tuple[bytes, float]] = {}  # node -> (heartbeat value, when it was first seen)
        self._last_admit = 0.0
        self._load_members()  # (again once this process leads: a standby's view is old by then)

    def _load_members(self) -> None:
        for _, req, verdict in self.desk.admitted():  # a restarted coordinator or a new leader: admissions stand
            self._add_member(str(verdict["node"]), req, quiet=True)

    # ------------------------------------------------------------------ helpers
    def _wait(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator: no {key!r} after {timeout_s:.0f}s")
            time.sleep(0.01)
        return self.store.get(key)

    def _event(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "by": "coordinator", **fields}
        self.store.append(keys.EVENTS, json.dumps(rec) + "\n")

    def _wids(self, node: str) -> list[str]:
        return [f"{node}.{i}" for i in range(self.g)]

    def _ready(self, nodes: list[str]) -> bool:
        """Every worker of every one of `nodes` has announced itself (one store call)."""
        return self.store.check([keys.ready(w) for n in nodes for w in self._wids(n)])

    def _node_ready(self, node: str) -> bool:
        return self._ready([node])

    def _posted(self, e: int, nodes: list[str]) -> bool:
        """Every worker of every one of `nodes` has posted its descriptor of epoch e (one store call)."""
        return self.store.check([keys.desc(e, w) for n in nodes for w in self._wids(n)])

    def _exited(self, nodes: list[str]) -> set[str]:
        """Those of `nodes` whose exit the launcher reported. A node's exit key is looked at once per
        value of the launcher's `exits` counter (which it bumps after setting the key)."""
        exits = self.store.add("exits", 0)
        if exits != self._exits_seen:
            self._exits_seen = exits
            self._exit_checked.clear()
        elif self._exit_checked.issuperset(nodes):  # nothing moved: O(1) amortised per poll
            return self._exited_nodes.intersection(nodes)
        todo = [n for n in nodes if n not in self._exit_checked and n not in self._exited_nodes]
        self._exited_nodes |= {n for n in todo if self.store.check([keys.node_exit(n)])}
        self._exit_checked.update(nodes)
        return self._exited_nodes.intersection(nodes)

    def _restarts(self, nodes: list[str]) -> set[str]:
        """Those workers of `nodes` that their agent restarted in place (`wexit/<wid>`, deleted once a
        recovery has dealt with it). Single keys are looked at (and the worker ids listed) only when
        the agents' restart counter moved: a poll that finds it unchanged costs one store call."""
        n = self.store.add(keys.WORKER_EXITS, 0)
        if n == self._restarts_seen:
            return set()
        self._restarts_seen = n
        return {w for node in nodes for w in self._wids(node) if self.store.check([keys.worker_exit(w)])}

    def _stale(self, nodes: list[str], now: float) -> set[str]:
        """Those of `nodes` whose last heartbeat is older than the failure timeout: one `multi_get`
        of the heartbeat keys known to exist (a node not yet seen is looked for on its own). Old means
        unchanged, on this process's monotonic clock, for longer than the failure timeout."""
        new = [n for n in nodes if n not in self._hb_seen]
        if new and self.store.check([keys.heartbeat(n) for n in new]):
            self._hb_seen.update(new)
        elif new:
            self._hb_seen.update(n for n in new if self.store.check([keys.heartbeat(n)]))
        have = [n for n in nodes if n in self._hb_seen]
        if not have:
            return set()
        beats = multi_get_nowait(self.store, [keys.heartbeat(n) for n in have])
        seen = time.monotonic()  # judged on this clock: a heartbeat's value is another host's wall time
        gone = set()  # etcd: the key expired with its agent's lease (silent for --failure-timeout)
        for n, b in zip(have, beats, strict=True):
            if b is None:
                gone.add(n)
                continue
            last = self._hb_last.get(n)
            if last is None or last[0] != b:
                self._hb_last[n] = (bytes(b), seen)
        return gone | {n for n in have if n not in gone and seen - self._hb_last[n][1] > self.cfg.failure_timeout}

    def _verified(self, roots: str | list[str], exclude: dict[str, str] | None = None
                  ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The newest checkpoint under `roots` (a directory, or several) that verifies
        (persist.verified_manifest); each newer one skipped is said, in one line, as a `checkpoint_skipped`
        event."""
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
            self._event("checkpoint_skipped", **x,
                        using=man["step"] if man is not None else None, line=skipped_line(x))
        return man, skipped

    def _fail_run(self, why: str) -> None:
        self.store.set(keys.RUN_ERROR, why)
        self._event("run_failed", error=why)
        self.store.set(keys.RUN_STATE, "failed")
        self.final_state = "failed"

    def _over(self) -> bool:
        """The run has a final state (kept in `final_state`)."""
        v = get_nowait(self.store, keys.RUN_STATE)
        if v is not None:
            self.final_state = bytes(v).decode(errors="replace")
        return v is not None

    def publish(self, topo: Topology, replay: bool = False) -> None:
        """Journal first, then publish: a restarted coordinator (or the standby that takes over)
        finishes publishing whatever was decided, and never decides the same epoch twice. The
        journal record is a store key written with the topology (on etcd: in one transaction that
        succeeds only while this process leads); a local journal file, fsynced first, is kept too
        when given."""
        record = json.dumps({"topo": json.loads(topo.to_json()), "spare_pool": self.spare_pool,
                             "dead": sorted(self.dead)})
        if self.journal and not replay:
            with open(self.journal, "a") as f:
                f.write(record + "\n")
                f.flush()
                os.fsync(f.fileno())
        raw = topo.to_json()
        names = [keys.topo_sig(topo.epoch), keys.topo(topo.epoch), keys.EPOCH]  # the signature first
        values = [auth.sign_topology(self.token, topo.epoch, raw), raw, str(topo.epoch)]
        for s in topo.meta.get("promoted", []):
            names.append(keys.assign(s))
            values.append(str(topo.epoch))
        if not replay:
            names.insert(0, keys.JOURNAL)
            values.insert(0, record)
        if not guarded_set(self.store, self.election, names, values):
            _deposed()
        self.topo = topo
        if not replay:
            self._event("epoch", epoch=topo.epoch, nodes=topo.nodes, world=topo.world, resume_step=topo.resume_step)

    def _reload(self) -> bool:
        """Restore membership, epoch and spare pool from the journal; True if there was one."""
        last = None
        if self.store.check([keys.JOURNAL]):
            last = json.loads(self.store.get(keys.JOURNAL))
        elif self.journal and os.path.exists(self.journal):
            with open(self.journal) as f:
                for line in f:
                    if line.strip():
                        try:
                            last = json.loads(line)
                        except ValueError:
                            break  # a torn last line: the decision before it stands
        if last is None:
            return False
        self.dead = set(last["dead"])
        topo = Topology(**last["topo"])
        # the journal's pool, and spares admitted since (admissions are in the store, signed)
        pool = set(last["spare_pool"]) | {n for n, m in self.members.items() if m["spare"]}
        self.spare_pool = sorted((s for s in pool if s not in self.dead and s not in topo.nodes), key=_index)
        self.publish(topo, replay=True)
        return True

    # ------------------------------------------------------------------ main loop
    def _lead(self, announce: str = "") -> bool:
        """Stand by until this process leads (etcd); False if the run ended meanwhile. `announce` is
        printed once this process stands by (its token checked, the job's config loaded)."""
        if self.election is None:
            return True
        if announce:
            print(announce, flush=True)
        t0 = time.monotonic()
        try:
            was = self.election.leader()
        except (EtcdUnavailable, OSError):
            was = "(unknown: etcd did not answer)"
        while not self.election.campaign(timeout_s=2.0):
            if self._job_ended(serializable=True):
                return False
            if time.monotonic() - self.election.last_contact > STANDBY_GIVE_UP_S:
                raise ControlPlaneLost(f"no etcd quorum for {STANDBY_GIVE_UP_S:g}s at {self.store.url}: the job "
                                       "cannot go on without one; stopping")
        if self._job_ended(serializable=False):  # it ended meanwhile: never lead a job whose keys are gone
            self.election.resign()
            return False
        if was is not None:
            self._event("coordinator_takeover", previous=was, leader=self.election.ident,
                        standby_s=round(time.monotonic() - t0, 3))
        return True

    def _job_ended(self, serializable: bool) -> bool:
        """The run has a final state, or its keys are gone (it ended and its head removed them). A
        member that answers a serializable read may be behind (one just restarted): that the keys are
        gone is believed only from a linearizable read. etcd not answering: not ended (stand by on)."""
        try:
            over, there = self.store.exists_many([keys.RUN_STATE, keys.CONFIG], serializable=serializable)
            if not over and not there and serializable:
                over, there = self.store.exists_many([keys.RUN_STATE, keys.CONFIG])
            if over:
                self._over()
                print(f"phoenixft coordinator: the run ended ({self.final_state or '?'}); standing down", flush=True)
                return True
            if not there:
                print(f"phoenixft coordinator: the job's keys are gone from {self.store.url} (it ended); "
                      "standing down", file=sys.stderr, flush=True)
            return not there
        except (EtcdUnavailable, OSError):
            return False

    def run(self, announce: str = "") -> None:
        if not self._lead(announce):
            return
        self.led = True
        self._load_members()
        self.store.set(keys.COORDINATOR_PID, str(os.getpid()))
        if self._reload():
            assert self.topo is not None
            self._event("coordinator_restarted", epoch=self.topo.epoch, spare_pool=self.spare_pool,
                        **({"leader": self.election.ident} if self.election is not None else {}))
            self.store.set("coordinator/ready", str(time.time()))
            self._loop()
            return
        deadline = time.monotonic() + self.cfg.join_timeout
        swapped: dict[str, str] = {}  # an active node that died before the start -> the spare in its slot
        while True:
            self._admit(force=True)
            active = [swapped.get(n, n) for n in sorted((n for n in self.members if n.startswith("n")), key=_index)]
            if len(active) == self.cfg.nodes and self._ready(active):
                break
            if len(active) == self.cfg.nodes:
                self._replace_dead_before_start(active, swapped)
            if self._over():
                return
            if time.monotonic() > deadline:
                waiting = [n for n in active if not self._node_ready(n)]
                joined = ", ".join(self._label(n) for n in active) or "none"
                if len(active) < self.cfg.nodes:
                    self._fail_run(f"only {len(active)} of {self.cfg.nodes} node(s) joined within --join-timeout="
                                   f"{self.cfg.join_timeout:g}s (joined: {joined}"
                                   + (f"; not ready yet: {', '.join(waiting)}" if waiting else "") + ")")
                else:  # every slot filled: some node never got its workers ready (and no ready spare took its slot)
                    self._fail_run(f"all {self.cfg.nodes} node(s) joined, but {', '.join(waiting)} did not get its "
                                   f"workers ready within --join-timeout={self.cfg.join_timeout:g}s (its agent stopped "
                                   f"or died while starting, and no ready spare could take its slot; joined: {joined})")
                return
            time.sleep(0.005)
        self._event("run_start", nodes=active, spares=self.spare_pool)
        start, meta = 0, {}
        if self.cfg.resume:
            man, skipped = self._verified(self.cfg.resume)
            if man is None:
                why = (f"no checkpoint verifies (the newest, step {skipped[0]['step']}: {skipped[0]['file']} "
                       f"{skipped[0]['why']})" if skipped else "no complete checkpoint")
                self._fail_run(f"--resume {self.cfg.resume}: {why}")
                return
            start, meta = man["step"], {"restore": "persistent", "manifest": man}
        if swapped:
            meta = {**meta, "promoted": [s for s in active if s in swapped.values()]}  # (their workers wait for it)
        self.publish(Topology(epoch=0, nodes=active, workers_per_node=self.g, replicas=self.cfg.replicas,
                              racks=self.cfg.racks, resume_step=start, meta=meta, tp=self.cfg.tp, pp=self.cfg.pp))
        self.store.set("coordinator/ready", str(time.time()))
        self._loop()

    def _loop(self) -> None:
        last_whole = 0.0
        # poll slowly (every poll takes CPU from training on the same machines), but wake at once when
        # the epoch's failure flag is set
        threading.Thread(target=self._watch_flags, name="phoenixft-flag-watch", daemon=True).start()
        while True:
            assert self.topo is not None
            over, flagged = exists_many(self.store, [keys.RUN_STATE, keys.failflag(self.topo.epoch)])  # one request
            if over:
                self._over()
                break
            self._admit()
            if flagged or self._failure_pending():
                self.recover()
            else:
                self._wake.wait(self.poll_s)
                self._wake.clear()
            if time.monotonic() - last_whole > 0.25:
                last_whole = time.monotonic()
                self._publish_whole()

    def _replace_dead_before_start(self, active: list[str], swapped: dict[str, str]) -> None:
        """Before the start, every active slot filled: an active node that is not ready and is gone (its
        agent's exit reported, its heartbeat stale, or no heartbeat START_BEAT_GRACE_S after its
        admission: it died while starting) gets a ready spare in its slot, and is fenced. Without this,
        a host lost during the join held its slot until --join-timeout (600 s) failed the run, with a
        ready spare waiting."""
        now = time.monotonic()
        for n in active:
            if not n.startswith("n") or self._node_ready(n):
                continue
            pool = [s for s in self._ready_spares() if s not in swapped.values()]
            if not pool:
                return
            beat = self.store.check([keys.heartbeat(n)])
            silent = time.time() - float(self.members[n]["t"]) > max(self.cfg.failure_timeout, START_BEAT_GRACE_S)
            if not (self._exited([n]) or (beat and self._stale([n], now)) or (not beat and silent)):
                continue
            spare = pool[0]
            swapped[n] = spare
            self.dead.add(n)
            self.spare_pool.remove(spare)
            self.store.set(keys.fence(n), str(time.time()))
            self._event("replaced_before_start", node=n, spare=spare,
                        why="its agent exited" if n in self._exited_nodes else "no heartbeat")

    def _watch_flags(self) -> None:
        """Block on the current epoch's failure flag (own connection: an etcd watch, or a TCPStore's
        server-side wait) and wake the loop when it is set, so that the loop can poll slowly without
        noticing failures late. Every epoch ends by its flag being set, which frees this wait."""
        from datetime import timedelta

        from phoenixft.controlplane import connect

        if is_etcd(self.store):
            store, slice_s = connect(self.store.url, 30.0), 5.0
        else:  # a TCPStore; a timed-out wait logs a c10d warning: wait long
            store, slice_s = dist.TCPStore(self.store.host, self.store.port, is_master=False,
                                           timeout=timedelta(seconds=30)), 600.0
        while True:
            topo = self.topo
            if topo is None:
                time.sleep(0.05)
                continue
            try:
                store.wait([keys.failflag(topo.epoch)], timedelta(seconds=slice_s))
            except Exception:  # noqa: BLE001 - not set within the slice, or the cluster is briefly away
                continue
            self._wake.set()
            while self.topo is topo:  # until the recovery has published the next epoch
                time.sleep(0.02)

    def _recovery_loop(self, descs: dict[str, Descriptor]) -> str:
        """Why the run must stop ('' if not): it recovers again and again without completing a step (a fault
        the planner cannot route around keeps firing), and every recovery of the loop would be the same."""
        progress = int(self.store.get(keys.PROGRESS)) if self.store.check([keys.PROGRESS]) else 0
        self._stuck = [p for p in self._stuck if p == progress] + [progress]
        if len(self._stuck) <= MAX_RECOVERIES_WITHOUT_PROGRESS:
            return ""
        errors = sorted({d.error for d in descs.values()})[:3]
        return (f"{len(self._stuck)} recoveries in a row without completing a step (stuck after step "
                f"{progress}); the last errors: {'; '.join(errors)}")

    def _publish_whole(self) -> None:
        """`job/whole`: the job has its full size and, if it was given spares, at least one warm spare
        (what `,wait=S` faults wait for). A job run without spares (--spares 0, e.g. with --repair-after:
        a repaired node returns as a spare and is grown in at once) is whole at its full size."""
        assert self.topo is not None
        self._refresh_pool()
        whole = len(self.topo.nodes) == self.cfg.nodes and (self.cfg.spares == 0 or bool(self._ready_spares()))
        there = exists_many(self.store, [keys.JOB_WHOLE])[0]  # (a write only when it changes)
        if whole and not there:
            self.store.set(keys.JOB_WHOLE, "1")
        elif not whole and there:
            self.store.delete_key(keys.JOB_WHOLE)

    def _spare_coming(self, pool: list[str]) -> bool:
        """A spare is on its way: one admitted that is still starting (not ready yet: a fault in the
        run's first steps), or the spare of `--spare-arrives-at-step`, started once the run reached that
        step. It will be ready within its start-up."""
        if any(s not in pool and s not in self.dead and not self._node_ready(s) for s in self.spare_pool):
            return True
        late = self.cfg.spare_arrives_at_step
        if not late or not self.store.check([keys.PROGRESS]) or int(self.store.get(keys.PROGRESS)) < late:
            return False
        sid = f"s{self.cfg.spares}"  # the id the launcher starts it with
        return sid not in pool and sid not in self.dead and (self.topo is None or sid not in self.topo.nodes)

    def _ready_spares(self) -> list[str]:
        """The spares that can be promoted now: admitted, ready, and alive as far as the coordinator
        knows (a spare whose agent died while it waited is not handed a slot: it would answer nothing,
        and the recovery would wait out --failure-timeout to find that out)."""
        return [s for s in self.spare_pool if s not in self.dead and s not in self._gone_spares and self._node_ready(s)]

    def _refresh_pool(self) -> None:
        """Spares admitted since (`phoenixft agent --spare`, or a repaired node) are in the pool already."""
        self._admit()

    # ------------------------------------------------------------------ admission
    def _label(self, node: str) -> str:
        m = self.members.get(node, {})
        return f"{node} ({m.get('name')}@{m.get('host')})" if m.get("name") not in (None, node) else node

    def _add_member(self, node: str, req: dict[str, Any], quiet: bool = False) -> None:
        spare = node.startswith("s")
        self.members[node] = {"name": str(req.get("name", node)), "host": str(req.get("host", "")), "spare": spare,
                              "t": time.time()}
        if spare and node not in self.dead and not self._in_use(node) and node not in self.spare_pool:
            self.spare_pool.append(node)
            self.spare_pool.sort(key=_index)
        if not quiet:
            self.store.set(keys.MEMBERS, json.dumps(self.members, sort_keys=True))

    def _admission(self, req: dict[str, Any]) -> tuple[str | None, str, str]:
        """(node id or None, why not, a note for the agent) for a request whose token checked out."""
        name, spare = str(req.get("name", "")), bool(req.get("spare"))
        if req.get("workers") != self.g:
            return None, (f"--workers={req.get('workers')} does not match this job's --workers-per-node={self.g}"), ""
        if not auth.NAME_RE.match(name):
            return None, f"--node={name!r} is not a valid node name", ""
        started = self.topo is not None
        m = _ID.match(name)
        if m:  # asks for exactly this id
            if name in self.members:
                return None, (f"node id {name} is already taken in this job (ids are never reused; pick another "
                              "--node)"), ""
            if m.group(1) == "s":
                return name, "", ""
            if spare:
                return None, f"--node={name} names an active slot; a spare needs another name", ""
            if int(m.group(2)) >= self.cfg.nodes:
                return None, (f"node id {name} is not an active slot of this job (--nodes {self.cfg.nodes}: n0.."
                              f"n{self.cfg.nodes - 1}); join as a spare (--spare)"), ""
            if started:
                return None, f"the job has started: active slot {name} was filled; join as a spare (--spare)", ""
            return name, "", ""
        if not spare and not started:
            free = [f"n{i}" for i in range(self.cfg.nodes) if f"n{i}" not in self.members]
            if free:
                return free[0], "", ""
        k = 0
        while f"s{k}" in self.members:
            k += 1
        note = "" if spare else ("the job has started" if started else "every active slot is taken") + \
            f": joined as spare s{k}"
        return f"s{k}", "", note

    def _admit(self, force: bool = False) -> None:
        """Answer the join requests that arrived (one counter read when none did)."""
        now = time.monotonic()
        if not force and now - self._last_admit < ADMIT_POLL_S:
            return
        self._last_admit = now
        for app in self.desk.poll():
            req = app.request
            who = {"name": str(req.get("name", "?"))[:64], "host": str(req.get("host", "?"))[:64]}
            if app.proof == "none":
                why = (f"it presented no token (start the agent with this job's token: --token or "
                       f"{auth.TOKEN_ENV})")
                node, note = None, ""
            elif app.proof != "ok":
                why = ("wrong token: its answer to the join challenge does not verify with this job's token (an "
                       "agent of another job, or a mistyped token)")
                node, note = None, ""
            else:
                node, why, note = self._admission(req)
            self.desk.answer(app, node, self.run_id, reason=why, note=note)
            if node is None:
                self._event("join_refused", reason=why, **who)
                continue
            self._add_member(node, req)
            self._event("admitted", node=node, spare=node.startswith("s"), note=note, **who)

    def _in_use(self, node: str) -> bool:
        return self.topo is not None and node in self.topo.nodes

    def _failure_pending(self) -> bool:
        assert self.topo is not None
        now = time.time()
        if len(self.topo.nodes) < self.cfg.nodes and now - self._last_grow_check > 0.25:
            self._last_grow_check = now
            self._refresh_pool()
            if self._ready_spares():
                self._event("grow_requested", epoch=self.topo.epoch)
                return True  # recover() repartitions over the grown world at this step boundary
        if self._exited(self.topo.nodes):
            return True
        now = time.time()
        if now - self._last_hb_check > HB_CHECK_S:
            self._last_hb_check = now
            # idle spares are watched too (one multi_get with the nodes'): a dead one is never promoted
            spares = [s for s in self.spare_pool if s not in self.dead]
            stale = self._stale(self.topo.nodes + spares, now)
            self._gone_spares = (stale | self._exited(spares)) & set(spares)
            if stale - set(spares):
                return True
        return False

    # ------------------------------------------------------------------ recovery
    def _gather(self, e: int, nodes: list[str]) -> tuple[set[str], set[str], set[str]]:
        """Wait until every worker of every live node of epoch e has posted its descriptor; decide
        which nodes are dead on the way. Returns (dead, fenced, restarted).

        Dead: reported exits; nodes with a stale heartbeat whose workers have not answered within a
        short grace either (a stale heartbeat alone is not death: a starved agent); and, once the
        failure timeout has passed, every node that still has not answered (fenced). A worker that
        its agent restarts in place gets the full timeout again."""
        dead: set[str] = set()
        fenced: set[str] = set()
        restarted: set[str] = set()
        stale_since: dict[str, float] = {}
        grace = min(1.0, self.cfg.failure_timeout / 2)
        deadline = time.monotonic() + self.cfg.failure_timeout
        # every member and spare silent at once, nobody posting: this host is more likely cut off than all of
        # them dead, and fencing them all would end the run when its link comes back; wait that long more
        # (an agent stops its node after --control-plane-timeout, 15 s by default, without the store)
        silent_until = deadline + ALL_SILENT_WAIT_S
        said = silent = False
        last_hb, verified = 0.0, None
        while True:
            dead |= self._exited(nodes)
            live = [n for n in nodes if n not in dead]
            new = self._restarts(live) - restarted
            if new:
                restarted |= new  # its agent restarts it in place: give it the full timeout again
                deadline = time.monotonic() + self.cfg.failure_timeout
            # complete? the counter may overcount (a dead node's early post, a restarted worker's
            # second one), so a count that is high enough is verified on the keys, once per change
            posted = self.store.add(keys.desc_posted(e), 0)
            if posted >= len(live) * self.g and (posted, len(live)) != verified:
                verified = (posted, len(live))
                if self._posted(e, live):
                    break
            now = time.time()
            if now - last_hb >= HB_RECOVER_S:
                last_hb = now
                spares = [s for s in self.spare_pool if s not in self.dead]
                stale = self._stale(live + spares, now)
                was, silent = silent, (not dead and bool(live) and stale >= set(live + spares) and posted == 0
                                       and time.monotonic() < silent_until)
                if was and not silent:  # heard from again: reconnecting takes a while, give every node the full time
                    deadline = time.monotonic() + self.cfg.failure_timeout
                    grace = self.cfg.failure_timeout
                    stale_since.clear()
                if silent and not said:
                    said = True
                    self._event("all_silent", epoch=e, nodes=live, spares=spares,
                                wait_s=round(silent_until - time.monotonic(), 1))
                for n in stale & set(live) if not silent else ():
                    if not self._posted(e, [n]) and now - stale_since.setdefault(n, now) >= grace:
                        dead.add(n)
                        fenced.add(n)
            if silent and time.monotonic() > deadline:
                time.sleep(self.gather_poll_s)
                continue
            if time.monotonic() > deadline:
                unresponsive = {n for n in live if n not in dead and not self._posted(e, [n])}
                fenced |= unresponsive  # fence the whole node
                dead |= unresponsive
                break
            time.sleep(self.gather_poll_s)
        return dead, fenced, restarted

    def _progress(self) -> int:
        return int(self.store.get(keys.PROGRESS)) if self.store.check([keys.PROGRESS]) else 0

    def _fresh_start(self, old: Topology, dead: set[str], descs: dict[str, Descriptor], pool: list[str],
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

    def recover(self) -> None:
        assert self.topo is not None
        old = self.topo
        e = old.epoch
        t_start = time.time()
        self.store.set(keys.failflag(e), "1")
        self.store.delete_key(keys.JOB_WHOLE)  # not whole until published again
        dead, fenced, restarted = self._gather(e, old.nodes)
        with _gc_paused():
            self._decide(old, t_start, dead, fenced, restarted)

    def _recovery_failed(self, e: int, t_start: float, dead: set[str], fenced: set[str], restarted: set[str],
                         descs: dict[str, Descriptor], error: str) -> None:
        """The recovery of epoch e's failure ends the run: recorded (what it found, why) for the report,
        whose recoveries would otherwise end silently before the failure that ended the run."""
        self.store.set(keys.recovery_failed(e + 1), json.dumps({
            "epoch": e + 1, "failed_epoch": e, "t_start": t_start,
            "t_first_report": min([d.t for d in descs.values()] + [t_start]), "t_decided": time.time(),
            "dead": sorted(dead), "fenced": sorted(dead), "unresponsive": sorted(fenced),
            "restarted": sorted(restarted), "class": "permanent" if dead else "transient",
            "errors": sorted({d.error for d in descs.values()})[:5], "error": error,
            "max_committed": max([max(d.params) for d in descs.values() if d.params] + [self._progress()])}))

    def _decide(self, old: Topology, t_start: float, dead: set[str], fenced: set[str], restarted: set[str]) -> None:
        """The gather is done: fence the dead, fetch and parse the descriptors, plan, publish."""
        e = old.epoch
        for w in restarted:
            self.store.delete_key(keys.worker_exit(w))
        restarted = {w for w in restarted if w.split(".")[0] not in dead}
        for n in dead:
            self.store.set(keys.fence(n), str(time.time()))  # when: nothing of n may be written after it
        self.dead |= dead
        live = [w for n in old.nodes if n not in dead for w in self._wids(n)]
        raw = self.store.multi_get([keys.desc(e, w) for w in live]) if live else []
        descs = {w: Descriptor.from_json(json.loads(r)) for w, r in zip(live, raw, strict=True)}
        stuck = self._recovery_loop(descs)
        if stuck:
            self._recovery_failed(e, t_start, dead, fenced, restarted, descs, stuck)
            self._fail_run(stuck)
            return
        t_first = min([d.t for d in descs.values()] + [t_start])
        first = min(descs.values(), key=lambda d: d.t, default=None)
        self._event("failures_reported", epoch=e, reports=len(descs), first=first.wid if first else None,
                    t_first=t_first, errors=sorted({d.error[:300] for d in descs.values()})[:5])
        self._refresh_pool()
        pool = self._ready_spares()
        grow_only = (not dead and not restarted and len(old.nodes) < self.cfg.nodes
                     and not self.store.check([keys.failflag(e) + "/by-worker"]))
        # the persistent tier: --persist-dir's checkpoints, and the one --resume started from (until this
        # run has written a newer one, it is the newest state on disk: without it, losing a shard's every
        # copy before the first new checkpoint lost a run that had just been resumed)
        tiers = [t for t in dict.fromkeys((self.cfg.persist_dir, self.cfg.resume)) if t]
        exclude: dict[str, str] = {}
        refused = next((d.error for d in descs.values() if d.error.startswith(NOT_INSTALLED)), "")
        if refused and old.meta.get("restore") == "persistent":
            # the workers refused the checkpoint this epoch restored (it changed after it was verified):
            # never again, and the newest other one
            was = str(old.meta["manifest"]["path"])
            tiers = tiers or [os.path.dirname(was)]
            exclude[was] = f"was refused by the workers ({refused.split(': ', 1)[-1][:200]})"
        man = max((m for m in map(latest_manifest, tiers) if m is not None), key=lambda m: int(m["step"]),
                  default=None)
        verified: list[Any] = []  # [(manifest, skipped)] once the persistent tier was verified

        def decide() -> Any:
            nonlocal man

            def plan_with(m: dict[str, Any] | None) -> Any:
                try:
                    return plan_recovery(PlanInput(old=old, dead=dead, restarted=restarted, descs=descs, pool=pool,
                                                   target_nodes=self.cfg.nodes, replicas=self.cfg.replicas,
                                                   racks=self.cfg.racks, manifest=m, grow_only=grow_only))
                except Exception as ex:  # noqa: BLE001 - the planner is pure: a restarted coordinator would raise
                    # again, each time, until the launcher gave up on it; so the run fails in one line instead
                    traceback.print_exc(file=sys.stderr)  # (the coordinator's log: for the bug report)
                    return Plan(ok=False, error=f"the recovery planner failed ({type(ex).__name__}: {str(ex)[:200]}): "
                                                "a defect of phoenixft; please report it with the run directory")

            p = plan_with(man)
            if p.persistent_step is not None and not verified:
                # the plan falls back to the persistent tier: only to a checkpoint whose files verify (read
                # only now: a recovery from memory never waits for the disk)
                good, _ = self._verified(tiers, exclude)
                verified.append((good, _))
                if good is None or man is None or good["path"] != man["path"]:
                    man = good
                    p = plan_with(man)
            return p

        plan = decide()
        coming = self._spare_coming(pool)
        if not plan.ok and old.tp * old.pp > 1 and (self.cfg.repair_after > 0 or coming) and len(dead) > len(pool):
            # a mesh cannot drop a node: wait (bounded) for the repaired nodes to come back as spares, or
            # for the spare that is starting (--spare-arrives-at-step) to be ready
            self._event("waiting_for_spares", epoch=e, need=len(dead), ready=len(pool))
            deadline = time.monotonic() + self.cfg.mesh_spare_wait_s
            while len(pool) < len(dead) and time.monotonic() < deadline:
                time.sleep(0.1)
                self._refresh_pool()
                pool = self._ready_spares()
            plan = decide()
        if not plan.ok:
            plan = self._fresh_start(old, dead, descs, pool, progress=self._progress()) or plan
        if not plan.ok or plan.topo is None:
            error = plan.error
            skipped = verified[0][1] if verified else []
            if skipped:  # every complete checkpoint was skipped: say why the newest one was
                why = f"(the newest, step {skipped[0]['step']}: {skipped[0]['file']} {skipped[0]['why']})"
                error = (f"{refused}; no other persistent checkpoint verifies {why}" if refused and exclude else
                         f"{error} that verifies {why}")
            self._recovery_failed(e, t_start, dead, fenced, restarted, descs, error)
            self._fail_run(f"{error} (epoch {e})")
            return
        topo = plan.topo
        for s in plan.promoted:
            self.spare_pool.remove(s)
        if plan.dropped:
            self._event("shrink", epoch=e, dropped=plan.dropped, world=topo.world)
        elif plan.action == "grow":
            self._event("grow", epoch=e, added=plan.promoted, world=topo.world)
        if plan.persistent_step is not None:
            self._event("fallback_persistent", epoch=e, reason=topo.meta["reason"], step=plan.persistent_step,
                        path=topo.meta["manifest"]["path"])
        max_committed = max((max(d.params) for d in descs.values() if d.params), default=plan.resume_step)
        progress = self._progress()
        self._event("classified", epoch=e, dead=sorted(dead), fenced=sorted(fenced), restarted=sorted(restarted),
                    **{"class": plan.klass}, action=plan.action)
        t_decided = time.time()
        rec: dict[str, Any] = {"epoch": e + 1, "failed_epoch": e, "t_start": t_start, "t_first_report": t_first,
               "t_decided": t_decided, "dead": sorted(dead), "fenced": sorted(dead), "unresponsive": sorted(fenced),
               "promoted": plan.promoted,
               "resume_step": plan.resume_step, "max_committed": max(max_committed, progress), "class": plan.klass,
               "action": plan.action, "restarted": sorted(restarted), "dropped": plan.dropped, "world": topo.world,
               "errors": sorted({d.error for d in descs.values()})[:5],
               "replicas_rejected": [list(x) for x in plan.rejected],
               "bad_sources": sorted({x for d in descs.values() for x in d.bad_sources}),
               "persistent_step": plan.persistent_step}
        self.store.set(keys.recovery(e + 1), json.dumps(rec))
        self.publish(topo)
        self._event("recovery_planned", epoch=e + 1, resume_step=plan.resume_step, promoted=plan.promoted,
                    decide_s=t_decided - t_start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m phoenixft.coordinator")
    ap.add_argument("--store", default="", help="connect to this store HOST:PORT (the launcher hosts it)")
    ap.add_argument("--host", default="127.0.0.1", help="host the store here when --store is not given")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", default="", help="where to write the port of the store it hosts")
    ap.add_argument("--journal", default="", help="write-ahead journal of membership, epochs and spare pool")
    ap.add_argument("--run-id", default="", help="the run's id (unused here; makes the process findable by it)")
    ap.add_argument("--lease-ttl", type=int, default=2, help="etcd: seconds of the leader's lease (a standby takes "
                    "over at most this long after the leader's death)")
    ap.add_argument("--announce", default="", help="a line to print once this coordinator stands by (etcd)")
    a = ap.parse_args(argv)
    token = os.environ.get(auth.TOKEN_ENV, "")
    if not token:
        print(f"phoenixft coordinator: error: no job token in ${auth.TOKEN_ENV} (it signs what the coordinator "
              "publishes; the launcher passes one)", file=sys.stderr)
        return 2
    if a.store:
        from phoenixft.comm import connect_store

        store = connect_store(a.store)
    else:
        from phoenixft.store_server import serve_store

        server = serve_store(a.host, a.port)
        store = server.store
        if a.port_file:
            tmp = a.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(server.port))
            os.replace(tmp, a.port_file)
    election = Election(store, ttl_s=a.lease_ttl, on_lost=_deposed) if is_etcd(store) else None
    gc.freeze()  # start-up's objects (torch's modules, ~250k) are never garbage: no collection walks them again
    coord: Coordinator | None = None
    rc = 0
    try:
        coord = Coordinator(store, a.journal or None, token, election)
        coord.run(a.announce)
    except TimeoutError as e:
        print(str(e), file=sys.stderr)
    except WrongToken as e:
        print(f"phoenixft coordinator: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ControlPlaneLost as e:
        print(f"phoenixft coordinator: error: {e}", file=sys.stderr, flush=True)
        rc = 1
    if not a.store:  # keep serving the store until the launcher has read the results and stops us
        while True:
            time.sleep(3600)
    if coord is not None and coord.led and coord.final_state not in (None, "done"):
        # the run this process led (or ended up leading) failed: say so to whoever started it
        print(f"phoenixft coordinator: the run ended {coord.final_state}", file=sys.stderr, flush=True)
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
