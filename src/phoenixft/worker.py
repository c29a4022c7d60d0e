"""A training worker: one per accelerator (CPU + gloo here).

Life of a worker: connect to the control-plane store, build the workload and its flat
parameters, announce itself, then wait for membership (an active node gets epoch 0; a spare
waits, warm, until the coordinator promotes it). Each step it trains, waits for the replication
of the previous step, reduce-scatters gradients, runs AdamW on its shard into the staging half,
all-gathers parameters and commits. Any `PeerFailure` sends it into the recovery protocol
(`recover` -> coordinator plan -> `join` of the next epoch) and training resumes at the last
completed step. Run as `python -m phoenixft.worker` by the node agent (or forked by it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from phoenixft import keys
from phoenixft.comm import EpochComm, alltoallv, connect_store, wait_work
from phoenixft.config import RunConfig
from phoenixft.data import _mix
from phoenixft.errors import PeerFailure, RunAborted, Unhealable
from phoenixft.faults import FaultSpec
from phoenixft.invariants import check_invariants
from phoenixft.persist import Persister, load_full
from phoenixft.replication import ReplicaPlan, Replicator
from phoenixft.reshard import gather_full_optimizer, old_shard_numel
from phoenixft.recovery.planner import Descriptor
from phoenixft.snapshot import H_CRC, H_VALID, INVALID, Holding, ShardState, checksum
from phoenixft.topology import Topology, shard_name
from phoenixft.workload import WorkloadContext, load_workload
from phoenixft.zero import AdamWHyper, FlatModel, adamw_step

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
        self.wl = load_workload(cfg.workload, WorkloadContext(seed=cfg.seed, micro_batch=cfg.micro_batch,
                                                              model=cfg.model))
        torch.manual_seed(cfg.seed)
        self.model = self.wl.build_model()
        self.protect = cfg.protect == "phoenix"
        world, gen = cfg.world, 0
        if incarnation > 0:  # restarted in place: the partition is the current epoch's, not the initial one
            cur = Topology.from_json(self.store.get(keys.topo(int(self.store.get(keys.EPOCH)))))
            world, gen = cur.world, int(cur.meta.get("generation", 0))
        self.hyper = AdamWHyper(cfg.lr, cfg.weight_decay)
        self._partition(world, gen)
        self.faults: list[FaultSpec] = cfg.faults
        self.repl: Replicator | None = None
        if self.protect:
            self.repl = Replicator(
                self.state,
                holding_factory=lambda s: Holding(self.flat.shard_numel, self.shm and f"{self.shm}-hold{s}"),
                chunk_numel=int(cfg.chunk_mb * (1 << 20) / 4),
                abort_check=self._flag_check_factory(store_addr),
                timeout_s=self._coll_timeout,
                on_in_flight=lambda s: self._fault(s + 1, "replicate"),
                after_commit=self._after_replication,
            )
        if self.repl is not None and incarnation > 0:  # adopt the replicas retained in shared memory
            for f in Path("/dev/shm").glob(f"phoenixft-{run_id}-{self.wid}-g{gen}-hold*.data"):
                shard = int(f.name.rsplit("-hold", 1)[1].split(".")[0])
                self.repl.holding(shard)
        pstore = self._own_store(store_addr) if cfg.persist_every and self.protect else None
        self.persister = Persister(cfg.persist_dir, cfg.persist_every, pstore,
                                   fenced=lambda: bool(pstore.check([keys.fence(node_id)]))) if pstore else None
        self.comm: EpochComm | None = None
        self.topo: Topology | None = None
        self.epoch = -1
        self.rank = -1
        self._first_after_join: int | None = None
        self._bad_sources: list[tuple[str, int, str]] = []  # (shard, step, wid) whose transfer failed I3

    def _partition(self, world: int, gen: int, step: int = 0) -> None:
        """Flat parameters and the own optimizer shard for a `world`-way partition (generation `gen`)."""
        self.shm = f"/dev/shm/phoenixft-{self.run_id}-{self.wid}-g{gen}" if self.protect else None
        self.flat = FlatModel(self.model, shards=world, path=self.shm and self.shm + "-params", step=step)
        self.state = ShardState(self.flat.shard_numel, self.shm and self.shm + "-state")

    # ------------------------------------------------------------------ helpers
    @property
    def _coll_timeout(self) -> float:
        return max(60.0, 6 * self.cfg.failure_timeout)

    def _own_store(self, store_addr: str) -> Any:
        return connect_store(store_addr)

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

    def _wait(self, work: Any, what: str) -> None:
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
            if hit:
                self._fire(f, step=step, phase=phase)

    def _fire(self, f: FaultSpec, **where: Any) -> None:
        """Claim fault f for this node (once per run), record it, then act with a real signal."""
        assert self.topo is not None
        slot = self.topo.slot_of(self.node_id)
        if self.store.add(keys.fault_claim(f.index, slot), 1) != 1:
            return
        rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": f.kind,
               "node": self.node_id, "slot": slot, "rank": self.rank, "epoch": self.epoch, **where}
        if self.store.add(keys.fault(f.index) + "/fired", 1) == 1:
            self.store.set(keys.fault(f.index), json.dumps(rec))
        self.store.append(keys.EVENTS, json.dumps(rec) + "\n")
        if f.coordinator:
            os.kill(int(self.store.get("coordinator/pid")), signal.SIGKILL)
        elif f.kind == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif f.kind == "hang":
            os.killpg(os.getpgid(0), signal.SIGSTOP)
        elif f.kind == "crash":
            os._exit(17)

    def _nan_fault(self, step: int) -> bool:
        return self.rank == 0 and any(f.kind == "nan" and f.step == step for f in self.faults)

    def _after_replication(self, step: int, received: dict[int, Holding]) -> None:
        """Runs on the replication thread once step's replicas committed; the committed half of
        `step` cannot change before this returns, so the persistent tier stages it here."""
        if self.topo is None:
            return
        if self.persister is not None and self.persister.due(step):
            half = self.state.half_with(step)
            if half is not None:
                self.persister.stage(step, self.state.data[half], {
                    "rank": self.rank, "shards": self.topo.world, "numel": self.flat.numel,
                    "shard_numel": self.flat.shard_numel, "epoch": self.epoch, "seed": self.cfg.seed})
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

    # ------------------------------------------------------------------ training
    def train_step(self, s: int) -> None:
        assert self.comm is not None and self.topo is not None
        t0 = time.perf_counter()
        cfg, flat, pg = self.cfg, self.flat, self.comm.train
        flat.zero_grad()
        m_total = cfg.total_microbatches
        lo, hi = self.topo.microbatches(self.rank, m_total)
        loss_sum = 0.0
        for j, mb in enumerate(range(lo, hi)):
            torch.manual_seed(_mix(cfg.seed, s, mb))
            if j == 0:
                self._fault(s, "forward")
            try:
                loss = self.wl.loss(self.model, self.wl.batch(s, mb))
                if j == 0:
                    self._fault(s, "backward")
                (loss / m_total).backward()
            except Exception as e:  # noqa: BLE001 - a bug in user code is not ours to heal
                raise Unhealable(f"exception in the workload at step {s} on rank {self.rank}: "
                                 f"{type(e).__name__}: {e}") from e
            loss_sum += float(loss.detach())
        if self._nan_fault(s):
            loss_sum = math.nan
        t_compute = time.perf_counter() - t0
        waited = self.repl.wait(s - 1) if self.repl is not None else 0.0
        w_rs = self.comm.reduce_scatter(flat.grad)
        lt = torch.tensor([loss_sum], dtype=torch.float64)
        w_loss = pg.allreduce([lt])
        self._wait(w_rs, f"gradient reduce-scatter of step {s}")
        self._wait(w_loss, f"loss all-reduce of step {s}")
        if not math.isfinite(float(lt)):
            raise Unhealable(f"the loss of step {s} is {float(lt) / m_total} (numerical error in the training "
                             "itself)")
        gshard = flat.grad[flat.shard_slice(self.rank)]
        src = self.state.half_with(s - 1)
        if src is None:
            raise RuntimeError(f"no committed optimizer state for step {s - 1}")
        dst = 1 - src
        adamw_step(self.state, src, dst, gshard, s, self.hyper, hook=lambda: self._fault(s, "optimizer"))
        w_ag = pg._allgather_base(flat.begin_gather(), self.state.data[dst, 0])
        self._wait(w_ag, f"all-gather of step {s}")
        self.state.commit(dst, s, 0)
        flat.flip(s)
        if self.repl is not None:
            self.repl.start(s)
        if self.rank == 0:
            now = time.time()
            rec = {"step": s, "loss": float(lt) / m_total, "dt": time.perf_counter() - t0, "t_end": now,
                   "epoch": self.epoch, "world": self.topo.world, "compute_s": t_compute, "repl_wait_s": waited}
            names, values = [keys.step(s), keys.PROGRESS], [json.dumps(rec), str(s)]
            if self._first_after_join is not None:
                names.append(keys.first_step(self._first_after_join))
                values.append(json.dumps({"t": now, "step": s}))
                self._first_after_join = None
            self._check_fence()  # a rank 0 resumed after its fence must not write a stale record
            self.store.multi_set(names, values)

    def finish(self) -> None:
        """Gather the optimizer state in logical order and hash it with the parameters."""
        assert self.comm is not None and self.topo is not None
        pg, flat = self.comm.train, self.flat
        if self.repl is not None:
            self.repl.wait(self.cfg.steps)  # the final state is protected (and persisted) like any other
        half = self.state.half_with(self.cfg.steps)
        assert half is not None
        m_all = torch.empty(flat.padded)
        v_all = torch.empty(flat.padded)
        w1 = pg._allgather_base(m_all, self.state.data[half, 1].contiguous())
        w2 = pg._allgather_base(v_all, self.state.data[half, 2].contiguous())
        self._wait(w1, "final gather")
        self._wait(w2, "final gather")
        if self.rank == 0:
            self._check_fence()
            n = flat.numel
            h = hashlib.sha256()
            for t in (flat.flat[:n], m_all[:n], v_all[:n]):
                h.update(t.numpy().tobytes())
            h.update(str(self.cfg.steps).encode())
            self.store.set(keys.FINAL, json.dumps({"sha256": h.hexdigest(), "step": self.cfg.steps,
                                                   "epoch": self.epoch}))
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

    def _fenced(self) -> bool:
        return bool(self.store.check([keys.fence(self.node_id)]))

    def _check_fence(self) -> None:
        """A fenced node (declared dead while it was stopped or cut off) must never write again."""
        if self._fenced():
            raise RunAborted(f"{self.node_id} was fenced: it is not a member any more and writes nothing")

    def _descriptor(self, err: str, t_err: float) -> Descriptor:
        """What this worker holds, for the planner: parameter steps, own shard and replicas with checksums."""
        d = Descriptor(wid=self.wid, t=t_err, error=err[:300], bad_sources=list(self._bad_sources))
        d.params = [st for st in self.flat.buf_step if st != INVALID]
        for x in (0, 1):
            st = self.state.step_of(x)
            idx, count = self.state.shard_of(x)
            if st != INVALID and count > 0:
                d.own.setdefault(shard_name(idx, count), {})[st] = self.state.known_crc(x)
        if self.repl is not None:
            for shard, h in self.repl.holdings.items():
                for x in (0, 1):
                    st = h.step_of(x)
                    if st == INVALID:
                        continue
                    idx, count = h.shard_of(x)
                    name = shard_name(idx if count else shard, count or self.flat.shards)
                    if h.verify(x):
                        d.holdings.setdefault(name, {})[st] = h.crc_of(x)
                    else:
                        d.rejected.append((name, st))
        return d

    def recover(self, err: str) -> int:
        e = self.epoch
        t_err = time.time()
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
        self.topo, self.epoch = topo, topo.epoch
        self.rank = topo.rank_of(self.node_id, self.local_rank)
        self.comm = EpochComm(self.store, topo.epoch, self.rank, topo.world, self._coll_timeout)
        t_pg = time.time()
        r = topo.resume_step
        timings: dict[str, Any] = {"reconfigure_s": t_pg - t0}
        bad: list[str] = []  # I3: what failed verification on this rank
        if "reshard" in topo.meta:
            self._reshard(topo, r, old_rank, timings, bad)
        elif topo.meta.get("restore") == "persistent":
            self._restore_persistent(topo, r, timings, bad)
        elif topo.epoch == 0:
            sl = self.flat.shard_slice(self.rank)
            self.state.data[0, 0].copy_(self.flat.flat[sl])
            self.state.data[0, 1:].zero_()
            self.state.commit(0, 0, 0, (self.rank, topo.world))
            self.state.header[1, H_VALID] = 0
        else:
            self._restore(topo, r, timings, bad)
        if self.repl is not None:
            self.repl.configure(self.comm, ReplicaPlan(shard=self.rank, send_to=topo.holders(self.rank),
                                                       recv_from=[(x, x) for x in topo.sources(self.rank)]))
            for h in self.repl.holdings.values():
                h.invalidate_after(r)
        half = self.state.half_with(r)
        held = self.state.shard_of(half) if half is not None else (-1, 0)
        inv = check_invariants(self.comm.train, topo, self.rank, r, self.flat.step, self.state.steps(), held,
                               not bad, lambda w, what: self._wait(w, what))
        timings["join_s"] = time.time() - t0
        self.store.set(keys.join(topo.epoch, self.wid), json.dumps({"t": time.time(), "rank": self.rank,
                                                                     "invariants": inv, "i3_failures": bad,
                                                                     **timings}))
        if not inv["I3"]:
            # a copy failed verification: recover again without that source (or stop, if none is left)
            raise PeerFailure(f"invariant I3 failed after recovery to epoch {topo.epoch}: "
                              f"{'; '.join(bad) or 'on another rank'}")
        if not all(inv.values()):
            raise RunAborted(f"invariant check failed after recovery to epoch {topo.epoch}: {inv}")
        self._bad_sources = []
        if self.repl is not None:
            self.repl.start(r)
        if topo.epoch > 0:
            self._first_after_join = topo.epoch
        return r

    def _repartition(self, world: int, gen: int, r: int) -> None:
        """Cut the flat state anew for a `world`-way partition (shrink, grow, persistent reload)."""
        old_shm = self.shm
        self._partition(world, gen, step=r)
        if self.repl is not None:
            self.repl.state = self.state
            self.repl.holdings = {}
        if old_shm and old_shm != self.shm:  # the old generation's segments are never used again
            for f in Path("/dev/shm").glob(Path(old_shm).name + "-*"):
                f.unlink(missing_ok=True)

    def _reshard(self, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
        """Shrink or grow: repartition the state of step r over the new world (see reshard.py)."""
        assert self.comm is not None
        meta, pg, me, w = topo.meta["reshard"], self.comm.train, self.rank, topo.world
        numel = self.flat.numel
        t1 = time.time()
        has_params = self.flat.select(r) if old_rank >= 0 else False
        params_to = {int(k): v for k, v in meta["params_to"].items()}
        if me not in params_to and not has_params:
            raise RunAborted(f"rank {me} has no parameters for step {r}")
        sends = {dst: self.flat.flat[:numel] for dst, src in params_to.items() if src == me}
        recv = {params_to[me]: numel} if me in params_to else {}
        work, _, got = alltoallv(pg, w, sends, recv)
        self._wait(work, "parameter transfer")
        if me in params_to:
            self.flat.flat[:numel].copy_(got[params_to[me]])
        t2 = time.time()
        providers = {int(k): v[0] for k, v in meta["providers"].items()}
        n_old = old_shard_numel(numel, meta["old_world"])
        mine: dict[int, torch.Tensor] = {}
        for k, (prov, _kind, _crc) in meta["providers"].items():
            if prov == me:
                mine[int(k)] = self._copy_of(int(k), meta["old_world"], r)
        full = gather_full_optimizer(pg, w, me, providers, mine, n_old, self._wait)
        for k, (prov, _kind, crc) in meta["providers"].items():  # I3: every old shard as its owner committed it
            i = int(k)
            if checksum(full[:, i * n_old : (i + 1) * n_old].contiguous()) != crc:
                bad.append(f"{shard_name(i, meta['old_world'])} from rank {prov} does not match the checksum "
                           f"committed for step {r}")
        self._repartition(w, int(topo.meta["generation"]), r)
        sl = self.flat.shard_slice(me)
        opt = torch.zeros(2, self.flat.padded)
        opt[:, :numel] = full[:, :numel]
        self.state.data[0, 0].copy_(self.flat.flat[sl])
        self.state.data[0, 1:].copy_(opt[:, sl])
        self.state.commit(0, r, 0, (me, w))
        self.state.header[1, H_VALID] = 0
        timings.update(restore_params_s=t2 - t1, restore_opt_s=time.time() - t2, bytes_opt=full.numel() * 4)

    def _copy_of(self, shard: int, shards: int, r: int) -> torch.Tensor:
        """This rank's verified copy of (shard, step r): its own committed half, or a replica it keeps."""
        half = self.state.half_with(r)
        if half is not None and self.state.shard_of(half) == (shard, shards):
            return self.state.payload(half)
        if self.repl is not None and shard in self.repl.holdings:
            h = self.repl.holdings[shard]
            hh = h.half_with(r)
            if hh is not None and h.verify(hh):
                return h.payload(hh)
        raise RunAborted(f"rank {self.rank} holds no verified copy of {shard_name(shard, shards)} at step {r}")

    def _restore_persistent(self, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
        """Every member reloads step r from the persistent tier (resharded to this world size)."""
        t0 = time.time()
        man = topo.meta["manifest"]
        if topo.world != self.flat.shards:
            self._repartition(topo.world, int(topo.meta.get("generation", 0)), r)
        full, mismatched = load_full(man)  # (3, numel), shards whose checksum does not match the manifest
        bad.extend(f"persistent shard {x} of step {r} does not match its checksum" for x in mismatched)
        padded = torch.zeros(3, self.flat.padded)
        padded[:, : self.flat.numel] = full
        self.flat.install(padded[0], r)
        half = self.state.staging()
        self.state.begin_write(half)
        self.state.data[half].copy_(padded[:, self.flat.shard_slice(self.rank)])
        self.state.commit(half, r, 0, (self.rank, topo.world))
        self.state.header[1 - half, H_VALID] = 0
        if self.repl is not None:
            for h in self.repl.holdings.values():
                h.invalidate_after(-1)
        timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0, bytes_params=full.numel() * 4)

    def _recovery_faults(self, topo: Topology) -> None:
        """kill:node=I@recovery=N and kill:...,phase=recovery fire here, mid state transfer."""
        slot = topo.slot_of(self.node_id)
        for f in self.faults:
            if f.kind != "kill" or slot not in f.nodes:
                continue
            if f.recovery == topo.epoch or (f.phase == "recovery" and f.step is not None
                                            and topo.resume_step >= f.step - 1):
                self._fire(f, recovery=topo.epoch)

    def _corrupts_transfers(self, topo: Topology) -> bool:
        slot = topo.slot_of(self.node_id)
        return any(f.kind == "corrupt" and f.phase == "transfer" and slot in f.nodes and f.step is not None
                   and topo.resume_step >= f.step - 1 for f in self.faults)

    def _restore(self, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
        """Roll survivors back to step r and move what the plan says to the members that lack it.

        Both transfers are targeted collectives (all-to-all with only the involved pairs
        non-empty): parameters from a member that holds them at r, the optimizer shard from a
        member that holds a verified copy (its own committed state or a replica), matched by
        logical shard id and verified against the checksum its owner committed (I3).
        """
        assert self.comm is not None
        pg, me, w = self.comm.train, self.rank, topo.world
        mine = [t for t in topo.transfers if t["dst"] == me]
        need_params = any(t["param_src"] >= 0 for t in mine)
        if not need_params and not self.flat.select(r):
            raise RunAborted(f"rank {me} has no parameters for step {r}")
        if not mine:  # both ping-pong sides must hold r
            self.state.invalidate_after(r)
            half = self.state.half_with(r)
            if half is None:
                raise RunAborted(f"rank {me} has no optimizer state for step {r}")
            crc = int(self.state.header[half, H_CRC])
            if crc and not self.state.verify(half):
                bad.append(f"own {shard_name(me, w)} at step {r} does not match its committed checksum")
        # 1. parameters
        t1 = time.time()
        sends = {t["dst"]: self.flat.flat for t in topo.transfers if t["param_src"] == me}
        recv = {t["param_src"]: self.flat.padded for t in mine if t["param_src"] >= 0}
        work, _, got = alltoallv(pg, w, sends, recv)
        self._wait(work, "parameter transfer")
        for t in mine:
            if t["param_src"] >= 0:
                self.flat.install(got[t["param_src"]], r)
        t2 = time.time()
        self._recovery_faults(topo)
        # 2. optimizer shard from a verified copy
        sends = {}
        for t in topo.transfers:
            if t["opt_src"] == me:
                payload = self._copy_of(t["shard"], w, r)
                if self._corrupts_transfers(topo):  # fault injection: corruption in flight
                    payload = payload.clone()
                    payload.view(-1)[:: max(1, payload.numel() // 7)] += 1.0
                sends[t["dst"]] = payload
        recv = {t["opt_src"]: 2 * self.flat.shard_numel for t in mine}
        work, _, got = alltoallv(pg, w, sends, recv)
        self._wait(work, "optimizer-state transfer")
        for t in mine:
            buf = got[t["opt_src"]]
            name = shard_name(t["shard"], w)
            if checksum(buf) != t["crc"]:
                src = topo.node_of_rank(t["opt_src"]) + f".{t['opt_src'] % topo.workers_per_node}"
                bad.append(f"{name} from {src} does not match the checksum committed for step {r}")
                self._bad_sources.append((name, r, src))
                continue
            half = self.state.staging()
            self.state.begin_write(half)
            self.state.data[half, 1:].copy_(buf.view(2, -1))
            self.state.data[half, 0].copy_(self.flat.flat[self.flat.shard_slice(me)])
            self.state.commit(half, r, t["crc"], (t["shard"], w))
            self.state.header[1 - half, H_VALID] = 0
            timings.update(bytes_params=self.flat.padded * 4 if t["param_src"] >= 0 else 0, bytes_opt=buf.numel() * 4)
        timings.update(restore_params_s=t2 - t1, restore_opt_s=time.time() - t2)

    # ------------------------------------------------------------------ main loop
    def _stop_run(self, why: str) -> None:
        """Not ours to heal: stop the whole run at the last committed step, with one clear reason."""
        if self.store.add("run/stop_claim", 1) == 1:
            last = max(self.state.steps(), default=0)
            self.store.set(keys.RUN_ERROR, f"{why}; not ours to heal, stopped at the last committed step {last}")
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
            if self.repl is not None:
                self.repl.close()
            if self.persister is not None:
                self.persister.close()


def worker_main(store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                incarnation: int = 0) -> int:
    return Worker(store_addr, node_id, local_rank, run_id, threads, incarnation).run()
