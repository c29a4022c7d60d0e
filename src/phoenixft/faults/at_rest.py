"""Silent data corruption at rest: one bit of a committed copy a rank holds flips, and nothing crashes.

`corrupt_at_rest` is what `sdc:node=I@step=S,target=shard[,bit=B]` does on the node it strikes (kinds.py
`Sdc`, fired by `FaultInjector.at_rest` on the replication thread once the protection of step S-1
committed): it flips bit B (or a drawn one) of one element of the newest committed copy the rank keeps
for others (a replica or a parity block of step S-1: a recovery in the next step would need exactly
that one), or, when it keeps none, of its own older snapshot half (a recovery point as well). The
header, and so the checksum recorded at commit, is left as it was: only a re-hash can tell.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from phoenixft.protect.snapshot import PingPong

__all__ = ["corrupt_at_rest", "flip_bit"]


def flip_bit(t: torch.Tensor, element: int, bit: int) -> None:
    """Flip bit `bit` (0..31) of float32 element `element` of the contiguous tensor `t`, in place."""
    word = t.view(-1).view(torch.int32)
    mask = (1 << bit) if bit < 31 else -(1 << 31)
    word[element] ^= mask


def corrupt_at_rest(ctx: Any, step: int, bit: int | None, rng: random.Random) -> dict[str, Any] | None:
    """Flip one bit of a committed copy of `step` this rank holds (see the module doc); returns what was hit
    (copy kind, id, step, element, bit), or None when the rank holds no committed copy."""
    target: tuple[str, int, PingPong, int] | None = None
    scheme = ctx.scheme
    for c in sorted(scheme.held() if scheme is not None else [], key=lambda c: (c.kind, c.ident)):
        half = c.pp.half_with(step)
        if half is not None:
            target = (c.kind, c.ident, c.pp, half)
            break
    st = ctx.trainer.state if ctx.trainer is not None else None
    if target is None and st is not None:
        newest = st.newest()
        if newest is not None and st.step_of(1 - newest) >= 0:
            target = ("own", ctx.rank, st, 1 - newest)
    if target is None:
        return None
    kind, ident, pp, half = target
    payload = pp.payload(half)
    element = rng.randrange(payload.numel())
    b = bit if bit is not None else rng.randrange(32)
    flip_bit(payload, element, b)
    return {"copy": kind, "ident": ident, "step": pp.step_of(half), "element": element, "bit": b}
