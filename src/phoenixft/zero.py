"""ZeRO-1 style distributed optimizer over one flat parameter buffer.

Parameters live as views into one flat float32 buffer; gradients as views into one flat grad
buffer, so gradient accumulation over microbatches lands in place. Each step:
gradients are reduce-scattered (each data-parallel rank gets the summed gradient of its own
contiguous slice), each rank runs AdamW on its slice (fp32 master, exp_avg, exp_avg_sq; the
*logical shard* `dp{i}`), and the updated slices are all-gathered back into full parameters.

Two flat parameter buffers alternate (ping-pong): the all-gather writes into the one that is not
live and the parameter views are re-pointed only after it completed, so a failure during the
all-gather leaves the live parameters untouched. Each buffer is tagged with the step it holds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from phoenixft.snapshot import INVALID, ShardState, alloc

__all__ = ["FlatModel", "adamw_step", "AdamWHyper"]


class AdamWHyper:
    def __init__(self, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps


class FlatModel:
    """A module whose parameters and gradients are views into flat buffers."""

    def __init__(self, model: torch.nn.Module, shards: int, path: str | None = None, step: int = 0) -> None:
        """With `path`, both parameter buffers and their step tags live in shared memory; if they
        already exist (a worker restarted in place) they are adopted instead of overwritten."""
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.shards = shards
        self.shard_numel = math.ceil(self.numel / shards)
        self.padded = self.shard_numel * shards
        retained = path is not None and os.path.exists(path + ".tags")
        self.bufs = [alloc(self.padded, torch.float32, path and f"{path}.{i}") for i in (0, 1)]
        self.tags = alloc(3, torch.int64, path and path + ".tags")  # step of buffer 0, 1; live index
        if retained:
            self.live = int(self.tags[2])
        else:
            self.tags[0], self.tags[1], self.tags[2] = step, INVALID, 0
            self.live = 0
            off = 0
            for p in self.params:
                self.bufs[0][off : off + p.numel()].copy_(p.detach().reshape(-1))
                off += p.numel()
        self.grad = torch.zeros(self.padded)
        self._bind(self.live)
        off = 0
        for p in self.params:
            p.grad = self.grad[off : off + p.numel()].view_as(p)
            off += p.numel()

    @property
    def buf_step(self) -> list[int]:
        return [int(self.tags[0]), int(self.tags[1])]

    def _tag(self, which: int, step: int) -> None:
        self.tags[which] = step

    def _bind(self, which: int) -> None:
        self.tags[2] = which
        off = 0
        buf = self.bufs[which]
        for p in self.params:
            p.data = buf[off : off + p.numel()].view_as(p)
            off += p.numel()
        self.live = which

    # -- views
    def shard_slice(self, shard: int) -> slice:
        return slice(shard * self.shard_numel, (shard + 1) * self.shard_numel)

    @property
    def flat(self) -> torch.Tensor:
        return self.bufs[self.live]

    @property
    def spare_buf(self) -> torch.Tensor:
        return self.bufs[1 - self.live]

    @property
    def step(self) -> int:
        return self.buf_step[self.live]

    def begin_gather(self) -> torch.Tensor:
        """The non-live buffer, untagged: it is about to be overwritten by the all-gather."""
        self._tag(1 - self.live, INVALID)
        return self.spare_buf

    def flip(self, step: int) -> None:
        """Make the non-live buffer (just filled by the all-gather) live for `step`."""
        self._tag(1 - self.live, step)
        self._bind(1 - self.live)

    def select(self, step: int) -> bool:
        """Roll back (or stay) so the live buffer holds `step`; False if neither does."""
        for b in (self.live, 1 - self.live):
            if self.buf_step[b] == step:
                self._bind(b)
                self._tag(1 - b, INVALID)
                return True
        return False

    def install(self, flat: torch.Tensor, step: int) -> None:
        """Adopt full parameters received from a peer (hot-swap)."""
        self.begin_gather().copy_(flat)
        self.flip(step)
        self._tag(1 - self.live, INVALID)

    def zero_grad(self) -> None:
        self.grad.zero_()


def adamw_step(
    state: ShardState,
    src: int,
    dst: int,
    grad: torch.Tensor,
    step: int,
    h: AdamWHyper,
    hook: Callable[[], None] | None = None,
) -> None:
    """AdamW on one shard, reading half `src` (state after step-1) and writing half `dst`.

    Same arithmetic as torch.optim.AdamW (single-tensor path), out of place.
    """
    p0, m0, v0 = state.data[src]
    p1, m1, v1 = state.data[dst]
    b1, b2 = h.betas
    state.begin_write(dst)
    torch.lerp(m0, grad, 1 - b1, out=m1)
    torch.mul(v0, b2, out=v1)
    v1.addcmul_(grad, grad, value=1 - b2)
    if hook is not None:
        hook()  # fault injection "inside the optimizer step": dst is half written
    torch.mul(p0, 1 - h.lr * h.weight_decay, out=p1)
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = (v1.sqrt() / math.sqrt(bc2)).add_(h.eps)
    p1.addcdiv_(m1, denom, value=-h.lr / bc1)
