"""A script's rank in the job: the core's `Member` with a script's state (api/state.py) and group.

It differs from the built-in trainer's worker only where the state differs:

- `_restore`: the epoch's `user` group is bound to the job's `ResilientGroup` (the script's DDP, FSDP and
  `dist.*` calls go there), the shard capacity the ranks agreed on is applied, and the plan's path is
  carried out on the snapshot halves (`init`: rank 0's model broadcast, as DDP does at construction, and
  step 0 snapshotted on every rank; `in_place`: recovery/restore.py as for the built-in trainer; a
  resize: every rank keeps its own side, a new rank gets the replicated side from a peer); the live
  objects then load the resume step;
- a failure seen by the watcher severs the epoch's connections at once (`sever`): a collective the
  script is blocked in (DDP's gradient reduction, its own `all_reduce`) raises instead of waiting out
  its timeout on a dead or stopped peer, and the script's `with job.step(...)` recovers;
- the run's end, seen at most once a second, does the same, so a rank blocked on a peer that stopped
  for good leaves.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.api.group import ResilientGroup
from phoenixft.api.packing import check_restorable, used_bytes
from phoenixft.api.state import DEFAULT_PRIVATE_BYTES, ScriptState, capacity_for
from phoenixft.api.tracked import is_sharded
from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import parse_int
from phoenixft.core.member import Member
from phoenixft.distributed.comm import alltoallv
from phoenixft.distributed.topology import Topology
from phoenixft.errors import NOT_INSTALLED, PeerFailure, RunAborted
from phoenixft.faults.inject import FaultInjector
from phoenixft.protect.persist import load_into as persist_load
from phoenixft.protect.snapshot import H_SHARD, H_SHARDS, H_VALID, checksum
from phoenixft.recovery import restore

__all__ = ["ScriptMember", "PRIVATE_KEY"]

PRIVATE_KEY = keys.SCRIPT_PRIVATE_BYTES  # the shard capacity the ranks agreed on (sealed; only ever raised)
END_LOOK_S = 1.0


class ScriptMember(Member):
    """One rank of a user's script across the run's epochs."""

    user_group = True

    def __init__(self, store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                 incarnation: int = 0) -> None:
        super().__init__(store_addr, node_id, local_rank, run_id, threads, incarnation)
        cfg, cur = self.cfg, self.start_topo
        self.script = ScriptState(self.device, self.agreed_private() or DEFAULT_PRIVATE_BYTES)
        self.ctx.trainer = self.script  # type: ignore[assignment]  # (the role the built-in Trainer plays)
        self.ctx.stage_of = (0, 0)
        world, gen = (cur.world, int(cur.meta.get("generation", 0))) if cur is not None else (cfg.world, 0)
        self.ctx.partition(world, gen)
        self.inject = self.ctx.inject = FaultInjector(self.ctx)
        self._attach_protection(gen)
        self.group: ResilientGroup | None = None
        self.on_joined: list[Any] = []  # the job's hooks after every join (its DDP rebuilt, grads cleared)
        self.watcher.on_raise = lambda e: self.sever(e)
        self._closing = threading.Event()
        threading.Thread(target=self._watch_end, name="phoenixft-run-end", daemon=True).start()

    # ---------------------------------------------------------------- failures seen off the training thread
    def sever(self, epoch: int) -> None:
        """The epoch's groups retired now (their connections cut): whatever the script waits on in them raises."""
        comm = self.ctx.comm
        if comm is not None and comm.epoch == epoch:
            comm.retire(0.0)

    def _watch_end(self) -> None:
        while not self._closing.wait(END_LOOK_S):
            try:
                ended = self._run_end()
            except Exception:  # noqa: BLE001 - no control plane now: the watcher and the waits decide
                continue
            if ended is not None and ended != "done":
                comm = self.ctx.comm
                if comm is not None:
                    comm.retire(0.0)

    def close(self) -> None:
        self._closing.set()
        self.watcher.close()
        self.protection.close()
        self.keeper.stop()

    def report(self, err: str) -> Topology:
        self.script.settle()  # (a snapshot's copy in flight completes: the descriptor says what the halves hold)
        return super().report(err)

    # ---------------------------------------------------------------- the shard capacity
    def agreed_private(self) -> int:
        return parse_int(sealed.get(self.ctx.store, PRIVATE_KEY), PRIVATE_KEY, 0) or 0

    def raise_private(self, needed: int) -> None:
        """Ask for a larger shard capacity for every rank (it takes effect at the next epoch)."""
        cap = max(capacity_for(needed), self.script.private_bytes)
        cur = self.agreed_private()
        if cap > cur:
            sealed.put(self.ctx.store, PRIVATE_KEY, str(cap))

    def _apply_private(self) -> None:
        agreed = self.agreed_private()
        if agreed and agreed != self.script.private_bytes:
            self.script.resize_private(agreed)
            if self.ctx.scheme is not None:  # (its copies have the old size: the new epoch's protection makes new ones)
                self.ctx.scheme.drop()
                self.ctx.scheme.attach(self.script.state)

    # ---------------------------------------------------------------- joining an epoch
    def _restore(self, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
        comm = self.ctx.comm
        assert comm is not None and self.group is not None
        self.group.bind(comm.user, self.ctx.rank, topo.world)
        path = restore.path_of(topo)
        self._apply_private()
        if path == "init":
            self._init_state(topo, timings)
            return
        if self.script.flat.shards != topo.layout.dp and path == "in_place":
            # a spare built for the initial world, promoted into a resized one: it holds nothing yet
            self.ctx.repartition(topo.world, int(topo.meta.get("generation", 0)), r)
        if path == "in_place":
            restore.restore_in_place(self.ctx, topo, r, timings, bad)
        elif path == "reshard":
            self._resize(topo, r, old_rank, timings)
        else:
            self._from_disk(topo, r, timings)
        self.script.resume(r)
        self.script.load(r)

    def _init_state(self, topo: Topology, timings: dict[str, Any]) -> None:
        """Epoch 0 (or a fresh start): every rank holds what rank 0 built (its parameters and buffers
        broadcast, as DDP does at construction; what a rank holds of step 0 already, loaded first), the
        ranks agree on the shard capacity, and step 0 is snapshotted everywhere."""
        t0 = time.time()
        st = self.script
        if st.flat.half_with(0) is not None and self.script.state.half_with(0) is not None:
            st.load(0)  # (a fresh start after a failure in step 1: what step 1 changed goes)
        comm = self.ctx.comm
        assert comm is not None
        # (a sharded parameter, FSDP2's, is each rank's own part: nothing to broadcast; a replicated DTensor is
        # broadcast as its local tensor)
        tensors = [t.to_local() if hasattr(t, "to_local") else t
                   for e in st.tracked.models for t in [*e.obj.parameters(), *e.obj.buffers()] if not is_sharded(t)]
        _broadcast(comm.user, [t.data for t in tensors], self.ctx.wait)
        need = torch.tensor([st.private_size()], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        self.ctx.wait(comm.train.allreduce([need], opts), "the ranks' own state sizes")
        cap = max(capacity_for(int(need)), self.agreed_private())
        if self.ctx.rank == 0 and cap != self.agreed_private():
            sealed.put(self.ctx.store, PRIVATE_KEY, str(cap))
        if cap != st.private_bytes:
            st.resize_private(cap)
            if self.ctx.scheme is not None:
                self.ctx.scheme.drop()
                self.ctx.scheme.attach(st.state)
        st.flat.invalidate()
        try:  # (a state a snapshot could not read back would fail only in a recovery: said now)
            check_restorable(st.tracked.replicated(0))
            check_restorable(st.tracked.private())
        except TypeError as e:
            self._stop_run(str(e))
            raise RunAborted(str(e)) from None
        st.snapshot(0, self.ctx.rank, topo.world)
        st.settle()  # (step 0 is the recovery point the invariants check)
        timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0)

    def _resize(self, topo: Topology, r: int, old_rank: int, timings: dict[str, Any]) -> None:
        """A shrink or a grow: every rank that was a member keeps its own side of step r and rolls back to it;
        a new rank gets the replicated side from the plan's source and starts its own side empty (a departed
        rank's own state, a stateful loader's position over its stream, is not re-divided)."""
        t0 = time.time()
        comm = self.ctx.comm
        assert comm is not None
        meta, me, w = topo.meta["reshard"], self.ctx.rank, topo.world
        st = self.script
        has = old_rank >= 0 and st.flat.select(r)
        params_to = {int(k): v for k, v in meta["params_to"].items()}
        if me not in params_to and not has:
            raise RunAborted(f"rank {me} has no state of step {r} and the plan sends it none")
        sends = {dst: st.flat.whole for dst, src in params_to.items() if src == me and has}
        size = torch.tensor([st.flat.size_at(r) if has else 0], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        self.ctx.wait(comm.train.allreduce([size], opts), "the state's size")
        recv = {params_to[me]: int(size)} if me in params_to else {}
        work, _, got = alltoallv(comm.train, w, sends, recv, dtype=torch.uint8)
        self.ctx.wait(work, "state transfer")
        self.ctx.repartition(w, int(topo.meta["generation"]), r)
        if me in params_to:
            st.flat.install(got[params_to[me]], r)
        st.state.invalidate_after(r)
        own = st.state.half_with(r) if old_rank >= 0 else None
        if own is None:  # (a new rank: its own side as the script built it, of step r)
            st.commit_private(r, me, w)
        else:  # (its own side, now the shard of its new rank)
            st.state.header[own, H_SHARD], st.state.header[own, H_SHARDS] = me, w
        timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0,
                       bytes_params=int(size) if me in params_to else 0)

    def _from_disk(self, topo: Topology, r: int, timings: dict[str, Any]) -> None:
        """Every rank reloads step r from the persistent tier: the replicated side (rank 0 wrote it), and its own
        side where the checkpoint has one for its rank (a rank beyond the checkpoint's world starts its own side
        as the script built it). A checkpoint that does not read back as written is never installed."""
        t0 = time.time()
        man, me, st = topo.meta["manifest"], self.ctx.rank, self.script
        root, old_world = Path(man["path"]), int(man["shards"])
        try:
            rep_sd = {"buffers": torch.empty(int(man["buffer_bytes"]), dtype=torch.uint8)}
            persist_load(rep_sd, str(root / "rank0"))
            own = None
            if me < old_world:
                priv_sd = {"shard": torch.empty(1, int(man["shard_numel"]))}
                persist_load(priv_sd, str(root / f"rank{me}"))
                if checksum(priv_sd["shard"]) != int(man.get("crc", {}).get(str(me), -1)):
                    raise OSError(f"rank{me}'s shard does not match the checksum written with it")
                own = priv_sd["shard"].reshape(-1).view(torch.uint8)
        except (OSError, KeyError, ValueError) as e:
            raise PeerFailure(f"{NOT_INSTALLED} (step {r}): {e}") from None
        self.ctx.repartition(topo.world, int(topo.meta.get("generation", 0)), r)
        st.flat.invalidate()
        st.flat.install(rep_sd["buffers"], r)
        need = used_bytes(own) if own is not None else 0
        if need > st.private_bytes:
            st.resize_private(capacity_for(need))
        if own is None:
            st.commit_private(r, me, topo.world)
        else:
            ph = st.state.staging()
            st.state.begin_write(ph)
            st.state.data[ph, 0].view(torch.uint8)[:need].copy_(own[:need])
            st.state.commit(ph, r, checksum(st.state.payload(ph)), (me, topo.world))
            st.state.header[1 - ph, H_VALID] = 0
        if self.ctx.scheme is not None:
            self.ctx.scheme.drop()
            self.ctx.scheme.attach(st.state)
        timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0,
                       bytes_params=int(rep_sd["buffers"].numel()))

    def _joined(self, topo: Topology, r: int) -> None:
        for hook in self.on_joined:
            hook()

    # ---------------------------------------------------------------- the end
    def final(self, step: int) -> None:
        """The run's final state: sha256 over the replicated side and every rank's own side, in rank order;
        rank 0 publishes it and the run's end."""
        comm, topo = self.ctx.comm, self.ctx.topo
        assert comm is not None and topo is not None
        if self.ctx.scheme is not None:
            self.ctx.scheme.wait(step)
        if self.cfg.protect != "phoenix":  # (unprotected: the final state packed now, for its hash)
            self.script.snapshot(step, self.ctx.rank, topo.world)
        self.script.settle()
        rep, priv = self.script.digest(step)
        mine = torch.frombuffer(bytearray(rep + priv), dtype=torch.uint8)
        out = torch.empty(topo.world * 64, dtype=torch.uint8)
        self.ctx.wait(comm.train._allgather_base(out, mine), "final state digests")
        if self.ctx.rank != 0:
            self.await_end()
            return
        import hashlib

        h = hashlib.sha256(rep)
        for r in range(topo.world):
            h.update(out[r * 64 + 32 : (r + 1) * 64].numpy().tobytes())
        self.finish_hash(json.dumps({"sha256": h.hexdigest(), "step": step, "epoch": self.ctx.epoch, "path": ""}))


def _broadcast(pg: Any, tensors: list[torch.Tensor], wait: Any) -> None:
    """Every tensor as rank 0 has it, one flat broadcast per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (_dt, _dev), ts in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        wait(pg.broadcast([flat], opts), "the model as rank 0 built it")
        off = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n
