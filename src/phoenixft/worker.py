"""A training worker: one per accelerator (CPU + gloo here).

Life of a worker: connect to the control-plane store, build the workload and its `Trainer`
(flat parameters, optimizer shard, optimizer), announce itself, then wait for membership (an
active node gets epoch 0; a spare waits, warm, until the coordinator promotes it). Each step the
trainer computes (training.py) while the protection layer replicates the previous step
(replication.py) and, every K steps, persists it (persist.py). Any `PeerFailure` sends the worker
into the recovery protocol: it posts a descriptor of what it holds (recovery/planner.py), waits
for the next epoch's plan, and carries it out (recovery/restore.py); training resumes at the
recovery step. Run as `python -m phoenixft.worker` by the node agent (or forked by it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from phoenixft import keys, shm
from phoenixft.comm import EpochComm, connect_store, wait_work
from phoenixft.config import RunConfig
from phoenixft.errors import PeerFailure, RunAborted, Unhealable
from phoenixft.faults import FaultSpec
from phoenixft.invariants import check_invariants
from phoenixft.persist import Persister
from phoenixft.recovery import restore
from phoenixft.recovery.planner import Descriptor
from phoenixft.redundancy.parity import ParityHolding, parity_name
from phoenixft.redundancy.plan import ec_plan
from phoenixft.redundancy.protect import ErasureProtector
from phoenixft.replication import ReplicaPlan, Replicator
from phoenixft.snapshot import INVALID, Holding
from phoenixft.topology import Topology, shard_name
from phoenixft.training import Trainer
from phoenixft.watcher import FailureWatcher
from phoenixft.workload import WorkloadContext, load_workload

__all__ = ["Worker", "worker_main"]


class Worker:
    def __init__(self, store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                 incarnation: int = 0) -> None:
        self.node_id, self.local_rank, self.run_id = node_id, local_rank, run_id
        self.incarnation = incarnation
        self.wid = f"{node_id}.{local_rank}"
        self.store: Any = connect_store(store_addr)
        self.cfg = RunConfig.from_json(self.store.get(keys.CONFIG).decode())
        cfg = self.cfg
        torch.set_num_threads(threads)
        self.wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
        torch.manual_seed(cfg.seed)
        self.trainer = Trainer(cfg, self.wl, self.wl.build_model())
        self.protect = cfg.protect == "phoenix"
        world, gen = cfg.world, 0
        if incarnation > 0:  # restarted in place: the partition is the current epoch's, not the initial one
            cur = Topology.from_json(self.store.get(keys.topo(int(self.store.get(keys.EPOCH)))))
            world, gen = cur.world, int(cur.meta.get("generation", 0))
        self.shm: str | None = None
        self._partition(world, gen)
        self.faults: list[FaultSpec] = cfg.faults
        self.repl: Replicator | None = None
        if self.protect:
            self.repl = Replicator(
                self.trainer.state,
                holding_factory=lambda s: Holding(self.trainer.flat.shard_numel, self.shm and f"{self.shm}-hold{s}",
                                                  rows=self.trainer.payload_rows),
                chunk_numel=int(cfg.chunk_mb * (1 << 20) / 4),
                abort_check=self._flag_check_factory(store_addr),
                timeout_s=self._coll_timeout,
                on_in_flight=lambda s: self._fault(s + 1, "replicate"),
                after_commit=self._after_replication,
            )
        if self.repl is not None and incarnation > 0:  # adopt the replicas retained in shared memory
            for f in shm.SHM_DIR.glob(shm.holding_glob(run_id, self.wid, gen)):
                shard = int(f.name.rsplit("-hold", 1)[1].split(".")[0])
                self.repl.holding(shard)
        # --redundancy ec:D+H: parity blocks instead of replicas (phoenixft.redundancy)
        self.redundancy = cfg.scheme
        self.ec: ErasureProtector | None = None
        if self.repl is not None and self.redundancy.is_ec:
            self.ec = ErasureProtector(lambda gid, numel, dmax: ParityHolding(
                numel, dmax, self.shm and f"{self.shm}-par{gid}"))
            if incarnation > 0:  # adopt the parity retained in shared memory
                self.ec.adopt(shm.SHM_DIR.glob(shm.parity_glob(run_id, self.wid, gen)))
        pstore = connect_store(store_addr) if cfg.persist_every and self.protect else None
        self.persister = Persister(cfg.persist_dir, cfg.persist_every, pstore,
                                   fenced=lambda: bool(pstore.check([keys.fence(node_id)]))) if pstore else None
        self.watcher = FailureWatcher(store_addr)
        self.trainer.watch(self.watcher.check)
        self.comm: EpochComm | None = None
        self.topo: Topology | None = None
        self.epoch = -1
        self.rank = -1
        self._first_after_join: int | None = None
        self.bad_sources: list[tuple[str, int, str]] = []  # (shard, step, wid) whose transfer failed I3

    def _partition(self, world: int, gen: int, step: int = 0) -> None:
        """Flat parameters and the own optimizer shard for a `world`-way partition (generation `gen`)."""
        self.shm = shm.worker_base(self.run_id, self.wid, gen) if self.protect else None
        self.trainer.partition(world, self.shm, step)

    def repartition(self, world: int, gen: int, r: int) -> None:
        """Cut the flat state anew for a `world`-way partition (shrink, grow, persistent reload)."""
        old_shm = self.shm
        self._partition(world, gen, step=r)
        if self.repl is not None:
            self.repl.state = self.trainer.state
            self.repl.holdings = {}
        if self.ec is not None:
            self.ec.parity = {}
        if old_shm and old_shm != self.shm:  # the old generation's segments are never used again
            for f in shm.SHM_DIR.glob(Path(old_shm).name + "-*"):
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ helpers
    @property
    def _coll_timeout(self) -> float:
        return max(60.0, 6 * self.cfg.failure_timeout)

    def _flag_check_factory(self, store_addr: str) -> Any:
        store = connect_store(store_addr)  # the replication thread's own client

        def check() -> str | None:
            return "recovery requested" if store.check([keys.failflag(self.epoch)]) else None

        return check

    def _abort_reason(self) -> str | None:
        if self.store.check([keys.failflag(self.epoch)]):
            return "recovery requested by the control plane"
        if self.store.check([keys.RUN_STATE]):
            raise RunAborted(f"run ended ({self.store.get(keys.RUN_STATE).decode()})")
        return None

    def wait(self, work: Any, what: str) -> None:
        wait_work(work, what, self._abort_reason, self._coll_timeout)

    def _event(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "wid": self.wid, **fields}
        self.store.append(keys.EVENTS, json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ fault injection
    def _fault(self, step: int, phase: str) -> None:
        if self.topo is None:
            return
        slot = self.topo.slot_of(self.node_id)
        for f in self.faults:
            if (f.kind == "corrupt" and f.wait and f.phase != "transfer" and f.step == step + 1
                    and phase == "forward" and self.rank == 0):
                # a gated corruption at rest hits the replication of this step: hold this step instead
                if not self.store.check([keys.fault(f.index) + "/fired"]):
                    self._wait_whole(f)
                continue
            if f.step != step or f.phase != phase or f.kind not in ("kill", "hang", "crash"):
                continue
            if f.coordinator:
                hit = self.rank == 0
            elif f.kind == "crash":
                hit = self.rank == f.rank
            elif f.rack is not None:
                hit = self.topo.rack_of(slot) == f.rack
            else:
                hit = slot in f.nodes
            # `,wait=S`: rank 0 holds the step too (the target may be a slot the job lost, back after the
            # grow this waits for); a fault that already fired holds nothing when its step is replayed
            if f.wait and (hit or self.rank == 0) and not self.store.check([keys.fault(f.index) + "/fired"]):
                self._wait_whole(f)
            if hit:
                self._fire(f, step=step, phase=phase)

    def _fire(self, f: FaultSpec, **where: Any) -> None:
        """Claim fault f for this node (once per run), record it, then act with a real signal."""
        assert self.topo is not None
        slot = self.topo.slot_of(self.node_id)
        if self.store.add(keys.fault_claim(f.index, slot), 1) != 1:
            return
        self._together(f)
        rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": f.kind,
               "node": self.node_id, "slot": slot, "rank": self.rank, "epoch": self.epoch, **where}
        if self.store.add(keys.fault(f.index) + "/fired", 1) == 1:
            self.store.set(keys.fault(f.index), json.dumps(rec))
        self.store.append(keys.EVENTS, json.dumps(rec) + "\n")
        if f.coordinator:
            self._kill_coordinator()
        elif f.kind == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif f.kind == "hang":
            os.killpg(os.getpgid(0), signal.SIGSTOP)
        elif f.kind == "crash":
            os._exit(17)

    def _together(self, f: FaultSpec, timeout_s: float = 10.0) -> None:
        """A fault on several nodes (`node=I,J`, `rack=A`) strikes them in the same instant: the first
        to arrive waits (bounded) for the others, which are in the same step, before any dies, so no
        survivor notices the first death and leaves the step before the others are hit."""
        assert self.topo is not None
        n = len(self.topo.nodes)
        if f.rack is not None:
            targets = [s for s in range(n) if self.topo.rack_of(s) == f.rack]
        else:
            targets = [s for s in f.nodes if s < n]
        if len(targets) < 2:
            return
        key = keys.fault(f.index) + "/together"
        arrived = self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while arrived < len(targets) and time.monotonic() < deadline:
            time.sleep(0.002)
            arrived = self.store.add(key, 0)

    def _wait_whole(self, f: FaultSpec) -> None:
        """`,wait=S`: hold this step (the peers wait at their next collective) until the job is whole."""
        deadline = time.monotonic() + f.wait
        while not self.store.check([keys.JOB_WHOLE]) and time.monotonic() < deadline:
            self.watcher.check()  # a recovery (the grow this waits for) takes the step over
            time.sleep(0.05)

    def _kill_coordinator(self, timeout_s: float = 60.0) -> None:
        """SIGKILL the coordinator that runs now: one restarted after an earlier kill may still be
        starting (it publishes its pid when it is up), so wait for a live pid, bounded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.check([keys.COORDINATOR_PID]):  # the launcher clears it when a coordinator exits
                    os.kill(int(self.store.get(keys.COORDINATOR_PID)), signal.SIGKILL)
                    return
            except ProcessLookupError:
                pass
            time.sleep(0.05)

    def recovery_faults(self, topo: Topology) -> None:
        """kill:node=I@recovery=N and kill:...,phase=recovery fire here, mid state transfer."""
        slot = topo.slot_of(self.node_id)
        for f in self.faults:
            if f.kind != "kill" or slot not in f.nodes:
                continue
            if f.recovery == topo.epoch or (f.phase == "recovery" and f.step is not None
                                            and topo.resume_step >= f.step - 1):
                self._fire(f, recovery=topo.epoch)

    def corrupts_transfers(self, topo: Topology) -> bool:
        slot = topo.slot_of(self.node_id)
        return any(f.kind == "corrupt" and f.phase == "transfer" and slot in f.nodes and f.step is not None
                   and topo.resume_step >= f.step - 1 for f in self.faults)

    def _nan_fault(self, step: int) -> bool:
        return self.rank == 0 and any(f.kind == "nan" and f.step == step for f in self.faults)

    def _after_replication(self, step: int, received: dict[int, Holding]) -> None:
        """Runs on the replication thread once step's replicas committed; the committed half of
        `step` cannot change before this returns, so the persistent tier stages it here."""
        if self.topo is None:
            return
        tr = self.trainer
        if self.persister is not None and self.persister.due(step):
            half = tr.state.half_with(step)
            if half is not None:
                self.persister.stage(step, tr.state.data[half], {
                    "rank": self.rank, "shards": self.topo.world, "numel": tr.flat.numel,
                    "shard_numel": tr.flat.shard_numel, "epoch": self.epoch, "seed": self.cfg.seed,
                    "buffer_bytes": tr.flat.buffer_bytes, "config": json.loads(self.cfg.to_json())},
                    buffers=tr.flat.buffers_at(step) if self.rank == 0 else None)
        self._maybe_corrupt(step, received)

    def _maybe_corrupt(self, step: int, received: dict[int, Holding]) -> None:
        if self.topo is None:
            return
        for f in self.faults:
            if (f.kind == "corrupt" and f.phase != "transfer" and f.step == step + 1
                    and f.node == self.topo.slot_of(self.node_id)):
                for shard, h in received.items():
                    half = h.half_with(step)
                    if half is not None:
                        h.data[half].view(-1)[:: max(1, h.numel // 7)] += 1.0  # crc now mismatches
                        self._event("corrupted_replica", shard=shard, step=step, spec=f.text)
                        self.store.add(keys.fault(f.index) + "/fired", 1)

    # ------------------------------------------------------------------ training
    def train_step(self, s: int) -> None:
        assert self.comm is not None and self.topo is not None
        t0 = time.perf_counter()
        repl = self.repl
        res = self.trainer.step(
            s, self.comm.train, self.rank, self.topo.world,
            self.topo.microbatches(self.rank, self.cfg.total_microbatches),
            self.wait, before_reduce=lambda: repl.wait(s - 1) if repl is not None else 0.0,
            fault=lambda phase: self._fault(s, phase), nan=self._nan_fault(s))
        if repl is not None:
            repl.start(s)
        if self.rank == 0:
            now = time.time()
            rec = {"step": s, "loss": res.loss, "lr": res.lr, "dt": time.perf_counter() - t0, "t_end": now,
                   "epoch": self.epoch, "world": self.topo.world, "compute_s": res.compute_s,
                   "repl_wait_s": res.repl_wait_s}
            if repl is not None:  # the protection work of the previous step's replication, on this rank
                rec.update(protect_bytes=repl.stats.last_bytes, protect_s=repl.stats.last_job_s,
                           protect_cpu_s=repl.stats.last_cpu_s)
            if res.grad_norm is not None:
                rec["grad_norm"] = res.grad_norm
            if res.val_loss is not None:
                rec["val_loss"] = res.val_loss
            names, values = [keys.step(s), keys.PROGRESS], [json.dumps(rec), str(s)]
            if self._first_after_join is not None:
                names.append(keys.first_step(self._first_after_join))
                values.append(json.dumps({"t": now, "step": s}))
                self._first_after_join = None
            self._check_fence()  # a rank 0 resumed after its fence must not write a stale record
            self.store.multi_set(names, values)

    def finish(self) -> None:
        """Hash the full state in logical order; rank 0 writes it to the run directory and says done."""
        assert self.comm is not None and self.topo is not None
        if self.repl is not None:
            self.repl.wait(self.cfg.steps)  # the final state is protected (and persisted) like any other
        sha, master = self.trainer.final_state(self.comm.train, self.cfg.steps, self.wait)
        if self.rank == 0:
            self._check_fence()
            from phoenixft.export import write_final

            run_dir = self.store.get(keys.RUN_DIR).decode() if self.store.check([keys.RUN_DIR]) else ""
            path = write_final(run_dir, self.trainer, master, self.cfg, sha) if run_dir else ""
            self.store.set(keys.FINAL, json.dumps({"sha256": sha, "step": self.cfg.steps, "epoch": self.epoch,
                                                   "path": path}))
            self.store.set(keys.RUN_STATE, "done")
            return
        deadline = time.monotonic() + self._coll_timeout
        while time.monotonic() < deadline:
            if self.store.check([keys.RUN_STATE]):
                return
            if self._abort_reason():
                raise PeerFailure("failure during the final gather")
            time.sleep(0.02)
        raise PeerFailure("rank 0 did not publish the final state")

    # ------------------------------------------------------------------ membership and recovery
    def _wait_key(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.store.check([key]):
                return self.store.get(key)
            if self.store.check([keys.RUN_STATE]):
                raise RunAborted(f"run ended ({self.store.get(keys.RUN_STATE).decode()})")
            if time.monotonic() > deadline:
                raise RunAborted(f"no answer from the control plane for {key!r} after {timeout_s:.0f}s")
            time.sleep(0.005)

    def await_membership(self) -> Topology:
        if self.node_id.startswith("s"):  # spare: wait, warm, to be promoted
            e = int(self._wait_key(keys.assign(self.node_id), 10 * 24 * 3600.0))
        else:
            e = 0
        return Topology.from_json(self._wait_key(keys.topo(e), 600.0))

    def _check_fence(self) -> None:
        """A fenced node (declared dead while it was stopped or cut off) must never write again."""
        if self.store.check([keys.fence(self.node_id)]):
            raise RunAborted(f"{self.node_id} was fenced: it is not a member any more and writes nothing")

    def _descriptor(self, err: str, t_err: float) -> Descriptor:
        """What this worker holds, for the planner: parameter steps, own shard and replicas with checksums."""
        tr = self.trainer
        d = Descriptor(wid=self.wid, t=t_err, error=err[:300], bad_sources=list(self.bad_sources))
        d.params = tr.steps_held()
        for x in (0, 1):
            st = tr.state.step_of(x)
            idx, count = tr.state.shard_of(x)
            if st != INVALID and count > 0:
                d.own.setdefault(shard_name(idx, count), {})[st] = tr.state.known_crc(x)
        if self.repl is not None:
            for shard, h in self.repl.holdings.items():
                for x in (0, 1):
                    st = h.step_of(x)
                    if st == INVALID:
                        continue
                    idx, count = h.shard_of(x)
                    name = shard_name(idx if count else shard, count or tr.flat.shards)
                    if h.verify(x):
                        d.holdings.setdefault(name, {})[st] = h.crc_of(x)
                    else:
                        d.rejected.append((name, st))
        if self.ec is not None:
            for gid, ph in self.ec.parity.items():
                for x in (0, 1):
                    st = ph.step_of(x)
                    if st == INVALID:
                        continue
                    info = ph.info_of(x)
                    members = [shard_name(i, info.world) for i in info.members]
                    name = parity_name(members, info.j)
                    if ph.verify(x):
                        d.parity.setdefault(name, {})[st] = {"crc": ph.crc_of(x), "j": info.j, "h": info.h, "gid": gid,
                                                             "members": members, "mcrc": list(info.mcrc)}
                    else:
                        d.rejected.append((name, st))
        return d

    def recover(self, err: str) -> int:
        e = self.epoch
        t_err = time.time()
        self.watcher.disarm()
        self._check_fence()
        self.store.set(keys.failflag(e), "1")
        if "requested by the control plane" not in err:
            self.store.set(keys.failflag(e) + "/by-worker", "1")
        self._event("failure_detected", epoch=e, error=err[:300], rank=self.rank)
        if self.repl is not None:
            self.repl.abort()
        if self.comm is not None:
            self.comm.retire()
        desc = self._descriptor(err, t_err)
        self.store.set(keys.desc(e, self.wid), json.dumps(desc.to_json()))
        self.store.add(keys.desc_posted(e), 1)  # the coordinator polls this one counter, not every key
        topo = Topology.from_json(self._wait_key(keys.topo(e + 1), 3 * self.cfg.failure_timeout + 60.0))
        self._check_fence()
        if self.node_id not in topo.nodes:
            raise RunAborted(f"{self.node_id} is not a member of epoch {topo.epoch}: fenced")
        return self.join(topo)

    def _recover_until_joined(self, err: str) -> int:
        """A failure during a recovery (cascading) restarts the recovery in the next epoch."""
        while True:
            try:
                return self.recover(err)
            except PeerFailure as e:
                err = str(e)

    def join(self, topo: Topology) -> int:
        t0 = time.time()
        old_rank = self.rank
        tr = self.trainer
        self.topo, self.epoch = topo, topo.epoch
        self.rank = topo.rank_of(self.node_id, self.local_rank)
        self.comm = EpochComm(self.store, topo.epoch, self.rank, topo.world, self._coll_timeout)
        t_pg = time.time()
        r = topo.resume_step
        timings: dict[str, Any] = {"reconfigure_s": t_pg - t0}
        bad: list[str] = []  # I3: what failed verification on this rank
        if "reshard" not in topo.meta and tr.flat.shards != topo.world:
            # a spare built for the initial world, promoted into a resized one: it holds nothing yet
            self.repartition(topo.world, int(topo.meta.get("generation", 0)), r)
        if "reshard" in topo.meta:
            restore.reshard(self, topo, r, old_rank, timings, bad)
        elif topo.meta.get("restore") == "persistent":
            restore.restore_persistent(self, topo, r, timings, bad)
        elif topo.epoch == 0:
            tr.init_shard(self.rank, topo.world)
        else:
            restore.restore_in_place(self, topo, r, timings, bad)
        if self.repl is not None:
            ecp = ec_plan(topo, self.rank, self.redundancy) if self.ec is not None else None
            if self.ec is not None:
                self.ec.plan = ecp
                for ph in self.ec.parity.values():
                    ph.invalidate_after(r)
            self.repl.configure(self.comm, ReplicaPlan(shard=self.rank, send_to=topo.holders(self.rank),
                                                       recv_from=[(x, x) for x in topo.sources(self.rank)]),
                                self.ec if ecp is not None else None)
            for h in self.repl.holdings.values():
                h.invalidate_after(r)
        half = tr.state.half_with(r)
        held = tr.state.shard_of(half) if half is not None else (-1, 0)
        inv, detail = check_invariants(self.comm.train, topo, self.rank, r, tr.flat.step, tr.state.steps(), held,
                               not bad, self.wait)
        timings["join_s"] = time.time() - t0
        self.store.set(keys.join(topo.epoch, self.wid), json.dumps({"t": time.time(), "rank": self.rank,
                                                                     "invariants": inv, "i3_failures": bad,
                                                                     **timings}))
        if not inv["I3"]:
            # a copy failed verification: recover again without that source (or stop, if none is left)
            raise PeerFailure(f"invariant I3 failed after recovery to epoch {topo.epoch}: "
                              f"{'; '.join(bad) or 'on another rank'}")
        if not all(inv.values()):
            bad_inv = ", ".join(k for k, v in inv.items() if not v)
            why = f"invariant {bad_inv} failed after recovery to epoch {topo.epoch} to step {r} ({detail})"
            self._stop_run(why, ours=True)
            raise RunAborted(why)
        self.bad_sources = []
        self.watcher.arm(topo.epoch)
        if self.repl is not None:
            self.repl.start(r)
        if topo.epoch > 0:
            self._first_after_join = topo.epoch
        return r

    # ------------------------------------------------------------------ main loop
    def _stop_run(self, why: str, ours: bool = False) -> None:
        """Stop the whole run at the last committed step, with one clear reason: a fault that is not
        ours to heal, or (`ours`) a broken recovery guarantee that must never be trained past."""
        if self.store.add("run/stop_claim", 1) == 1:
            last = max(self.trainer.state.steps(), default=0)
            msg = (f"{why}; the run stops rather than train on a state it cannot vouch for" if ours
                   else f"{why}; not ours to heal, stopped at the last committed step {last}")
            self.store.set(keys.RUN_ERROR, msg)
            self._event("run_failed", error=why, last_committed=last)
            self.store.set(keys.RUN_STATE, "failed")

    def run(self) -> int:
        self.store.set(keys.ready(self.wid), str(time.time()))
        try:
            if self.incarnation > 0:  # restarted in place by the agent: rejoin from retained memory
                e = int(self.store.get(keys.EPOCH))
                self.topo = Topology.from_json(self.store.get(keys.topo(e)))
                self.epoch, self.rank = e, self.topo.rank_of(self.node_id, self.local_rank)
                step = self.recover(f"restarted in place (incarnation {self.incarnation})") + 1
            else:
                try:
                    step = self.join(self.await_membership()) + 1
                except PeerFailure as e:
                    step = self._recover_until_joined(str(e)) + 1
            while True:
                try:
                    while step <= self.cfg.steps:
                        self.train_step(step)
                        step += 1
                    self.finish()
                    return 0
                except PeerFailure as e:
                    step = self._recover_until_joined(str(e)) + 1
        except Unhealable as e:
            self._stop_run(str(e))
            print(f"phoenixft worker {self.wid}: {e}", flush=True)
            return 4
        except RunAborted as e:
            if "done" in str(e):
                return 0
            print(f"phoenixft worker {self.wid}: {e}", flush=True)
            return 3
        finally:
            self.watcher.close()
            if self.repl is not None:
                self.repl.close()
            if self.persister is not None:
                self.persister.close()


def worker_main(store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                incarnation: int = 0) -> int:
    return Worker(store_addr, node_id, local_rank, run_id, threads, incarnation).run()
