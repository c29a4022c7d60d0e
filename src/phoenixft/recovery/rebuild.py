"""Rebuild lost shards from their group (`ec:D+H`): the restore side of a plan's decode jobs.

`run_decodes` is called by every rank of the new epoch when the plan carries `meta["decode"]`
(hot-swap, in-place, cascade: `restore.restore_in_place`; shrink and grow: `restore.reshard`), through
the `ec:D+H` scheme (`protect.redundancy.erasure.ErasureScheme.rebuild`).
One targeted all-to-all moves each job's d pieces (members' committed payloads, padded to the
block length, and parity blocks of the same step) from the ranks that hold them to the job's
destinations; each destination verifies every piece against the checksum its holder committed
(invariant I3: a bad piece is reported as a bad source and the recovery is planned again without
it), decodes stripe by stripe, and verifies each rebuilt payload against the checksum its owner
committed for that step before it is used.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from phoenixft.distributed.comm import alltoallv
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import RunAborted
from phoenixft.protect.redundancy.codes import Code, stripe_bytes
from phoenixft.protect.redundancy.protect import ErasureProtector, u8
from phoenixft.protect.scheme import RankView
from phoenixft.protect.snapshot import checksum

__all__ = ["run_decodes", "block_floats", "decode_blocks"]


def block_floats(n: int, d: int) -> int:
    """float32 elements of one block of a d-member group whose payloads hold n float32 each."""
    return d * stripe_bytes(4 * n, d) // 4


def decode_blocks(code: Code, pieces: dict[int, np.ndarray], n: int, lost: list[int]) -> dict[int, torch.Tensor]:
    """The payloads (n float32 each) of the group members `lost`, rebuilt stripe by stripe from d pieces
    (block index -> the block's bytes: a member's padded payload, or a parity block)."""
    d = code.d
    sl = stripe_bytes(4 * n, d)
    rebuilt = {i: torch.zeros(block_floats(n, d)) for i in lost}
    for k in range(d):
        got_k = code.decode({i: v[k * sl : (k + 1) * sl] for i, v in pieces.items()}, lost)
        for i in lost:
            u8(rebuilt[i])[k * sl : (k + 1) * sl] = got_k[i]
    return {i: t[:n] for i, t in rebuilt.items()}


def _local_piece(m: RankView, ec: ErasureProtector, job: dict[str, Any], p: dict[str, Any], r: int,
                 pf: int) -> torch.Tensor:
    """This rank's piece of a job: its own committed payload (padded) or a parity block of step r."""
    d = len(job["shards"])
    if p["index"] < d:
        data = m.copy_of(job["shards"][p["index"]], job["world"], r).reshape(-1)
        out = torch.zeros(pf)
        out[: data.numel()] = data
        return out
    ph = ec.parity.get(job["gid"])
    half = ph.verified_half(r) if ph is not None else None  # (either half of step r: see PingPong.verified_half)
    if ph is None or half is None or ph.info_of(half).j != p["index"] - d:
        raise RunAborted(f"rank {m.rank} holds no {p['name']} of step {r}")
    return ph.payload(half).reshape(-1)  # sent as committed: the receiver verifies its checksum


def run_decodes(m: RankView, ec: ErasureProtector, topo: Topology, r: int, n: int, timings: dict[str, Any],
                bad: list[str]) -> dict[int, tuple[torch.Tensor, int]]:
    """Carry out `topo.meta["decode"]` on rank `m`, whose parity blocks `ec` keeps; returns {shard index:
    (payload of n float32, checksum)} for the shards rebuilt for this rank. `n` is the payload size of
    the jobs' shards (in their world)."""
    assert m.comm is not None
    jobs: list[dict[str, Any]] = topo.meta.get("decode") or []
    me = m.rank
    t0 = time.time()
    sends: dict[int, list[torch.Tensor]] = {}
    layout: dict[int, list[tuple[int, int, int]]] = {}  # src -> [(job, block index, floats)] in order
    for x, job in enumerate(jobs):
        d = len(job["shards"])
        pf = block_floats(n, d)
        dsts = sorted(set(job["to"].values()))
        for p in job["pieces"]:
            if p["src"] == me:
                piece = _local_piece(m, ec, job, p, r, pf)
                for dst in dsts:
                    sends.setdefault(dst, []).append(piece)
            if me in dsts:
                layout.setdefault(p["src"], []).append((x, p["index"], pf))
    send = {dst: parts[0] if len(parts) == 1 else torch.cat(parts) for dst, parts in sends.items()}
    recv = {src: sum(f for _, _, f in lst) for src, lst in layout.items()}
    work, _, got = alltoallv(m.comm.train, topo.world, send, recv)
    m.wait(work, "erasure-coded rebuild")
    t1 = time.time()
    views: dict[tuple[int, int], torch.Tensor] = {}
    for src, lst in layout.items():
        off = 0
        for x, idx, f in lst:
            views[(x, idx)] = got[src][off : off + f]
            off += f
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for x, job in enumerate(jobs):
        mine = sorted(int(pos) for pos, dst in job["to"].items() if dst == me)
        if not mine:
            continue
        d, h = len(job["shards"]), int(job["h"])
        pieces = {}
        ok = True
        for p in job["pieces"]:
            buf = views[(x, p["index"])]
            if checksum(buf[:n] if p["index"] < d else buf) != p["crc"]:
                bad.append(f"{p['name']} from {p['wid']} does not match the checksum committed for step {r}")
                m.bad_sources.append((p["name"], r, p["wid"]))
                ok = False
            pieces[p["index"]] = u8(buf)
        if not ok:
            continue
        code = ec.code(d, h)
        rebuilt = decode_blocks(code, pieces, n, mine)
        for i in mine:
            payload, crc = rebuilt[i], int(job["mcrc"][i])
            shard = int(job["shards"][i])
            if checksum(payload) != crc:
                bad.append(f"{shard_name(shard, job['world'])} rebuilt from its group does not match the checksum "
                           f"committed for step {r}")
                continue
            out[shard] = (payload, crc)
    timings["bytes_ec"] = timings.get("bytes_ec", 0) + 4 * sum(recv.values())
    timings["decode_s"] = timings.get("decode_s", 0.0) + (time.time() - t1)
    timings["rebuild_s"] = timings.get("rebuild_s", 0.0) + (time.time() - t0)
    timings.setdefault("decoded", []).extend(shard_name(s, jobs[0]["world"]) for s in out)
    return out
