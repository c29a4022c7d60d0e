"""The restore paths: small functions that carry out one epoch's plan on one rank.

Each takes the rank (`Member`: the worker's trainer, protection and communicators), the new
topology and the resume step r, moves what the plan says, and appends to `bad` every copy that
failed verification against the checksum its source committed (invariant I3):

- `restore_in_place`: the same node count (hot-swap, in-place restart, cascade): survivors roll
  back to r from their own ping-pong halves; members that lack their shard or the parameters get
  them from the members the plan names (targeted all-to-all transfers);
- `reshard`: the world changes size (shrink, grow): every old shard's provider sends it to all,
  each member cuts its new slice;
- `restore_persistent`: every member reloads r from the persistent tier, cut for this world (a
  checkpoint that cannot be read or does not match its checksums is never installed).

With `ec:D+H` a shard that has no copy left is rebuilt from its group's pieces of step r (the
plan's `meta["decode"]`, carried out by `redundancy.rebuild.run_decodes`) on the first two paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from phoenixft.dist.comm import alltoallv
from phoenixft.dist.topology import Topology, shard_name
from phoenixft.errors import PeerFailure, RunAborted
from phoenixft.parallel.logical import from_full
from phoenixft.protect.persist import NOT_INSTALLED, load_full
from phoenixft.protect.snapshot import H_CRC, H_VALID, StreamChecksum, checksum
from phoenixft.recovery import rebuild, transfer
from phoenixft.recovery.reshard import gather_full_optimizer, old_shard_numel

if TYPE_CHECKING:
    from phoenixft.runtime.worker import Worker

__all__ = ["path_of", "restore_in_place", "reshard", "restore_persistent", "copy_of"]


def path_of(topo: Topology) -> str:
    """Which restore an epoch's plan takes (`Topology.restore_path`)."""
    return topo.restore_path


def copy_of(m: Worker, shard: int, shards: int, r: int) -> torch.Tensor:
    """This rank's verified copy of (shard, step r): its own committed half, or a replica it keeps."""
    st = m.trainer.state
    half = st.half_with(r)
    if half is not None and st.shard_of(half) == (shard, shards):
        return st.payload(half)
    if m.repl is not None and shard in m.repl.holdings:
        h = m.repl.holdings[shard]
        hh = h.verified_half(r)  # (the descriptor just verified it, as a rule: not hashed again)
        if hh is not None:
            return h.payload(hh)
    name = shard_name(shard, shards, m.cfg.tp, m.cfg.pp)
    raise RunAborted(f"rank {m.rank} holds no verified copy of {name} at step {r}")


def _commit_received(m: Worker, payload: torch.Tensor, r: int, crc: int, shard: int, world: int, dp: int) -> None:
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


def restore_in_place(m: Worker, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
    """Roll survivors back to step r and move what the plan says to the members that lack it.

    Both transfers are targeted collectives (all-to-all with only the involved pairs non-empty):
    parameters (with the buffers) from a member that holds them at r, the optimizer shard from a
    member that holds a verified copy (its own committed state or a replica), matched by logical
    shard id and verified against the checksum its owner committed (I3).
    """
    assert m.comm is not None
    tr = m.trainer
    pg, me, w = m.comm.train, m.rank, topo.world
    mine = [t for t in topo.transfers if t["dst"] == me]
    need_params = any(t["param_src"] >= 0 for t in mine)
    if not need_params and not tr.flat.select(r):
        raise RunAborted(f"rank {me} has no parameters for step {r}")
    if not mine:  # a survivor: its own committed half must hold r, as its checksum says
        tr.state.invalidate_after(r)
        half = tr.state.half_with(r)
        if half is None:
            raise RunAborted(f"rank {me} has no optimizer state for step {r}")
        if int(tr.state.header[half, H_CRC]) and not tr.state.verify(half):
            bad.append(f"own {topo.shard_name(me)} at step {r} does not match its committed checksum")
    # who holds what is settled: wait until every member is here (so the transfer times below are the
    # bytes moving, not a peer still rolling back), then move the parameters, then the optimizer shards
    t0 = time.time()
    m.wait(pg.allreduce([torch.zeros(1)]), "recovery transfer start")
    # the transfers run in the epoch's transfer group (only the ranks that send or receive, several
    # connections per pair): ranks below are that group's
    xg, members = m.comm.xfer, m.comm.xfer_members
    local = {rk: i for i, rk in enumerate(members)}
    xme, xw = local.get(me, -1), len(members)

    def in_group(need: dict[int, list[int]]) -> dict[int, list[int]]:
        return {local[d]: [local[s] for s in srcs] for d, srcs in need.items()}

    # both transfers are posted at once, so that the link never idles between them: 1. parameters,
    # striped over every peer that holds them at r (bitwise identical there); 2. the optimizer shard
    # from a verified copy, received straight into the staging half and checksummed chunk by chunk as
    # it arrives. Every member posts the same rounds in the same order (gloo matches them by order).
    t1 = time.time()
    flat, st = tr.flat, tr.state
    elem = torch.empty((), dtype=flat.dtype).element_size()
    need = in_group(topo.param_need())
    rounds = transfer.schedule(need, flat.total, transfer.chunk_numel(elem))
    on_host = flat.device.type == "cpu"
    sends: dict[int, torch.Tensor] = {}
    if any(p.src == xme for rd in rounds for p in rd):
        src_buf = flat.whole if on_host else flat.whole.cpu()
        sends = {d: src_buf for d in need}
    into = (flat.receive_buffer() if on_host else torch.empty(flat.total, dtype=flat.dtype)) if need_params else None
    p_works = transfer.post(xg, xw, xme, rounds, sends, into, dtype=flat.dtype) if xg is not None else []
    sends = {}
    for t in topo.transfers:
        if t["opt_src"] == me:
            payload = copy_of(m, t["shard"], w, r).reshape(-1)
            if m.inject.corrupts_transfers(topo):  # fault injection: corruption in flight
                payload = payload.clone()
                payload[:: max(1, payload.numel() // 7)] += 1.0
            sends[local[t["dst"]]] = payload
    copied = [t for t in mine if t["opt_src"] >= 0]  # the others are rebuilt from their group (ec), below
    n_opt = tr.payload_rows * flat.shard_numel
    rounds = transfer.schedule(in_group(topo.opt_need()), n_opt, transfer.chunk_numel(4))
    half, buf = -1, None
    if copied:
        half = st.staging()
        if int(st.header[half, H_VALID]):  # it holds a committed step: keep it until the copy verified
            buf = torch.empty(n_opt)
        else:
            st.begin_write(half)
            buf = st.payload(half).reshape(-1)
    hasher = StreamChecksum(buf) if buf is not None else None
    o_works = transfer.post(xg, xw, xme, rounds, sends, buf) if xg is not None else []
    t_posted = time.time()
    transfer.wait_all(p_works, m.wait, "parameter transfer")
    t_moved = time.time()
    if into is not None:
        if on_host:
            flat.adopt_received(r)
        else:
            flat.install(into, r)
    t2 = time.time()
    m.inject.in_recovery(topo)  # (the optimizer shards are still moving)
    in_place = buf is not None and buf.data_ptr() == st.payload(half).data_ptr()
    if in_place and tr.payload_from == 1:  # the master row from the parameters, while the shard is moving
        (t,) = copied
        st.data[half, 0].copy_(flat.flat[flat.shard_slice(topo.layout.dp_rank(t["shard"]))])
    transfer.wait_all(o_works, m.wait, "optimizer-state transfer", hasher.update if hasher is not None else None)
    timings.update(transfer_post_s=t_posted - t1, params_moved_s=t_moved - t1, params_adopt_s=t2 - t_moved,
                   opt_moved_s=time.time() - t2)
    for t in copied:
        assert buf is not None and hasher is not None
        name = topo.shard_name(t["shard"])
        if hasher.value(n_opt) != t["crc"]:
            src = f"{topo.node_of_rank(t['opt_src'])}.{t['opt_src'] % topo.workers_per_node}"
            bad.append(f"{name} from {src} does not match the checksum committed for step {r}")
            m.bad_sources.append((name, r, src))
            continue
        if in_place:  # the half holds the payload and its master row: commit it
            st.commit(half, r, t["crc"], (t["shard"], w))
            st.header[1 - half, H_VALID] = 0
        else:
            _commit_received(m, buf, r, t["crc"], t["shard"], w, topo.layout.dp_rank(t["shard"]))
        timings.update(bytes_params=flat.total * elem if t["param_src"] >= 0 else 0, bytes_opt=buf.numel() * 4)
    if topo.meta.get("decode"):  # ec: every rank takes part (it may hold a piece)
        rebuilt = rebuild.run_decodes(m, topo, r, tr.payload_rows * tr.flat.shard_numel, timings, bad)
        for shard, (payload, crc) in rebuilt.items():
            _commit_received(m, payload, r, crc, shard, w, topo.layout.dp_rank(shard))
        if any(t["param_src"] >= 0 for t in mine if t["opt_src"] < 0):
            timings["bytes_params"] = tr.flat.total * elem
    timings.update(transfer_sync_s=t1 - t0, restore_params_s=t2 - t1, restore_opt_s=time.time() - t2)


def reshard(m: Worker, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
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
    providers = {int(k): v[0] for k, v in meta["providers"].items()}
    n_old = old_shard_numel(tr.flat.numel, old_world)
    decoded = rebuild.run_decodes(m, topo, r, tr.payload_rows * n_old, timings, bad) \
        if topo.meta.get("decode") else {}  # ec: shards with no copy left, rebuilt by their provider
    mine = {int(k): (decoded[int(k)][0] if int(k) in decoded else torch.zeros(tr.payload_rows * n_old))
            if kind == "decode" else copy_of(m, int(k), old_world, r)
            for k, (prov, kind, _crc) in meta["providers"].items() if prov == me}
    full = gather_full_optimizer(pg, w, me, providers, mine, n_old, m.wait, rows=tr.payload_rows)
    for k, (prov, _kind, crc) in meta["providers"].items():  # I3: every old shard as its owner committed it
        i = int(k)
        if checksum(full[:, i * n_old : (i + 1) * n_old].contiguous()) != crc:
            bad.append(f"{shard_name(i, old_world)} from rank {prov} does not match the checksum committed for "
                       f"step {r}")
    m.repartition(w, int(topo.meta["generation"]), r)  # the new flat buffers start from the model as it is (r)
    flat, st = tr.flat, tr.state
    numel = flat.numel
    sl = flat.shard_slice(me)
    rows = torch.zeros(tr.payload_rows, flat.padded)
    rows[:, :numel] = full[:, :numel]
    st.begin_write(0)
    st.data[0, tr.payload_from :].copy_(rows[:, sl])
    if tr.payload_from == 1:
        st.data[0, 0].copy_(flat.flat[sl])
    st.commit(0, r, 0, (me, w))
    st.header[1, H_VALID] = 0
    _replicas_from_whole_state(m, topo, r, rows)
    timings.update(restore_params_s=t2 - t1, restore_opt_s=time.time() - t2, bytes_opt=full.numel() * 4)


def init_replicas(m: Worker, topo: Topology) -> None:
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


def _replicas_from_whole_state(m: Worker, topo: Topology, r: int, rows: torch.Tensor) -> None:
    """After a reshard or a reload from the persistent tier every member has the whole optimizer state
    of step r (`rows`: the payload rows, padded to the new partition): it keeps, at once, the replicas
    the new epoch's ring gives it, so each new shard has its copies on other nodes before training
    resumes. Otherwise the new shards would exist only on their owners until the first replication of
    the new epoch lands, and a node lost in that window (a repaired node that dies again right after
    it was grown back in) would lose the run (or, after a reload, take it back to the disk)."""
    _keep_replicas(m, topo, r, lambda out, sl: out.copy_(rows[:, sl]))


def _keep_replicas(m: Worker, topo: Topology, r: int, fill: Callable[[torch.Tensor, slice], Any]) -> None:
    """Commit, as step r, the replica of every shard the ring gives this rank: `fill(rows, slice)` writes
    the shard's payload rows (`slice`: its range of the padded flat state). Parity (`--redundancy ec`)
    is encoded by its next job instead (it needs the group's exchange)."""
    if m.repl is None or m.ec is not None:
        return
    tr, lay = m.trainer, topo.layout
    for src in topo.sources(m.rank):
        h = m.repl.holding(src)
        h.begin_write(0)
        # (not view(rows, -1): a stateless optimizer's fp32 payload has no row, and every node failed its epoch-0 join)
        fill(h.payload(0).view(tr.payload_rows, tr.flat.shard_numel), tr.flat.shard_slice(lay.dp_rank(src)))
        h.commit(0, r, checksum(h.payload(0)), (src, topo.world))
        h.header[1, H_VALID] = 0


def restore_persistent(m: Worker, topo: Topology, r: int, timings: dict[str, Any], bad: list[str]) -> None:
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
    st.commit(half, r, 0, (m.rank, topo.world))
    st.header[1 - half, H_VALID] = 0
    if m.repl is not None:
        for h in m.repl.holdings.values():
            h.invalidate_after(-1)
    if m.ec is not None:
        for ph in m.ec.parity.values():
            ph.invalidate_after(-1)
    _replicas_from_whole_state(m, topo, r, padded[tr.payload_from :])
    timings.update(restore_params_s=time.time() - t0, restore_opt_s=0.0, bytes_params=full.numel() * 4)
