"""What the scrub repair round (scrub_round.py) asks for each corrupt held half, and what a rank serves.

For a half the scrubber found corrupt (scrub.py), holding step s committed with checksum c:

- a replica of shard x: asked of x's owner (its committed half of s), then of x's other holders (their
  replicas of s): the first that holds a good copy sends it;
- the rank's own shard's half: asked of its holders (`replicas:K`; under `ec:D+H` nobody keeps a copy of a
  shard: a recovery rebuilds it from the group, and the half is reported not repaired);
- a parity block: every member of the block's group is asked for its committed half of s (checked against
  the member checksum the block recorded), and the block is encoded again from them with the group's code.

Whatever arrives is verified against the checksum the corrupt half was committed with before the half is
written and committed again under the same step and shard. A peer serves a copy only after verifying it
against the checksum asked for, so a corrupt copy is never sent as a good one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from phoenixft.distributed.topology import Topology
from phoenixft.protect.redundancy.parity import ParityHolding
from phoenixft.protect.scrub import Finding, HeldCopy
from phoenixft.protect.scrub_round import HELD, OWN, Ask, Request
from phoenixft.protect.snapshot import Holding, PingPong, checksum

__all__ = ["requests", "server", "worker_name"]


def worker_name(topo: Topology, rank: int) -> str:
    return f"{topo.node_of_rank(rank)}.{rank % topo.workers_per_node}"


def _install(pp: PingPong, half: int, step: int, crc: int, good: torch.Tensor, src: str) -> str:
    if checksum(good) != crc:
        raise LookupError(f"the copy {src} sent does not match the committed checksum")
    shard = pp.shard_of(half)
    pp.begin_write(half)
    pp.payload(half).copy_(good.view_as(pp.payload(half)))
    pp.commit(half, step, crc, shard)
    return src


def requests(pairs: list[tuple[HeldCopy, Finding]], rank: int, topo: Topology, copies_kept: bool,
             code: Callable[[int, int], Any], member_numel: int) -> list[Request]:
    """The round's request for each corrupt half. `copies_kept`: the scheme keeps replicas (`replicas:K`);
    `code(d, h)`: the erasure code of a d+h group; `member_numel`: float32 in a member's committed payload."""
    out: list[Request] = []
    for c, f in pairs:
        if c.kind == "parity":
            assert isinstance(c.pp, ParityHolding)
            out.append(_parity_request(c.pp, f, topo, code, member_numel))
            continue
        r = Request(f)
        out.append(r)
        idx, count = c.pp.shard_of(f.half)
        if count != topo.world:
            r.refused = f"the copy is of a partition of {count} shards, the ring now has {topo.world}"
            continue
        n = int(c.pp.payload(f.half).numel())
        if c.kind == "replica":  # the owner's committed half, then the other holders' replicas
            r.asks = [(idx, Ask(OWN, idx, f.step, f.crc, n))]
        r.asks += [(h, Ask(HELD, idx, f.step, f.crc, n)) for h in topo.holders(idx) if h != rank] if copies_kept \
            else []
        if not r.asks:
            r.nobody = "no peer keeps a copy of this shard" + ("" if copies_kept else
                                                                " (ec:D+H rebuilds it from its group in a recovery)")
        r.install = _copy_installer(c.pp, f, r.asks, topo)
    return out


def _copy_installer(pp: PingPong, f: Finding, asks: list[tuple[int, Ask]], topo: Topology
                    ) -> Callable[[dict[int, torch.Tensor]], str]:
    def install(got: dict[int, torch.Tensor]) -> str:
        ((p, good),) = got.items()
        what = next(a.what for q, a in asks if q == p)
        src = f"{'owner' if what == OWN else 'replica on'} {worker_name(topo, p)}"
        return _install(pp, f.half, f.step, f.crc, good, src)

    return install


def _parity_request(ph: ParityHolding, f: Finding, topo: Topology, code: Callable[[int, int], Any],
                    member_numel: int) -> Request:
    info = ph.info_of(f.half)
    r = Request(f, every=True)
    if info.world != topo.world:
        r.refused = f"the block is of a partition of {info.world} shards, the ring now has {topo.world}"
        return r
    r.asks = [(m, Ask(OWN, m, f.step, info.mcrc[k], member_numel)) for k, m in enumerate(info.members)]
    r.nobody = f"not every member of its group holds a good committed half of step {f.step} (asked " + \
        ", ".join(worker_name(topo, m) for m in info.members) + ")"

    def install(got: dict[int, torch.Tensor]) -> str:
        from phoenixft.protect.redundancy.protect import u8

        payloads = [got[m] for m in info.members]
        d, n = len(payloads), member_numel
        g = ph.numel // d
        good = torch.empty(ph.numel)

        def stripe(p: torch.Tensor, i: int) -> np.ndarray:
            t = torch.zeros(g)
            lo, hi = i * g, min(n, (i + 1) * g)
            if hi > lo:
                t[: hi - lo] = p[lo:hi]
            return u8(t)

        enc = code(d, info.h)
        for i in range(d):
            u8(good[i * g : (i + 1) * g])[:] = enc.encode([stripe(p, i) for p in payloads])[info.j]
        src = "re-encoded from " + ", ".join(worker_name(topo, m) for m in info.members)
        if checksum(good) != f.crc:
            raise LookupError("the parity re-encoded from its members does not match its committed checksum")
        return _install(ph, f.half, f.step, f.crc, good, src)

    r.install = install
    return r


def server(state: Callable[[], PingPong | None], holdings: Callable[[], dict[int, Holding]]
           ) -> Callable[[Ask], torch.Tensor | None]:
    """What this rank sends for an ask: its own committed half of the step (OWN) or its replica of the shard
    (HELD), each only when its bytes match the checksum asked for; None otherwise."""

    def serve(a: Ask) -> torch.Tensor | None:
        if a.what == OWN:
            st = state()
            half = st.half_with(a.step) if st is not None else None
            if st is None or half is None:
                return None
            t = st.payload(half)
            return t if checksum(t) == a.crc else None
        h = holdings().get(a.ident)
        if h is None:
            return None
        # hashed now, not taken from an earlier verification: a bit may have flipped at rest since
        half = next((x for x in (0, 1) if h.step_of(x) == a.step and h.crc_of(x) == a.crc
                     and checksum(h.payload(x)) == a.crc), None)
        return h.payload(half) if half is not None else None

    return serve
