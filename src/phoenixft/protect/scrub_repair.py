"""Repairing a held half the scrubber found corrupt (scrub.py), from a good copy on this host.

Every committed copy lives in a host shared-memory file whose name is a function of the run, the
worker and the partition generation (shm.py), and whose header says which step each half holds. So
a rank can fetch a good copy of (shard, step) without its peers' help, off the training path:

- a replica it keeps for shard x: from x's owner's committed half (`<owner>-state`), else from the
  replica another holder keeps (`<holder>-hold<x>`);
- its own shard's half: from a holder's replica of it;
- a parity block: re-encoded from its group's members' committed halves of the same step (each one
  verified against the member checksum the block recorded), with the group's code.

Whatever is read is verified against the checksum the corrupt half's header recorded before it is
installed (a torn or stale read fails that check and is not installed). A source whose file is not on
this host (a peer on another machine) cannot be read: `LookupError` says so, the bad half stays out of
every recovery (its checksum refuses it), and the next protection job replaces it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from phoenixft.dist.topology import Topology
from phoenixft.protect import shm
from phoenixft.protect.redundancy.parity import ParityHolding
from phoenixft.protect.scrub import HeldCopy
from phoenixft.protect.snapshot import H_STEP, H_VALID, PingPong, checksum

__all__ = ["repair_half", "read_peer_half"]


def read_peer_half(base: str, rows: int, numel: int, first_row: int, step: int, crc: int, out: torch.Tensor) -> bool:
    """Read the payload rows [first_row, rows) of the half of `step` of the ping-pong file pair `base`.data/.hdr
    into `out` (contiguous float32); True if a committed half of `step` was there and its bytes have checksum `crc`."""
    try:
        hdr = np.fromfile(base + ".hdr", dtype=np.int64, count=10).reshape(2, 5)
        fd = os.open(base + ".data", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return False
    try:
        arr: Any = out.view(-1).view(torch.uint8).numpy()
        mv = memoryview(arr)
        for half in (0, 1):
            if not int(hdr[half, H_VALID]) or int(hdr[half, H_STEP]) != step:
                continue
            off, done = (half * rows + first_row) * numel * 4, 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], off + done)
                if n <= 0:
                    break
                done += n
            if done == len(mv) and checksum(out) == crc:
                return True
        return False
    finally:
        os.close(fd)


def _wid(topo: Topology, rank: int) -> str:
    return f"{topo.node_of_rank(rank)}.{rank % topo.workers_per_node}"


def _base(ctx: Any, rank: int) -> str:
    gen = int(str(ctx.shm).rsplit("-g", 1)[1])
    return shm.worker_base(ctx.run_id, _wid(ctx.topo, rank), gen)


def _install(pp: PingPong, half: int, step: int, crc: int, good: torch.Tensor) -> None:
    shard = pp.shard_of(half)
    pp.begin_write(half)
    pp.payload(half).copy_(good.view_as(pp.payload(half)))
    pp.commit(half, step, crc, shard)


def repair_half(ctx: Any, c: HeldCopy, half: int, step: int, crc: int) -> str:
    """Restore `c`'s `half` (holding `step`, committed with checksum `crc`) from a good copy on this host;
    returns where the bytes came from. Raises LookupError saying why no good copy could be read."""
    topo: Topology | None = ctx.topo
    if ctx.shm is None or topo is None:
        raise LookupError("the copies are in private memory: no other copy can be read from here")
    tr = ctx.trainer
    good = torch.empty(c.pp.payload(half).numel())
    idx, count = c.pp.shard_of(half)
    if c.kind == "parity":
        assert isinstance(c.pp, ParityHolding)
        src = _reencode(ctx, topo, c.pp, half, step, good)
    else:
        if count != topo.world:
            raise LookupError(f"the copy is of a partition of {count} shards, the ring now has {topo.world}")
        # (owner's committed half, then other holders' replicas) for a replica; holders' replicas for the own shard
        cands: list[tuple[int, str, int, int]] = [] if c.kind == "own" else [(idx, "-state", tr.rows, tr.payload_from)]
        cands += [(r, f"-hold{idx}", tr.payload_rows, 0) for r in topo.holders(idx) if r != ctx.rank]
        src = ""
        for r, suffix, rows, first in cands:
            if read_peer_half(_base(ctx, r) + suffix, rows, tr.flat.shard_numel, first, step, crc, good):
                src = f"{'owner' if suffix == '-state' else 'replica on'} {_wid(topo, r)}"
                break
        if not src:
            who = ", ".join(_wid(topo, r) for r, *_ in cands) or "nobody"
            raise LookupError(f"no good copy of step {step} readable on this host (tried {who})")
    _install(c.pp, half, step, crc, good)
    return src


def _reencode(ctx: Any, topo: Topology, ph: ParityHolding, half: int, step: int, out: torch.Tensor) -> str:
    """Parity block `half` of step `step` computed afresh from its members' committed halves into `out`."""
    from phoenixft.protect.redundancy.protect import u8

    tr = ctx.trainer
    info = ph.info_of(half)
    if info.world != topo.world:
        raise LookupError(f"the block is of a partition of {info.world} shards, the ring now has {topo.world}")
    d, n = len(info.members), tr.flat.shard_numel * tr.payload_rows
    g = ph.numel // d
    payloads = []
    for k, m in enumerate(info.members):
        buf = torch.empty(n)
        if not read_peer_half(_base(ctx, m) + "-state", tr.rows, tr.flat.shard_numel, tr.payload_from, step,
                              info.mcrc[k], buf):
            raise LookupError(f"member {_wid(topo, m)}'s committed half of step {step} is not readable on this "
                              "host (or no longer holds that step)")
        payloads.append(buf)

    def stripe(p: torch.Tensor, i: int) -> np.ndarray:
        t = torch.zeros(g)
        lo, hi = i * g, min(n, (i + 1) * g)
        if hi > lo:
            t[: hi - lo] = p[lo:hi]
        return u8(t)

    code = ctx.scheme.ec.code(d, info.h)
    for i in range(d):
        u8(out[i * g : (i + 1) * g])[:] = code.encode([stripe(p, i) for p in payloads])[info.j]
    if checksum(out) != int(ph.header[half, 1]):
        raise LookupError("the parity re-encoded from its members does not match its committed checksum")
    return "re-encoded from " + ", ".join(_wid(topo, m) for m in info.members)
