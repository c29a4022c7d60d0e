"""The restore paths: small functions that carry out one epoch's plan on one rank.

Each takes the rank (`RankContext`: its trainer, redundancy scheme and communicators), the new
topology and the resume step r, moves what the plan says, and appends to `bad` every copy that
failed verification against the checksum its source committed (invariant I3):

- `restore_in_place`: the same node count (hot-swap, in-place restart, cascade): survivors roll
  back to r from their own ping-pong halves; members that lack their shard or the parameters get
  them from the members the plan names (targeted all-to-all transfers);
- `reshard`: the world changes size (shrink, grow): every old shard's provider sends it to every
  member of its stage (all of them when data-parallel only), each member cuts its new slice;
- `restore_persistent`: every member reloads r from the persistent tier, cut for this world (a
  checkpoint that cannot be read or does not match its checksums is never installed).

A shard that has no copy left is rebuilt by the redundancy scheme (`ec:D+H`: from its group's pieces
of step r, the plan's `meta["decode"]`) on the first two paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.core.context import RankContext
from phoenixft.distributed.comm import alltoallv
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import PeerFailure, RunAborted
from phoenixft.parallel.layout import Layout
from phoenixft.parallel.logical import from_full
from phoenixft.protect.persist import NOT_INSTALLED, load_full
from phoenixft.protect.snapshot import H_CRC, H_VALID, PingPong, StreamChecksum, checksum
from phoenixft.recovery import transfer
from phoenixft.recovery.reshard import gather_full_optimizer, old_shard_numel

__all__ = ["path_of", "restore_in_place", "reshard", "restore_persistent", "init_replicas", "own_half_problem"]


def path_of(topo: Topology) -> str:
    """Which restore an epoch's plan takes (`Topology.restore_path`)."""
    return topo.restore_path


def _commit_received(m: RankContext, payload: torch.Tensor, r: int, crc: int, shard: int, world: int,
                     dp: int) -> None:
    """Install a verified payload as this rank's shard at step r (the master row from the
    parameters when the payload does not carry it; `dp` = the shard's slice of its stage)."""
    tr = m.trainer
    st, flat = tr.state, tr.flat
    half = st.staging()
    st.begin_write(half)
    st.payload(half).copy_(payload.view(tr.payload_rows, flat.shard_numel))  # (not -1: 0 rows, a stateless optimizer)
    if tr.payload_from == 1:
        st.data[half, 0].copy_(flat.flat[flat.shard_slice(dp)])
    st.commit(half, r, crc, (shard, world))
    st.header[1 - half, H_VALID] = 0


def _rebuild_lost(m: RankContext, topo: Topology, r: int, n: int, timings: dict[str, Any],
                  bad: list[str]) -> dict[int, tuple[torch.Tensor, int]]:
    """The shards the plan rebuilds by the redundancy scheme (`ec:D+H`: every rank takes part, it may
    hold a piece): {shard: (payload of n float32, checksum)} for this rank."""
    if not topo.meta.get("decode") or m.scheme is None:
        return {}
    return m.scheme.rebuild(m, topo, r, n, timings, bad)


@dataclass
class _XferGroup:
    """The epoch's transfer group: only the ranks that send or receive, several connections per pair."""

    pg: Any
    local: dict[int, int]  # epoch rank -> rank in the group
    me: int  # this rank's rank in the group (-1: not a member)
    world: int

    @classmethod
    def of(cls, m: RankContext) -> _XferGroup:
        assert m.comm is not None
        local = {rk: i for i, rk in enumerate(m.comm.xfer_members)}
        return cls(m.comm.xfer, local, local.get(m.rank, -1), len(local))

    def ranks(self, need: dict[int, list[int]]) -> dict[int, list[int]]:
        return {self.local[d]: [self.local[s] for s in srcs] for d, srcs in need.items()}

    def post(self, rounds: list[list[transfer.Piece]], sends: dict[int, torch.Tensor], into: torch.Tensor | None,
             **kw: Any) -> list[Any]:
        return transfer.post(self.pg, self.world, self.me, rounds, sends, into, **kw) if self.pg is not None else []


def _roll_back(m: RankContext, topo: Topology, r: int, mine: list[dict[str, Any]], bad: list[str]) -> bool:
    """Check what this rank restores from itself: the parameters of step r (unless the plan sends them:
    returns whether it does) and, on a survivor, its own committed half of r, verified."""
    tr, me = m.trainer, m.rank
    need_params = any(t["param_src"] >= 0 for t in mine)
    if not need_params and not tr.flat.select(r):
        raise RunAborted(f"rank {me} has no parameters for step {r}")
    if not any(t["opt_src"] >= 0 or "decode" in t or t.get("local") for t in mine):  # it keeps its own shard:
        # its committed half must hold r, as its checksum says
        tr.state.invalidate_after(r)
        half = tr.state.half_with(r)
        if half is None:
            raise RunAborted(f"rank {me} has no optimizer state for step {r}")
        problem = own_half_problem(tr.state, half)
        if problem:
            bad.append(f"own {topo.shard_name(me)} at step {r} {problem}")
    return need_params


def own_half_problem(st: PingPong, half: int) -> str | None:
    """Why a survivor's own committed half fails I3, or None when it matches the checksum recorded when it
    was written. A half whose checksum was never recorded (0: not computed yet) fails: nothing independent
    of these bytes vouches for them, and I3 never skips."""
    if int(st.header[half, H_CRC]) == 0:
        return "has no recorded checksum to verify it against"
    if not st.verify(half):
        return "does not match its committed checksum"
    return None


def _post_params(m: RankContext, topo: Topology, g: _XferGroup, need_params: bool, total: int
                 ) -> tuple[list[Any], Any]:
    """Post the parameter transfer of `total` elements, striped over every peer that holds them at r (bitwise
    identical there); returns (its works, the buffer it receives into or None)."""
    flat = m.trainer.flat
    elem = torch.empty((), dtype=flat.dtype).element_size()
    need = g.ranks(topo.param_need())
    rounds = transfer.schedule(need, total, transfer.chunk_numel(elem))
    on_host = flat.device.type == "cpu"
    sends: dict[int, torch.Tensor] = {}
    if any(p.src == g.me for rd in rounds for p in rd):
        src_buf = flat.whole if on_host else flat.whole.cpu()
        sends = {d: src_buf for d in need}
    into = (flat.receive_buffer(total) if on_host else torch.empty(total, dtype=flat.dtype)) if need_params else None
    return g.post(rounds, sends, into, dtype=flat.dtype), into


@dataclass
class _OptReceive:
    """The optimizer shard this rank receives as a copy (at most one), and where it lands."""

    copied: list[dict[str, Any]]  # the plan's transfers to this rank with a copy to send (ec: the others are rebuilt)
    works: list[Any]
    half: int = -1  # the staging half
    buf: torch.Tensor | None = None  # the staging half's payload itself (`in_place`), else a private buffer
    in_place: bool = False
    hasher: StreamChecksum | None = None


def _post_optimizer(m: RankContext, topo: Topology, r: int, g: _XferGroup, mine: list[dict[str, Any]]) -> _OptReceive:
    """Post the optimizer-shard transfer from a verified copy, received straight into the staging half
    (unless that holds a committed step) and checksummed chunk by chunk as it arrives."""
    tr, w = m.trainer, topo.world
    st = tr.state
    sends = {}
    for t in topo.transfers:
        if t["opt_src"] == m.rank:
            payload = m.copy_of(t["shard"], w, r).reshape(-1)
            if m.inject.corrupts_transfers(topo):  # fault injection: corruption in flight
                payload = payload.clone()
                payload[:: max(1, payload.numel() // 7)] += 1.0
            sends[g.local[t["dst"]]] = payload
    rx = _OptReceive(copied=[t for t in mine if t["opt_src"] >= 0], works=[])
    n_opt = tr.payload_rows * tr.flat.shard_numel
    rounds = transfer.schedule(g.ranks(topo.opt_need()), n_opt, transfer.chunk_numel(4))
    if rx.copied:
        rx.half = st.staging()
        if int(st.header[rx.half, H_VALID]):  # it holds a committed step: keep it until the copy verified
            rx.buf = torch.empty(n_opt)
        else:
            st.begin_write(rx.half)
            rx.buf = st.payload(rx.half).reshape(-1)
            rx.in_place = True
        rx.hasher = StreamChecksum(rx.buf)
    rx.works = g.post(rounds, sends, rx.buf)
    return rx


def _commit_copies(m: RankContext, topo: Topology, r: int, rx: _OptReceive, timings: dict[str, Any],
                   bad: list[str]) -> None:
    """Verify the received copy against the checksum its owner committed (I3) and commit it as step r."""
    st, w = m.trainer.state, topo.world
    for t in rx.copied:
        assert rx.buf is not None and rx.hasher is not None
        name = topo.shard_name(t["shard"])
        if rx.hasher.value(rx.buf.numel()) != t["crc"]:
            src = f"{topo.node_of_rank(t['opt_src'])}.{t['opt_src'] % topo.workers_per_node}"
            bad.append(f"{name} from {src} does not match the checksum committed for step {r}")
            m.bad_sources.append((name, r, src))
            continue
        if rx.in_place:  # the half holds the payload and its master row: commit it
            st.commit(rx.half, r, t["crc"], (t["shard"], w))
            st.header[1 - rx.half, H_VALID] = 0
        else:
            _commit_received(m, rx.buf, r, t["crc"], t["shard"], w, topo.layout.dp_rank(t["shard"]))
        timings.update(bytes_opt=rx.buf.numel() * 4)


def _install_local(m: RankContext, topo: Topology, r: int, mine: list[dict[str, Any]], bad: list[str]) -> None:
    """Install the copy of its own shard that this rank's scheme keeps, verified against the checksum its owner
    committed (I3), where the plan names no other holder."""
    for t in mine:
        if not t.get("local"):
            continue
        payload = m.copy_of(t["shard"], topo.world, r).reshape(-1)
        if checksum(payload) != t["crc"]:
            bad.append(f"{topo.shard_name(t['shard'])} kept on rank {m.rank} does not match the checksum committed "
                       f"for step {r}")
            continue
        _commit_received(m, payload, r, t["crc"], t["shard"], topo.world, topo.layout.dp_rank(t["shard"]))


def restore_in_place(m: RankContext, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
    """Roll survivors back to step r and move what the plan says to the members that lack it.

    Both transfers are targeted collectives (all-to-all with only the involved pairs non-empty):
    parameters (with the buffers) from a member that holds them at r, the optimizer shard from a
    member that holds a verified copy (its own committed state or a replica), matched by logical
    shard id and verified against the checksum its owner committed (I3). Both are posted at once, so
    that the link never idles between them; every member posts the same rounds in the same order
    (gloo matches them by order).
    """
    assert m.comm is not None
    tr = m.trainer
    flat = tr.flat
    mine = [t for t in topo.transfers if t["dst"] == m.rank]
    need_params = _roll_back(m, topo, r, mine, bad)
    # who holds what is settled: wait until every member is here (so the transfer times below are the
    # bytes moving, not a peer still rolling back), then move the parameters, then the optimizer shards
    t0 = time.time()
    # (where the parameters' side has no fixed size, a script's packed state, its size rides on it: every
    # member that holds step r has the same bytes and says how many, the others 0; a stage's flat buffers
    # have their size, each stage its own)
    variable = getattr(flat, "variable_size", False)
    size = torch.tensor([0 if need_params or not variable else flat.size_at(r)], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    m.wait(m.comm.train.allreduce([size], opts), "recovery transfer start")
    g = _XferGroup.of(m)
    t1 = time.time()
    p_works, into = _post_params(m, topo, g, need_params, int(size) if variable else flat.size_at(r))
    rx = _post_optimizer(m, topo, r, g, mine)
    t_posted = time.time()
    transfer.wait_all(p_works, m.wait, "parameter transfer")
    t_moved = time.time()
    if into is not None:
        timings["bytes_params"] = into.numel() * into.element_size()
        if flat.device.type == "cpu":
            flat.adopt_received(r, into.numel())
        else:
            flat.install(into, r)
    t2 = time.time()
    m.inject.in_recovery(topo)  # (the optimizer shards are still moving)
    if rx.in_place and tr.payload_from == 1:  # the master row from the parameters, while the shard is moving
        (t,) = rx.copied
        tr.state.data[rx.half, 0].copy_(flat.flat[flat.shard_slice(topo.layout.dp_rank(t["shard"]))])
    transfer.wait_all(rx.works, m.wait, "optimizer-state transfer", rx.hasher.update if rx.hasher is not None else None)
    timings.update(transfer_post_s=t_posted - t1, params_moved_s=t_moved - t1, params_adopt_s=t2 - t_moved,
                   opt_moved_s=time.time() - t2)
    _commit_copies(m, topo, r, rx, timings, bad)
    _install_local(m, topo, r, mine, bad)
    rebuilt = _rebuild_lost(m, topo, r, tr.payload_rows * flat.shard_numel, timings, bad)
    for shard, (payload, crc) in rebuilt.items():
        _commit_received(m, payload, r, crc, shard, topo.world, topo.layout.dp_rank(shard))
    timings.update(transfer_sync_s=t1 - t0, restore_params_s=t2 - t1, restore_opt_s=time.time() - t2)


def reshard(m: RankContext, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
    """Shrink or grow: repartition the state of step r over the new world (see reshard.py)."""
    assert m.comm is not None
    tr = m.trainer
    meta, pg, me, w = topo.meta["reshard"], m.comm.train, m.rank, topo.world
    t1 = time.time()
    has_params = tr.flat.select(r) if old_rank >= 0 else False
    params_to = {int(k): v for k, v in meta["params_to"].items()}
    if me not in params_to and not has_params:
        raise RunAborted(f"rank {me} has no parameters for step {r}")
    # parameters and buffers do not depend on the partition: whoever lacks them gets a peer's
    packed = tr.flat.packed() if any(src == me for src in params_to.values()) else None
    sends = {dst: packed for dst, src in params_to.items() if src == me and packed is not None}
    recv = {params_to[me]: tr.flat.packed_numel} if me in params_to else {}
    work, _, got = alltoallv(pg, w, sends, recv, dtype=tr.flat.dtype)
    m.wait(work, "parameter transfer")
    if me in params_to:
        tr.flat.install_packed(got[params_to[me]], r)
    t2 = time.time()
    m.inject.in_recovery(topo)  # kill:...@recovery=N: between the parameters and the optimizer state
    old_world = meta["old_world"]
    # this rank's stage: its old shards (by data-parallel index) and who provides them, and its new peers
    old_lay, lay = Layout(old_world, topo.tp, topo.pp), topo.layout
    stage = lay.coord(me).stage
    ids = {old_lay.dp_rank(i): i for i in range(old_world) if old_lay.coord(i).stage == stage}
    providers = {j: int(meta["providers"][str(i)][0]) for j, i in ids.items()}
    n_old = old_shard_numel(tr.flat.numel, old_lay.dp)
    decoded = _rebuild_lost(m, topo, r, tr.payload_rows * n_old, timings, bad)  # no copy left: rebuilt by its provider
    mine = {j: (decoded[i][0] if i in decoded else torch.zeros(tr.payload_rows * n_old))
            if meta["providers"][str(i)][1] == "decode" else m.copy_of(i, old_world, r)
            for j, i in ids.items() if providers[j] == me}
    full = gather_full_optimizer(pg, w, me, providers, mine, n_old, m.wait, rows=tr.payload_rows,
                                 peers=None if lay.trivial else lay.dp_group(me))
    for j, i in ids.items():  # I3: every old shard of the stage as its owner committed it
        prov, _kind, crc = meta["providers"][str(i)]
        if checksum(full[:, j * n_old : (j + 1) * n_old].contiguous()) != crc:
            bad.append(f"{shard_name(i, old_world, topo.tp, topo.pp)} from rank {prov} does not match the checksum "
                       f"committed for step {r}")
    m.repartition(w, int(topo.meta["generation"]), r)  # the new flat buffers start from the model as it is (r)
    flat, st = tr.flat, tr.state
    numel = flat.numel
    sl = flat.shard_slice(lay.dp_rank(me))
    rows = torch.zeros(tr.payload_rows, flat.padded)
    rows[:, :numel] = full[:, :numel]
    st.begin_write(0)
    st.data[0, tr.payload_from :].copy_(rows[:, sl])
    if tr.payload_from == 1:
        st.data[0, 0].copy_(flat.flat[sl])
    st.commit(0, r, checksum(st.payload(0)), (me, w))  # I3 later verifies it against what was written now
    st.header[1, H_VALID] = 0
    _replicas_from_whole_state(m, topo, r, rows)
    timings.update(restore_params_s=t2 - t1, restore_opt_s=time.time() - t2, bytes_opt=full.numel() * 4)


def init_replicas(m: RankContext, topo: Topology) -> None:
    """Epoch 0, a fresh start: the state of step 0 is the model as built under the seed (which every
    member has) and a zero optimizer state, so each member writes the replicas the ring gives it
    itself, as `Trainer.init_shard` writes its own shard. Without them a node lost during step 1,
    before the first replication landed, lost the run ("in-memory state lost" at step 0)."""
    tr = m.trainer
    flat = tr.flat
    master = None
    if tr.payload_from == 0:  # the fp32 master weights are part of the payload (bf16 parameters)
        master = torch.zeros(flat.padded)
        master[: flat.numel] = flat.init_master.cpu()

    def fill(rows: torch.Tensor, sl: slice) -> None:
        rows.zero_()
        if master is not None:
            rows[0].copy_(master[sl])

    _keep_replicas(m, topo, 0, fill)


def _replicas_from_whole_state(m: RankContext, topo: Topology, r: int, rows: torch.Tensor) -> None:
    """After a reshard or a reload from the persistent tier every member has the whole optimizer state
    of step r (`rows`: the payload rows, padded to the new partition): it keeps, at once, the replicas
    the new epoch's ring gives it, so each new shard has its copies on other nodes before training
    resumes. Otherwise the new shards would exist only on their owners until the first replication of
    the new epoch lands, and a node lost in that window (a repaired node that dies again right after
    it was grown back in) would lose the run (or, after a reload, take it back to the disk)."""
    _keep_replicas(m, topo, r, lambda out, sl: out.copy_(rows[:, sl]))


def _keep_replicas(m: RankContext, topo: Topology, r: int, fill: Callable[[torch.Tensor, slice], Any]) -> None:
    """Commit, as step r, what the scheme keeps for other ranks (`replicas:K`: the replica of every shard
    the ring gives this rank): `fill(rows, slice)` writes the shard's payload rows (`slice`: its range of
    the padded flat state). Parity (`ec:D+H`) is encoded by its next job instead (it needs the group's
    exchange)."""
    if m.scheme is None:
        return
    tr, lay = m.trainer, topo.layout

    def shard_rows(src: int, out: torch.Tensor) -> None:
        # (not view(rows, -1): a stateless optimizer's fp32 payload has no row, and every node failed its epoch-0 join)
        fill(out.view(tr.payload_rows, tr.flat.shard_numel), tr.flat.shard_slice(lay.dp_rank(src)))

    m.scheme.keep(topo, m.rank, r, shard_rows)


def restore_persistent(m: RankContext, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
    """Every member reloads step r from the persistent tier (resharded to this world size)."""
    t0 = time.time()
    tr = m.trainer
    man = topo.meta["manifest"]
    if topo.layout.dp != tr.flat.shards:
        m.repartition(topo.world, int(topo.meta.get("generation", 0)), r)
    m.inject.in_recovery(topo)  # kill:...@recovery=N: before the reload
    # the coordinator verified the checkpoint before choosing it (persist.check); should it have changed
    # since, nothing of it is installed: the recovery starts again and the coordinator, told by this error
    # (its descriptor), chooses the newest checkpoint that verifies other than this one
    try:
        full, buffers, mismatched = load_full(man)  # (rows, full numel), shards whose checksum does not match
    except OSError as e:
        raise PeerFailure(f"{NOT_INSTALLED} (step {r}): {e}") from None
    if mismatched:
        raise PeerFailure(f"{NOT_INSTALLED} (step {r}): shard(s) {mismatched} in {man['path']} do not match "
                          "their checksums")
    flat, st = tr.flat, tr.state
    if full.shape[0] != tr.rows:
        raise RunAborted(f"the checkpoint of step {r} has {full.shape[0]} state rows, this run's optimizer "
                         f"needs {tr.rows}")
    padded = torch.zeros(tr.rows, flat.padded)
    padded[:, : flat.numel] = from_full(full, tr.segs, flat.numel)  # this rank's stage (any layout wrote it)
    flat.install(padded[0].to(flat.dtype), r)
    if buffers is not None:
        flat.set_buffers(buffers, save=True)
    half = st.staging()
    st.begin_write(half)
    st.data[half].copy_(padded[:, flat.shard_slice(topo.layout.dp_rank(m.rank))])
    st.commit(half, r, checksum(st.payload(half)), (m.rank, topo.world))  # (recorded as it is written)
    st.header[1 - half, H_VALID] = 0
    if m.scheme is not None:
        m.scheme.invalidate_after(-1)
    _replicas_from_whole_state(m, topo, r, padded[tr.payload_from :])
    timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0, bytes_params=full.numel() * 4)
