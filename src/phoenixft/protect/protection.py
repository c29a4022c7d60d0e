"""The protection layer of one worker: what keeps each committed step recoverable, off the critical path.

- the redundancy scheme (scheme.py, chosen by `make_scheme` from `--redundancy`): after every step,
  on the replication thread (replication.py), the committed half of the optimizer shard goes to its
  replica holders (`replicas:K`, topology.py: data-parallel peers of the same stage on other nodes)
  or into its group's parity blocks (`ec:D+H`);
- the persistent tier (persist.py): every `--persist-every` steps the committed half (with the
  stage's map onto the full model under 3D parallelism) is staged for a background DCP write, and so is
  the step a stop of the whole job ends at (coordinator/stop.py);
- the descriptor: at a failure, what this worker holds (parameter steps, its own shard and what
  its scheme keeps for others, with their checksums) for the recovery planner (recovery/planner.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from phoenixft.config.protection import PERSIST_CLOSE_S
from phoenixft.controlplane import Store, exists_many, keys, sealed
from phoenixft.controlplane.signed import run_ended
from phoenixft.core.context import RankContext
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import PeerFailure, RunAborted
from phoenixft.protect import scrub_repair
from phoenixft.protect.persist import Persister
from phoenixft.protect.redundancy.erasure import ErasureScheme
from phoenixft.protect.redundancy.scheme import Redundancy
from phoenixft.protect.replicas import ReplicaScheme
from phoenixft.protect.replication import Replicator
from phoenixft.protect.scheme import RedundancyScheme
from phoenixft.protect.scrub import Finding, HeldCopy, Scrubber
from phoenixft.protect.scrub_round import repair_round
from phoenixft.protect.snapshot import INVALID, Holding
from phoenixft.recovery.evidence import params_checksums
from phoenixft.recovery.planner import Descriptor

__all__ = ["Protection", "make_scheme"]


ROUND_NAP_S = 0.0005  # the longest nap between polls of the scrub repair round's exchanges
RUN_END_CHECK_S = 1.0  # a replication waiting on a stopped peer looks this often whether the run has ended


def make_scheme(redundancy: Redundancy, repl: Replicator, shm_base: Callable[[], str | None]) -> RedundancyScheme:
    """The scheme `--redundancy` names, on `repl`; `shm_base()`: the rank's shared-memory base now (None:
    private memory). The one place that looks at the kind."""
    if redundancy.kind == "ec":
        def parity_path(gid: int) -> str | None:
            base = shm_base()
            return base and f"{base}-par{gid}"

        return ErasureScheme(repl, redundancy, parity_path)
    return ReplicaScheme(repl)


def _no_code(d: int, h: int) -> Any:
    raise LookupError("a parity block under a scheme that keeps none")


class Protection:
    def __init__(self, ctx: RankContext, timeout_s: float) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        on = cfg.protect == "phoenix"
        # the replication and persist threads' client: short non-blocking calls only, so one serves both
        store = ctx.store.independent() if on else None
        self.bg_store = store
        self.repl: Replicator | None = None
        self.scheme: RedundancyScheme | None = None
        # --scrub-every N: the held copies re-verified at the start of each protection job (scrub.py)
        self.scrubber = Scrubber(cfg.scrub_every, self._held, self._repair, self._found,
                                 self._oldest) if on and cfg.scrub_every > 0 else None
        if on:
            self.repl = Replicator(
                None,  # type: ignore[arg-type]  # the trainer's shard, set when the worker partitions
                holding_factory=lambda s: Holding(ctx.trainer.flat.shard_numel, ctx.shm and f"{ctx.shm}-hold{s}",
                                                  rows=ctx.trainer.payload_rows),
                chunk_numel=int(cfg.chunk_mb * (1 << 20) / 4),
                abort_check=self._flag_check(store),  # type: ignore[arg-type]  # (on)
                timeout_s=timeout_s,
                on_in_flight=lambda s, joined: ctx.inject.at(s + 1, "replicate", joined),
                after_commit=self.after_replication,
                transport=cfg.replica_transport,
                before_job=self._scrub if self.scrubber is not None else None,
            )
            self.scheme = make_scheme(cfg.scheme, self.repl, lambda: ctx.shm)
        pstore = store if cfg.persist_every and on else None
        self.persister = Persister(cfg.persist_dir, cfg.persist_every, pstore,
                                   fenced=lambda: sealed.has(pstore, keys.fence(ctx.node_id))) if pstore else None

    # ---------------------------------------------------------------- scrubbing (protect/scrub.py)
    def _held(self) -> list[HeldCopy]:
        tr = self.ctx.trainer
        own = [HeldCopy("own", self.ctx.rank, tr.state)] if tr is not None and getattr(tr, "state", None) else []
        return own + (self.scheme.held() if self.scheme is not None else [])

    def _oldest(self) -> int:
        """The oldest step a recovery could resume from: the older of the steps the parameters are held at."""
        tr = self.ctx.trainer
        held = tr.steps_held() if tr is not None and getattr(tr, "flat", None) is not None else []
        return min(held, default=0)

    def _repair(self, found: list[tuple[HeldCopy, Finding]]) -> None:
        """The repair round of this job (scrub_round.py): every rank of the replication group, every job."""
        ctx, repl = self.ctx, self.repl
        assert repl is not None and repl.comm is not None and ctx.topo is not None
        tr, topo = ctx.trainer, ctx.topo
        ec = getattr(self.scheme, "ec", None)
        reqs = scrub_repair.requests(found, ctx.rank, topo, copies_kept=isinstance(self.scheme, ReplicaScheme),
                                     code=ec.code if ec is not None else _no_code,
                                     member_numel=tr.flat.shard_numel * tr.payload_rows)
        serve = scrub_repair.server(lambda: getattr(ctx.trainer, "state", None), lambda: repl.holdings)
        # (the round's exchanges are small and start the job: polled as often as the training thread's waits)
        repair_round(repl.comm.repl, repl.comm.world, lambda w, what: repl.wait_all(w, what, ROUND_NAP_S), reqs,
                     serve, repl.chunk,
                     lambda r: scrub_repair.worker_name(topo, r))

    def _scrub(self, step: int, abort: Any) -> None:
        """The scrubber's share of step `step`, on the replication thread before its job (a scrub that fails
        is said in the worker's log and never fails the replication)."""
        assert self.scrubber is not None
        try:
            self.scrubber.tick(abort)
        except (RunAborted, PeerFailure):  # the run ended, a recovery started: the job says so
            raise
        except Exception as e:  # noqa: BLE001 - scrubbing is a check: it must not take the protection down
            print(f"phoenixft worker {self.ctx.wid}: scrub before step {step}'s protection failed: "
                  f"{type(e).__name__}: {e}", flush=True)

    def _found(self, f: Finding) -> None:
        """A corrupt held half: one event (the live line, the report's `scrub`)."""
        ctx = self.ctx
        tp, pp = ctx.cfg.tp, ctx.cfg.pp
        c = next((c for c in self._held() if (c.kind, c.ident) == (f.kind, f.ident)), None)
        name = ""
        if c is not None and f.kind == "parity":
            from phoenixft.protect.redundancy.parity import ParityHolding, parity_name

            if isinstance(c.pp, ParityHolding):
                info = c.pp.info_of(f.half)
                name = parity_name([shard_name(i, info.world, tp, pp) for i in info.members], info.j)
        elif c is not None:
            idx, count = c.pp.shard_of(f.half)
            name = shard_name(idx, count, tp, pp) if count else ""
        ctx.event("scrub_found", node=ctx.node_id, rank=ctx.rank, copy=f.kind, shard=name, step=f.step,
                  repaired=f.repaired_from is not None, repaired_from=f.repaired_from, why_not=f.why_not or None,
                  repair_s=round(f.repair_s, 6))

    def _flag_check(self, store: Store) -> Any:
        every = store.abort_check_s  # the watcher sees a flag first: a costly round trip is only the fallback
        last = [0.0, 0.0]  # the last look at the flag; at the run's end (not urgent: once a second)
        notices: set[int] = set()  # epochs seen to end for a planned drain (a notice is never taken back)

        def check() -> str | None:
            """Why the replication of a step should give up: a recovery of this epoch, or (RunAborted) the
            end of the run: a peer that stopped mid-transfer (a hang, a timeout of the run) must not keep
            this node waiting out the replication timeout after the run has ended.

            An epoch that ends for a planned drain lets the job finish (every peer is alive; the worker waits
            for it before its descriptor) until the drain's end (`keys.drain_abort`): the coordinator sets it
            once every rank stopped, or once it stopped waiting for them (the drained node died: its notice
            ran out), and a job that waits on that node must give up then, or its rank misses the gather."""
            e = self.ctx.epoch
            if self.ctx.watcher.flagged(e):  # (the watcher raises a drain's flag only at the drain's end)
                return "recovery requested"
            now = time.monotonic()
            if now - last[0] < every:
                return None
            last[0] = now
            names = [keys.failflag(e)]
            if now - last[1] >= RUN_END_CHECK_S:  # (a TCPStore answers one key per round trip: not every poll)
                last[1] = now
                names.append(keys.RUN_STATE)
            failed, *over = exists_many(store, names)
            if failed and sealed.has(store, names[0]):  # (a forged flag is ignored)
                if e not in notices and sealed.has(store, keys.drain_notice(e)):
                    notices.add(e)
                if e not in notices or sealed.has(store, keys.drain_abort(e)):  # (looked at only in a drain)
                    return "recovery requested"
            ended = run_ended(store, self.ctx.run_id) if any(over) else None  # (a forged end is ignored)
            if ended is not None:
                raise RunAborted(f"run ended ({ended})")
            return None

        return check

    def configure(self, topo: Topology, rank: int, r: int) -> None:
        """A new epoch: this rank's part in the scheme, and nothing newer than the resume step r is kept."""
        if self.scheme is None:
            return
        assert self.ctx.comm is not None
        self.scheme.configure(self.ctx.comm, topo, rank, r)

    def close(self) -> None:
        if self.scheme is not None:
            self.scheme.close()
        if self.persister is not None:
            self.persister.close()

    def after_replication(self, step: int, received: dict[int, Holding]) -> None:
        """Runs on the replication thread once step's replicas committed; the committed half of
        `step` cannot change before this returns, so the persistent tier stages it here."""
        ctx = self.ctx
        if ctx.topo is None:
            return
        tr = ctx.trainer
        # the step a stop of the whole job ends at is written too, whatever --persist-every says (waited for:
        # it is the checkpoint the job resumes from)
        stopping = self.persister is not None and ctx.watcher.persist_step(ctx.epoch) == step
        if self.persister is not None and (self.persister.due(step) or stopping) and hasattr(tr, "persist_item"):
            item = tr.persist_item(step, ctx)  # (a script's snapshot halves: api/state.py)
            if item is not None:
                data, meta_, buffers = item
                self.persister.stage(step, data, meta_, buffers=buffers, wait_s=PERSIST_CLOSE_S if stopping else 0.0)
        elif self.persister is not None and (self.persister.due(step) or stopping):
            half = tr.state.half_with(step)
            if half is not None:
                lay = ctx.topo.layout
                meta: dict[str, Any] = {
                    "rank": ctx.rank, "shards": ctx.topo.world, "numel": tr.flat.numel,
                    "shard_numel": tr.flat.shard_numel, "epoch": ctx.epoch, "seed": ctx.cfg.seed,
                    "buffer_bytes": tr.flat.buffer_bytes if lay.trivial else 0, "tp": lay.tp, "pp": lay.pp,
                    "config": json.loads(ctx.cfg.to_json()), "full_numel": tr.full_numel}
                if not lay.trivial and lay.dp_rank(ctx.rank) == 0:  # the stage's map onto the full model
                    meta["segments"] = torch.tensor(tr.segs, dtype=torch.int64).reshape(-1)
                self.persister.stage(step, tr.state.data[half], meta,
                                     buffers=tr.flat.buffers_at(step) if ctx.rank == 0 and lay.trivial else None,
                                     wait_s=PERSIST_CLOSE_S if stopping else 0.0)
        ctx.inject.corrupt_replicas(step, received)
        ctx.inject.at_rest(step)

    def descriptor(self, err: str, t_err: float) -> Descriptor:
        """What this worker holds, for the planner: parameter steps, own shard and what its scheme keeps
        for others, with checksums."""
        ctx = self.ctx
        tr = ctx.trainer
        d = Descriptor(wid=ctx.wid, t=t_err, error=err[:300], bad_sources=list(ctx.bad_sources))
        if tr is None:  # a 3D spare that was never promoted holds nothing
            return d
        tp, pp = ctx.cfg.tp, ctx.cfg.pp
        d.params = tr.steps_held()
        d.params_crc = params_checksums(tr.flat)
        d.stage = f"pp{ctx.stage_of[0]}.tp{ctx.stage_of[1]}" if ctx.stage_of else ""
        for x in (0, 1):
            st = tr.state.step_of(x)
            idx, count = tr.state.shard_of(x)
            if st != INVALID and count > 0:
                d.own.setdefault(shard_name(idx, count, tp, pp), {})[st] = tr.state.known_crc(x)
        if self.scheme is not None:
            self.scheme.describe(d, tr.flat.shards, tp, pp)
        return d
