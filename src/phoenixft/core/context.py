"""One rank's context: what protection, recovery and fault injection need of the worker they run in.

A worker (runtime/worker.py) owns one `RankContext` and updates it as the run goes: the trainer
built for its stage and partition, the epoch's topology, communicators and rank, the redundancy
scheme its protection chose. The protection layer (protect/protection.py), the restore paths
(recovery/restore.py, recovery/rebuild.py) and the fault injector (faults/inject.py) receive this
object, never the worker: they read the same few fields, and call the rank's abort-aware `wait`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, exists_many, keys, sealed
from phoenixft.controlplane.signed import run_ended
from phoenixft.controlplane.watcher import FailureWatcher
from phoenixft.distributed.comm import EpochComm, wait_work
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import RunAborted
from phoenixft.faults.spec import FaultSpec
from phoenixft.protect import shm
from phoenixft.protect.scheme import BadSource, RedundancyScheme
from phoenixft.protect.snapshot import Holding
from phoenixft.train.trainer import Trainer

__all__ = ["RankContext", "FaultHooks", "NoFaults"]



class FaultHooks(Protocol):
    """The points where `--inject` faults fire inside protection and recovery (faults/inject.py)."""

    def at(self, step: int, phase: str, joined: Callable[[], None] | None = None) -> None: ...

    def in_recovery(self, topo: Topology) -> None: ...

    def corrupts_transfers(self, topo: Topology) -> bool: ...

    def corrupt_replicas(self, step: int, received: dict[int, Holding]) -> None: ...

    def at_rest(self, step: int) -> None: ...


class NoFaults:
    """No fault injected anywhere."""

    def at(self, step: int, phase: str, joined: Callable[[], None] | None = None) -> None:
        pass

    def in_recovery(self, topo: Topology) -> None:
        pass

    def corrupts_transfers(self, topo: Topology) -> bool:
        return False

    def corrupt_replicas(self, step: int, received: dict[int, Holding]) -> None:
        pass

    def at_rest(self, step: int) -> None:
        pass


class RankContext:
    def __init__(self, cfg: RunConfig, run_id: str, wid: str, node_id: str, store: Store,
                 watcher: FailureWatcher) -> None:
        self.cfg, self.run_id, self.wid, self.node_id = cfg, run_id, wid, node_id
        self.store: Store = store  # the worker's control-plane client (replaced when a group build is abandoned)
        self.watcher = watcher
        self.faults: list[FaultSpec] = cfg.faults
        self.inject: FaultHooks = NoFaults()
        self.trainer: Trainer = None  # type: ignore[assignment]  # built for this rank's stage (Worker._build)
        self.stage_of: tuple[int, int] | None = None  # the (pp, tp) coordinate the trainer was built for
        self.shm: str | None = None  # the shared-memory base of this partition generation's segments
        self.scheme: RedundancyScheme | None = None  # the protection's redundancy scheme (None: unprotected)
        self.comm: EpochComm | None = None
        self.topo: Topology | None = None
        self.epoch = -1
        self.rank = -1
        self.bad_sources: list[BadSource] = []  # (shard, step, wid) whose transfer failed I3
        self._abort_checked = 0.0
        self._abort_every = store.abort_check_s

    # ------------------------------------------------------------------ waiting for collectives
    @property
    def coll_timeout(self) -> float:
        return max(60.0, 6 * self.cfg.failure_timeout)

    def abort_reason(self) -> str | None:
        """Why a wait for a collective should give up, or None: the epoch's failure flag (the watcher
        sees it without a round trip) or the end of the run. The store is asked at most every
        `Store.abort_check_s` (one request for both keys where a round trip costs a cluster's leader CPU)."""
        if self.watcher.flagged(self.epoch):
            return "recovery requested by the control plane"
        now = time.monotonic()
        if now - self._abort_checked < self._abort_every:
            return None
        self._abort_checked = now
        failed, over = exists_many(self.store, [keys.failflag(self.epoch), keys.RUN_STATE])
        failed = failed and sealed.has(self.store, keys.failflag(self.epoch))  # (a forged flag is ignored)
        if failed and not self._draining():
            return "recovery requested by the control plane"
        ended = run_ended(self.store, self.run_id) if over else None  # (a forged end is ignored)
        if ended is not None:
            raise RunAborted(f"run ended ({ended})")
        return None

    def _draining(self) -> bool:
        """The epoch's failure flag is a planned drain's, and the drain has not ended: a rank keeps training
        to the drain's step boundary (the watcher tells it, and raises once the drain ends)."""
        names = [keys.drain_notice(self.epoch), keys.drain_abort(self.epoch)]
        notice, ended = sealed.present(self.store, names)
        return notice and not ended

    def wait(self, work: Any, what: str) -> None:
        wait_work(work, what, self.abort_reason, self.coll_timeout)

    def event(self, kind: str, **fields: Any) -> None:
        sealed.append(self.store, keys.EVENTS, {"t": time.time(), "kind": kind, "wid": self.wid, **fields})

    # ------------------------------------------------------------------ the rank's state
    def copy_of(self, shard: int, shards: int, r: int) -> torch.Tensor:
        """This rank's verified copy of (shard, step r): its own committed half, or a copy its scheme keeps."""
        st = self.trainer.state
        half = st.half_with(r)
        if half is not None and st.shard_of(half) == (shard, shards):
            return st.payload(half)
        kept = self.scheme.copy_of(shard, r) if self.scheme is not None else None
        if kept is not None:
            return kept
        name = shard_name(shard, shards, self.cfg.tp, self.cfg.pp)
        raise RunAborted(f"rank {self.rank} holds no verified copy of {name} at step {r}")

    def partition(self, world: int, gen: int, step: int = 0) -> None:
        """Flat parameters and the own optimizer shard for a `world`-way mesh (generation `gen`): the
        stage's state is sharded over its data-parallel peers."""
        self.shm = shm.worker_base(self.run_id, self.wid, gen) if self.cfg.protect == "phoenix" else None
        self.trainer.partition(world // (self.cfg.tp * self.cfg.pp), self.shm, step)
        if self.scheme is not None:
            self.scheme.attach(self.trainer.state)

    def repartition(self, world: int, gen: int, r: int) -> None:
        """Cut the flat state anew for a `world`-way partition (shrink, grow, persistent reload)."""
        old_shm = self.shm
        self.partition(world, gen, step=r)
        if self.scheme is not None:
            self.scheme.drop()
        if old_shm and old_shm != self.shm:  # the old generation's segments are never used again
            for f in shm.SHM_DIR.glob(Path(old_shm).name + "-*"):
                f.unlink(missing_ok=True)
