"""A training worker of the built-in trainer: one per accelerator (a GPU with `--device cuda`, else a CPU process).

Life of a worker: connect to the control-plane store, build the workload and its `Trainer` for
its (pp, tp) stage (flat parameters, optimizer shard, optimizer: training.py), announce itself,
then wait for membership (an active node gets epoch 0; a spare waits, warm, until the coordinator
promotes it). Membership, recovery and the invariants are the `Member`'s (core/member.py), shared
with a user's own training script (phoenixft.api); this module is the built-in trainer's part: its
state, how it is restored (recovery/restore.py), and the training loop. Each step the trainer
computes while the protection layer (protection.py) replicates the previous step and, every K steps,
persists it. Any `PeerFailure` sends the worker into the recovery protocol and training resumes at the
recovery step. Faults are injected by faults/inject.py. Run by the node agent (forked from its image).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from phoenixft.controlplane import auth, keys, sealed
from phoenixft.controlplane.values import parse_int
from phoenixft.coordinator.stragglers import nodes_compute
from phoenixft.core.member import Member
from phoenixft.distributed.comm import connect_store
from phoenixft.distributed.topology import Topology
from phoenixft.errors import Drained, PeerFailure, RunAborted, Unhealable, UserError
from phoenixft.faults.inject import FaultInjector
from phoenixft.optim import native
from phoenixft.parallel.layers import TPHandle
from phoenixft.parallel.stage import StageSpec, WholeModel
from phoenixft.recovery import restore
from phoenixft.sdc.checks import SdcChecks, SdcSuspect
from phoenixft.train.trainer import Trainer
from phoenixft.workload import WorkloadContext, load_workload, unsupported_parameters

__all__ = ["Worker", "worker_main", "record_start_failure"]


class Worker(Member):
    """The built-in trainer's rank: the workload's model as a ZeRO-1 `Trainer`, its training loop."""

    def __init__(self, store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                 incarnation: int = 0) -> None:
        super().__init__(store_addr, node_id, local_rank, run_id, threads, incarnation)
        cfg, cur = self.cfg, self.start_topo
        if not self.device.is_cuda and cfg.optimizer in ("adamw", "adam"):  # built or loaded now, not in step 1
            line = native.status()
            if local_rank == 0 and self.incarnation == 0:
                print(f"phoenixft worker {self.wid}: optimizer update: {line}", flush=True)
        self.wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
        self.protect = cfg.protect == "phoenix"
        world, gen = cfg.world, 0
        try:
            if cur is not None:  # restarted in place: the partition is the current epoch's, not the initial one
                world, gen = cur.world, int(cur.meta.get("generation", 0))
                self._build(cur.layout.coord(cur.rank_of(node_id, local_rank)).stage)
                self.ctx.partition(world, gen)
            elif cfg.tp == 1 and cfg.pp == 1:  # data-parallel only: every rank's stage is the whole model, built warm
                self._build((0, 0))
                self.ctx.partition(world, gen)
                if node_id.startswith("s") and self.protect:  # a spare: the memory it will receive into, touched now
                    self.ctx.trainer.prefault()
        except Unhealable as e:  # (the workload's model cannot be built: every node would fail alike)
            self._unhealable(e)
            raise
        self.inject = self.ctx.inject = FaultInjector(self.ctx)
        self.sdc = SdcChecks(self.ctx, self.inject)  # silent-data-corruption checks (docs/sdc.md)
        # the protection owns the replicator, the redundancy scheme and the persistent tier
        self._attach_protection(gen)
        self.trained = False  # a training step done here (a failure before it may be the same on every node)

    def _build(self, stage: tuple[int, int]) -> None:
        """The trainer of (pp, tp) coordinate `stage`: the whole model when data-parallel only, else the
        workload's split of it (the full model is built under the seed on every rank, so every layout
        starts from the same weights, then only its structure is kept, for the export)."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        try:
            full = self.wl.build_model()
        except Exception as e:  # noqa: BLE001 - user code: not ours to heal, and the same on every node
            raise Unhealable(f"exception in the workload's build_model: {type(e).__name__}: {e}") from e
        why = unsupported_parameters(full, cfg.precision)
        if why:
            raise Unhealable(f"--workload {cfg.workload}: {why}")
        if cfg.tp == 1 and cfg.pp == 1:
            tr = Trainer(cfg, self.wl, WholeModel(full, self.wl.loss), device=self.device)
        else:
            if self.wl.split is None:
                raise Unhealable(f"--tp {cfg.tp} --pp {cfg.pp}: workload {cfg.workload} does not say how it splits")
            pp, tp = stage
            spec = StageSpec(pp=pp, pp_size=cfg.pp, tp=tp, tp_size=cfg.tp, handle=TPHandle(cfg.tp, tp))
            try:
                st = self.wl.split(full, spec)
            except Exception as e:  # noqa: BLE001 - user code, like build_model: the same on every node
                raise Unhealable(f"exception in the workload's split (stage pp={pp} tp={tp}): "
                                 f"{type(e).__name__}: {e}") from e
            tr = Trainer(cfg, self.wl, st, full_model=full.to("meta"), device=self.device)
        tr.watch(self.watcher.check)
        self.ctx.trainer, self.ctx.stage_of = tr, stage
        if self.ctx.scheme is not None:  # (what it kept belongs to the stage it was built for)
            self.ctx.scheme.drop()

    # ------------------------------------------------------------------ training
    def train_step(self, s: int) -> None:
        assert self.ctx.comm is not None and self.ctx.topo is not None
        self.inject.hold(s)  # `,wait=S` faults: before any collective of the step, on every rank
        t0 = time.perf_counter()
        scheme, repl = self.ctx.scheme, self.protection.repl
        self.ctx.trainer.checks = self.sdc
        self.sdc.before_step(s)  # parameter fingerprints across the data-parallel group; an audit's recomputation
        try:
            res = self._step(s)
        except SdcSuspect as e:  # nothing of step s committed: replay it; a proven corruption raises PeerFailure
            self.sdc.prove(s, e)
            res = self._step(s)  # a genuine spike: the step again, bit for bit the original
        self.sdc.committed()
        if scheme is not None:
            scheme.protect(s)
        self.trained = True
        if s >= 2:  # (step 1's half is committed by now: the run can no longer start afresh from step 0)
            self.ctx.trainer.flat.release_init_master()
        if self.ctx.rank == 0:
            now = time.time()
            rec = {"step": s, "loss": res.loss, "lr": res.lr, "dt": time.perf_counter() - t0, "t_end": now,
                   "epoch": self.ctx.epoch, "world": self.ctx.topo.world, "compute_s": res.compute_s,
                   "repl_wait_s": res.repl_wait_s, **{k: round(v, 6) for k, v in res.phases.items()}}
            if repl is not None:  # the protection work of the previous step's replication, on this rank
                rec.update(protect_bytes=repl.stats.last_bytes, protect_s=repl.stats.last_job_s,
                           protect_cpu_s=repl.stats.last_cpu_s, protect_shm_bytes=repl.stats.last_shm_bytes)
            rec.update(own_s=round(res.own_s, 6), **nodes_compute(self.ctx.topo, s, res.ranks_own_s))
            scrub = self.protection.scrubber
            if scrub is not None:  # its share of the previous step's job: bytes re-hashed, seconds (with repairs)
                rec.update(scrub_bytes=scrub.stats.last_bytes, scrub_s=round(scrub.stats.last_s, 6),
                           scrub_cpu_s=round(scrub.stats.last_cpu_s, 6))
            if res.grad_norm is not None:
                rec["grad_norm"] = res.grad_norm
            rec.update(self.sdc.costs())
            if res.val_loss is not None:
                rec["val_loss"] = res.val_loss
            names, values = [keys.step(s), keys.PROGRESS], [json.dumps(rec), str(s)]
            if self._first_after_join is not None:
                names.append(keys.first_step(self._first_after_join))
                values.append(json.dumps({"t": now, "step": s}))
                self._first_after_join = None
            self._check_fence()  # a rank 0 resumed after its fence must not write a stale record
            sealed.put_many(self.ctx.store, names, values)

    def _step(self, s: int) -> Any:
        """The trainer's step s on this rank's microbatches (its state commits step s)."""
        assert self.ctx.comm is not None and self.ctx.topo is not None
        scheme = self.ctx.scheme
        return self.ctx.trainer.step(
            s, self.ctx.comm, self.ctx.rank, self.ctx.topo.layout,
            self.ctx.topo.microbatches(self.ctx.rank, self.cfg.total_microbatches),
            self.ctx.wait, before_reduce=lambda: scheme.wait(s - 1) if scheme is not None else 0.0,
            fault=lambda phase: self.inject.at(s, phase), nan=self.inject.nan_at(s), slow=self.inject.slow_factor(s))

    def finish(self) -> None:
        """Hash the full state in logical order; rank 0 writes it to the run directory and says done."""
        ctx = self.ctx
        assert ctx.comm is not None and ctx.topo is not None
        if ctx.scheme is not None:
            ctx.scheme.wait(self.cfg.steps)  # the final state is protected (and persisted) like any other
        sha, master = ctx.trainer.final_state(ctx.comm, ctx.rank, ctx.topo.layout, self.cfg.steps, ctx.wait)
        if self.ctx.rank == 0:
            self._check_fence()
            from phoenixft.observe.export import write_final

            run_dir = self._run_dir()
            path = write_final(run_dir, self.ctx.trainer, master, self.cfg, sha) if run_dir else ""
            self.finish_hash(json.dumps({"sha256": sha, "step": self.cfg.steps, "epoch": self.ctx.epoch,
                                         "path": path}))
            return
        self.await_end()

    # ------------------------------------------------------------------ membership and recovery
    def _restore(self, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
        tr, lay = self.ctx.trainer, topo.layout
        stage = lay.coord(self.ctx.rank).stage
        if self.ctx.stage_of != stage:  # a 3D rank's first epoch, or a spare promoted to a stage it was not built for
            self._build(stage)
            self.ctx.partition(topo.world, int(topo.meta.get("generation", 0)), r)
            tr = self.ctx.trainer
        assert self.ctx.comm is not None
        tr.stage.bind(self.ctx.comm.tp, tr.device_wait(self.ctx.wait))  # NCCL: stream-ordered (distributed/streams.py)
        if "reshard" not in topo.meta and tr.flat.shards != lay.dp:
            # a spare built for the initial world, promoted into a resized one: it holds nothing yet
            self.ctx.repartition(topo.world, int(topo.meta.get("generation", 0)), r)
        path = restore.path_of(topo)
        if path == "reshard":
            restore.reshard(self.ctx, topo, r, old_rank, timings, bad)
        elif path == "persistent":
            restore.restore_persistent(self.ctx, topo, r, timings, bad)
        elif path == "init":
            tr.init_shard(lay.dp_rank(self.ctx.rank), self.ctx.rank, topo.world)
            restore.init_replicas(self.ctx, topo)
        else:
            restore.restore_in_place(self.ctx, topo, r, timings, bad)
        tr.resume(r)  # the restored host snapshot into the shard's working copy (H2D on CUDA)

    def _joined(self, topo: Topology, r: int) -> None:
        self.sdc.joined(r)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        self.announce()
        try:
            if self.incarnation > 0:  # restarted in place by the agent: rejoin from retained memory
                e = parse_int(sealed.get(self.ctx.store, keys.EPOCH), keys.EPOCH, 0)
                self.ctx.topo = auth.verified_topology(self.ctx.store, e, self.ctx.store.get(keys.topo(e)))
                self.ctx.epoch, self.ctx.rank = e, self.ctx.topo.rank_of(self.node_id, self.local_rank)
                step = self.recover(f"restarted in place (incarnation {self.incarnation})") + 1
            else:
                try:
                    step = self.join(self.await_membership()) + 1
                except PeerFailure as e:
                    step = self._recover_until_joined(str(e)) + 1
            while True:
                try:
                    while step <= self.cfg.steps:
                        self._stop_for_drain(step - 1)
                        self._stop_if_ended()
                        self.train_step(step)
                        step += 1
                    self.finish()
                    return 0
                except PeerFailure as e:
                    step = self._recover_until_joined(str(e)) + 1
        except Unhealable as e:
            self._unhealable(e)
            return 4
        except Drained as e:
            print(f"phoenixft worker {self.wid}: {e}; leaving", flush=True)
            return 0
        except RunAborted as e:
            if "done" in str(e):
                return 0
            print(f"phoenixft worker {self.wid}: {e}", flush=True)
            return 3
        finally:
            self.watcher.close()
            self.protection.close()


def record_start_failure(w: Worker | None, store_addr: str, wid: str, error: str) -> None:
    """Tell the coordinator that this worker failed before it took part in any step (`startfail/<wid>`,
    its first error kept, and how often it failed so): when every node and spare of the run failed so
    before the run's first step, again after a restart in place (a failure once may be transient: its
    restart heals it and deletes the key), the failure is the same everywhere (the workload, the data,
    the environment) and the coordinator ends the run with this error instead of restarting and
    promoting nodes that fail alike."""
    if w is not None and w.trained:
        return
    try:
        store = w.ctx.store if w is not None else connect_store(store_addr, 10.0)
        key = keys.start_failed(wid)  # (one process of the worker at a time: no other writer)
        rec: dict[str, Any] = sealed.get_json(store, key) or {"t": time.time(), "error": error[:500]}
        rec["failures"] = parse_int(str(rec.get("failures", 0)), key) + 1
        sealed.put(store, key, json.dumps(rec))
        sealed.hint(store, keys.START_FAILS)  # the coordinator looks at startfail/ keys once this is there
    except Exception:  # noqa: BLE001 - no control plane: nobody to tell (the agent still reports the exit)
        pass


def worker_main(store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                incarnation: int = 0) -> int:
    wid = f"{node_id}.{local_rank}"
    w: Worker | None = None
    try:
        w = Worker(store_addr, node_id, local_rank, run_id, threads, incarnation)
        return w.run()
    except Unhealable:  # (the constructor stopped the run and said why: a restart would fail alike)
        return 4
    except UserError as e:  # e.g. the workload's factory fails on this host (its data is not here): one line
        record_start_failure(w, store_addr, wid, str(e))
        print(f"phoenixft worker {wid}: {e}", flush=True)
        return 2
    except Exception as e:  # (the agent prints its traceback and restarts the worker in place)
        first = str(e).splitlines()[0][:300] if str(e) else ""
        record_start_failure(w, store_addr, wid, f"{type(e).__name__}: {first}")
        raise
