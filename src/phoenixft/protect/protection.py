"""The protection layer of one worker: what keeps each committed step recoverable, off the critical path.

- replication (replication.py): after every step, the committed half of the optimizer shard goes
  to its replica holders (topology.py: data-parallel peers of the same stage on other nodes);
- the persistent tier (persist.py): every `--persist-every` steps the committed half (with the
  stage's map onto the full model under 3D parallelism) is staged for a background DCP write;
- the descriptor: at a failure, what this worker holds (parameter steps, its own shard and the
  replicas it keeps, with their checksums) for the recovery planner (recovery/planner.py).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch

from phoenixft.controlplane import Store, exists_many, keys
from phoenixft.dist.topology import Topology, shard_name
from phoenixft.errors import RunAborted
from phoenixft.protect.persist import Persister
from phoenixft.protect.redundancy.parity import ParityHolding, parity_name
from phoenixft.protect.redundancy.plan import ec_plan
from phoenixft.protect.redundancy.protect import ErasureProtector
from phoenixft.protect.replication import ReplicaPlan, Replicator
from phoenixft.protect.snapshot import INVALID, Holding
from phoenixft.recovery.planner import Descriptor

if TYPE_CHECKING:
    from phoenixft.runtime.worker import Worker

__all__ = ["Protection"]


RUN_END_CHECK_S = 1.0  # a replication waiting on a stopped peer looks this often whether the run has ended


class Protection:
    def __init__(self, worker: Worker, store_addr: str, timeout_s: float) -> None:
        self.w = w = worker
        cfg = w.cfg
        on = cfg.protect == "phoenix"
        # the replication and persist threads' client: short non-blocking calls only, so one serves both
        store = w.store.independent() if on else None
        self.repl: Replicator | None = None
        if on:
            self.repl = Replicator(
                None,  # type: ignore[arg-type]  # the trainer's shard, set when the worker partitions
                holding_factory=lambda s: Holding(w.trainer.flat.shard_numel, w.shm and f"{w.shm}-hold{s}",
                                                  rows=w.trainer.payload_rows),
                chunk_numel=int(cfg.chunk_mb * (1 << 20) / 4),
                abort_check=self._flag_check(store),  # type: ignore[arg-type]  # (on)
                timeout_s=timeout_s,
                on_in_flight=lambda s: w.inject.at(s + 1, "replicate"),
                after_commit=self.after_replication,
                transport=cfg.replica_transport,
            )
        # --redundancy ec:D+H: parity blocks instead of replicas (phoenixft.protect.redundancy)
        self.redundancy = cfg.scheme
        self.ec: ErasureProtector | None = None
        if self.repl is not None and self.redundancy.is_ec:
            self.ec = ErasureProtector(lambda gid, numel, dmax: ParityHolding(
                numel, dmax, w.shm and f"{w.shm}-par{gid}"))
        pstore = store if cfg.persist_every and on else None
        self.persister = Persister(cfg.persist_dir, cfg.persist_every, pstore,
                                   fenced=lambda: bool(pstore.check([keys.fence(w.node_id)]))) if pstore else None

    def _flag_check(self, store: Store) -> Any:
        every = store.abort_check_s  # the watcher sees a flag first: a costly round trip is only the fallback
        last = [0.0, 0.0]  # the last look at the flag; at the run's end (not urgent: once a second)

        def check() -> str | None:
            """Why the replication of a step should give up: a recovery of this epoch, or (RunAborted) the
            end of the run: a peer that stopped mid-transfer (a hang, a timeout of the run) must not keep
            this node waiting out the replication timeout after the run has ended."""
            if self.w.watcher.flagged(self.w.epoch):
                return "recovery requested"
            now = time.monotonic()
            if now - last[0] < every:
                return None
            last[0] = now
            names = [keys.failflag(self.w.epoch)]
            if now - last[1] >= RUN_END_CHECK_S:  # (a TCPStore answers one key per round trip: not every poll)
                last[1] = now
                names.append(keys.RUN_STATE)
            failed, *over = exists_many(store, names)
            if failed:
                return "recovery requested"
            if any(over):
                raise RunAborted(f"run ended ({store.get(keys.RUN_STATE).decode()})")
            return None

        return check

    def configure(self, topo: Topology, rank: int, r: int) -> None:
        """A new epoch: this rank's replica rounds, and nothing newer than the resume step r is kept."""
        if self.repl is None:
            return
        assert self.w.comm is not None
        ecp = ec_plan(topo, rank, self.redundancy) if self.ec is not None else None
        if self.ec is not None:
            self.ec.plan = ecp
            for ph in self.ec.parity.values():
                ph.invalidate_after(r)
        self.repl.configure(self.w.comm, ReplicaPlan(shard=rank, send_to=topo.holders(rank),
                                                     recv_from=[(x, x) for x in topo.sources(rank)]),
                            self.ec if ecp is not None else None)
        for h in self.repl.holdings.values():
            h.invalidate_after(r)

    def close(self) -> None:
        if self.repl is not None:
            self.repl.close()
        if self.persister is not None:
            self.persister.close()

    def after_replication(self, step: int, received: dict[int, Holding]) -> None:
        """Runs on the replication thread once step's replicas committed; the committed half of
        `step` cannot change before this returns, so the persistent tier stages it here."""
        if self.w.topo is None:
            return
        tr = self.w.trainer
        if self.w.persister is not None and self.w.persister.due(step):
            half = tr.state.half_with(step)
            if half is not None:
                lay = self.w.topo.layout
                meta: dict[str, Any] = {
                    "rank": self.w.rank, "shards": self.w.topo.world, "numel": tr.flat.numel,
                    "shard_numel": tr.flat.shard_numel, "epoch": self.w.epoch, "seed": self.w.cfg.seed,
                    "buffer_bytes": tr.flat.buffer_bytes if lay.trivial else 0, "tp": lay.tp, "pp": lay.pp,
                    "config": json.loads(self.w.cfg.to_json()), "full_numel": tr.full_numel}
                if not lay.trivial and lay.dp_rank(self.w.rank) == 0:  # the stage's map onto the full model
                    meta["segments"] = torch.tensor(tr.segs, dtype=torch.int64).reshape(-1)
                self.w.persister.stage(step, tr.state.data[half], meta,
                                       buffers=tr.flat.buffers_at(step) if self.w.rank == 0 and lay.trivial else None)
        self.w.inject.corrupt_replicas(step, received)

    def descriptor(self, err: str, t_err: float) -> Descriptor:
        """What this worker holds, for the planner: parameter steps, own shard and replicas with checksums."""
        tr = self.w.trainer
        d = Descriptor(wid=self.w.wid, t=t_err, error=err[:300], bad_sources=list(self.w.bad_sources))
        if tr is None:  # a 3D spare that was never promoted holds nothing
            return d
        tp, pp = self.w.cfg.tp, self.w.cfg.pp
        d.params = tr.steps_held()
        d.stage = f"pp{self.w.stage_of[0]}.tp{self.w.stage_of[1]}" if self.w.stage_of else ""
        for x in (0, 1):
            st = tr.state.step_of(x)
            idx, count = tr.state.shard_of(x)
            if st != INVALID and count > 0:
                d.own.setdefault(shard_name(idx, count, tp, pp), {})[st] = tr.state.known_crc(x)
        if self.w.repl is not None:
            for shard, h in self.w.repl.holdings.items():
                for x in (0, 1):
                    st = h.step_of(x)
                    if st == INVALID:
                        continue
                    idx, count = h.shard_of(x)
                    name = shard_name(idx if count else shard, count or tr.flat.shards * tp * pp, tp, pp)
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
                    members = [shard_name(i, info.world, tp, pp) for i in info.members]
                    name = parity_name(members, info.j)
                    if ph.verify(x):
                        d.parity.setdefault(name, {})[st] = {"crc": ph.crc_of(x), "j": info.j, "h": info.h,
                                                             "gid": gid, "members": members,
                                                             "mcrc": list(info.mcrc)}
                    else:
                        d.rejected.append((name, st))
        return d

