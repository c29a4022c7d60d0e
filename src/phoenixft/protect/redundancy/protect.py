"""The per-step parity job of `ec:D+H`, distributed over the group (run by the `Replicator` thread).

After step s commits on every member of a group of d ranks, each member cuts its committed
payload (the protected rows of its shard, n float32) into d stripes of L bytes (padded, aligned)
and the group computes the h parity blocks of step s in two exchanges, off the critical path:

1. shuffle: member k sends stripe i of its payload to member i (with its checksum and the
   checksum of its whole payload), so member i holds stripe i of every member;
2. encode: member i encodes its d stripes into h parity stripes (`codes.make_code`) and sends
   parity stripe j to the holder of parity block j, with the d members' payload checksums.

Every member encodes 1/d of the group's data (no node does a whole group's work); each sends
(d - 1 + h) x L bytes, about (d - 1 + h) / d of its payload. A holder verifies every stripe
against its checksum, writes them into the staging half of its `ParityHolding`, checksums the
whole block and only then commits the half for step s: a failure during the update leaves the
previous step's parity usable (its other half). Transfers go over the epoch's replication group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from phoenixft.distributed.comm import alltoallv
from phoenixft.errors import PeerFailure
from phoenixft.protect.redundancy.codes import Code, make_code, stripe_bytes
from phoenixft.protect.redundancy.parity import ParityHolding
from phoenixft.protect.redundancy.plan import ECPlan
from phoenixft.protect.snapshot import H_CRC, Holding, checksum

if TYPE_CHECKING:
    from phoenixft.protect.replication import Replicator

__all__ = ["ErasureProtector", "u8"]


def u8(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a numpy uint8 view (no copy)."""
    return t.contiguous().view(torch.uint8).numpy()


class ErasureProtector:
    """A rank's parity holdings (kept across epochs) and its share of each step's parity job."""

    def __init__(self, factory: Callable[[int, int, int], ParityHolding]) -> None:
        self._factory = factory  # (gid, numel, dmax) -> holding
        self.parity: dict[int, ParityHolding] = {}
        self.plan: ECPlan | None = None
        self._codes: dict[tuple[int, int], Code] = {}
        self.checksum_failures = 0

    def holding(self, gid: int, numel: int, dmax: int) -> ParityHolding:
        h = self.parity.get(gid)
        if h is None or h.numel != numel or h.dmax != dmax:
            h = self.parity[gid] = self._factory(gid, numel, dmax)
        return h

    def adopt(self, data_files: Iterable[Path]) -> None:
        """A worker restarted in place takes over the parity blocks retained in shared memory
        (`<base>-par<gid>.data`: 2 halves of numel float32; `.info`: 2 x (4 + 2 dmax) int64)."""
        for f in data_files:
            gid = int(f.name.rsplit("-par", 1)[1].split(".")[0])
            info = f.with_name(f.name[: -len(".data")] + ".info")
            if not info.exists():
                continue
            dmax = (info.stat().st_size // 16 - 4) // 2
            self.holding(gid, f.stat().st_size // 8, dmax)

    def code(self, d: int, h: int) -> Code:
        if (d, h) not in self._codes:
            self._codes[(d, h)] = make_code(d, h)
        return self._codes[(d, h)]

    # ------------------------------------------------------------------ one step
    def protect(self, repl: Replicator, step: int) -> tuple[int, dict[int, Holding]]:
        """Encode step's parity with the group; returns (bytes sent, holdings committed by gid)."""
        comm, plan = repl.comm, self.plan
        assert comm is not None and plan is not None
        pg, world = comm.repl, comm.world
        st = repl.state
        half = st.half_with(step)
        if half is None:
            raise PeerFailure(f"parity of step {step}: no committed half holds it")
        payload = st.payload(half).reshape(-1)
        n = payload.numel()
        crc = checksum(payload)
        st.header[half, H_CRC] = crc
        d, h, me = plan.d, plan.h, plan.i
        lf = stripe_bytes(4 * n, d) // 4  # floats per stripe

        def stripe(k: int) -> torch.Tensor:
            lo, hi = k * lf, min(n, (k + 1) * lf)
            if hi - lo == lf:
                return payload[lo:hi]
            t = torch.zeros(lf)
            if hi > lo:
                t[: hi - lo] = payload[lo:hi]
            return t

        # 1. shuffle: stripe k of my payload to member k
        others = [(k, r) for k, r in enumerate(plan.members) if k != me]
        out = {r: stripe(k) for k, r in others}
        hdr = {r: torch.tensor([plan.gid, step, crc, checksum(out[r])], dtype=torch.int64) for _, r in others}
        w1, _, rhdr = alltoallv(pg, world, hdr, {r: 4 for _, r in others}, dtype=torch.int64)
        w2, _, rdat = alltoallv(pg, world, out, {r: lf for _, r in others})
        repl.in_flight(step, w1)
        repl.wait_all([w1, w2], f"parity shuffle of step {step}")
        mcrc = [0] * d
        mcrc[me] = crc
        blocks: list[np.ndarray] = [np.empty(0, np.uint8)] * d
        mine = stripe(me)
        blocks[me] = u8(mine)
        for k, r in others:
            gid, s, c, sc = (int(x) for x in rhdr[r].tolist())
            if gid != plan.gid or s != step or checksum(rdat[r]) != sc:
                self.checksum_failures += 1
                raise PeerFailure(f"parity of step {step}: stripe from rank {r} failed its checksum on receipt")
            mcrc[k] = c
            blocks[k] = u8(rdat[r])
        # 2. encode my stripe of every member and send parity stripe j to holder j
        par = self.code(d, h).encode(blocks)
        psend: dict[int, torch.Tensor] = {}
        phdr: dict[int, torch.Tensor] = {}
        for j, holder in enumerate(plan.parity):
            buf = torch.empty(lf)
            u8(buf)[:] = par[j]
            psend[holder] = buf
            phdr[holder] = torch.tensor([plan.gid, j, me, step, checksum(buf), d, *mcrc, *[0] * (plan.dmax - d)],
                                        dtype=torch.int64)
        hl = 6 + plan.dmax
        glf = {hb.gid: stripe_bytes(4 * n, len(hb.members)) // 4 for hb in plan.held}  # groups differ in size
        recv = {src: glf[hb.gid] for hb in plan.held for src in hb.members}
        w3, _, rph = alltoallv(pg, world, phdr, {src: hl for src in recv}, dtype=torch.int64)
        w4, _, rpd = alltoallv(pg, world, psend, recv)
        repl.wait_all([w3, w4], f"parity of step {step}")
        # 3. keep the parity blocks this rank holds: verify, write the staging half, commit
        checked = []
        for hb in plan.held:
            got_mcrc: list[int] | None = None
            for k, src in enumerate(hb.members):
                x = [int(v) for v in rph[src].tolist()]
                gid, j, kk, s, sc, dd = x[:6]
                if (gid, j, kk, s, dd) != (hb.gid, hb.j, k, step, len(hb.members)) or checksum(rpd[src]) != sc:
                    self.checksum_failures += 1
                    raise PeerFailure(f"parity block {hb.j} of group {hb.gid} (step {step}): stripe from rank "
                                      f"{src} failed its checksum on receipt")
                if got_mcrc is None:
                    got_mcrc = x[6 : 6 + dd]
                elif got_mcrc != x[6 : 6 + dd]:
                    raise PeerFailure(f"parity of group {hb.gid} (step {step}): members' checksums disagree")
            assert got_mcrc is not None
            checked.append((hb, got_mcrc))
        committed: dict[int, Holding] = {}
        with repl.commit_guard(comm, step):
            for hb, got_mcrc in checked:
                dlen, g = len(hb.members), glf[hb.gid]
                ph = self.holding(hb.gid, dlen * g, plan.dmax)
                dst = ph.staging()
                ph.begin_write(dst)
                row = ph.data[dst, 0]
                for k, src in enumerate(hb.members):
                    row[k * g : (k + 1) * g].copy_(rpd[src])
                ph.set_info(dst, hb.j, hb.h, world, hb.members, got_mcrc)
                ph.commit(dst, step, checksum(ph.payload(dst)), (hb.gid, world))
                committed[hb.gid] = ph
        sent = 4 * lf * (len(others) + h)
        return sent, committed
