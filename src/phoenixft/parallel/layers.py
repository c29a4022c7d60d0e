"""Tensor-parallel layers against an explicit group handle (Megatron-style, no global registry).

`TPHandle` carries the tensor-parallel group of the current epoch: its size and rank are fixed for a
rank's life, its process group and wait function are re-bound at every epoch (`bind`), so the
layers of a model built once keep working after the communicators were torn down and rebuilt. Every
collective is waited with the caller's polled, abortable wait.

- `copy_to_tp` / `reduce_from_tp`: identity forward + all-reduce backward, and the converse;
- `ColumnParallelLinear`: output features split (its input gradient summed over the group);
- `RowParallelLinear`: input features split, partial outputs summed, bias added once after the sum;
- `VocabParallelEmbedding`: vocabulary rows split, lookups outside the own range give zeros, summed;
- `vocab_parallel_cross_entropy`: the loss over vocabulary-split logits without gathering them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TPHandle", "copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "split_range"]

Wait = Callable[[Any, str], None]


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of `n` items cut into `parts` contiguous, nearly equal ranges."""
    return i * n // parts, (i + 1) * n // parts


class TPHandle:
    """The tensor-parallel group of a rank: size and rank fixed, group and wait re-bound per epoch."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.pg: Any = None
        self.wait: Wait = lambda w, what: w.wait()

    def bind(self, pg: Any, wait: Wait) -> None:
        self.pg, self.wait = pg, wait

    def all_reduce(self, t: torch.Tensor, what: str, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over the group; a no-op for a group of one."""
        if self.size == 1:
            return t
        if self.pg is None:
            raise RuntimeError("tensor-parallel layer used before its group was bound")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self.pg.allreduce([t], opts), what)
        return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: TPHandle) -> torch.Tensor:
        ctx.h = h
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.h.all_reduce(g.contiguous().clone(), "tensor-parallel input gradient"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: TPHandle) -> torch.Tensor:
        return h.all_reduce(x.contiguous().clone(), "tensor-parallel partial sums")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def copy_to_tp(x: torch.Tensor, h: TPHandle) -> torch.Tensor:
    return _CopyToTP.apply(x, h) if h.size > 1 else x


def reduce_from_tp(x: torch.Tensor, h: TPHandle) -> torch.Tensor:
    return _ReduceFromTP.apply(x, h) if h.size > 1 else x


class _TPLinear(nn.Module):
    """A linear layer's local slice (weight, optional bias), copied from the full layer's tensors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, h: TPHandle) -> None:
        super().__init__()
        self.h = h
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None


class ColumnParallelLinear(_TPLinear):
    """y_local = x W_local^T + b_local, W's output rows split over the group (given as the local slice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.h), self.weight, self.bias)


class RowParallelLinear(_TPLinear):
    """y = sum over the group of x_local W_local^T, then + b (replicated, added once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.h)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the vocabulary on this rank; the other rows' lookups are summed in from the group."""

    def __init__(self, weight: torch.Tensor, lo: int, h: TPHandle) -> None:
        super().__init__()
        self.h, self.lo = h, lo
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_vocab_parallel(ids, self.weight, self.lo, self.h)


def embed_vocab_parallel(ids: torch.Tensor, weight: torch.Tensor, lo: int, h: TPHandle) -> torch.Tensor:
    if h.size == 1:
        return F.embedding(ids, weight)
    hi = lo + weight.shape[0]
    outside = (ids < lo) | (ids >= hi)
    local = (ids - lo).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, h)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, lo: int, h: TPHandle) -> torch.Tensor:
        x = logits.float()
        mx = x.max(dim=-1).values
        h.all_reduce(mx, "parallel cross-entropy max", dist.ReduceOp.MAX)
        x = x - mx.unsqueeze(-1)
        hi = lo + x.shape[-1]
        outside = (target < lo) | (target >= hi)
        local = (target - lo).masked_fill(outside, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        e = x.exp()
        both = torch.stack([e.sum(dim=-1), picked])
        h.all_reduce(both, "parallel cross-entropy sums")
        loss = (both[0].log() - both[1]).mean()
        ctx.save_for_backward(e / both[0].unsqueeze(-1), local, outside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = F.one_hot(local, grad.shape[-1]).to(grad.dtype) * (~outside).unsqueeze(-1).to(grad.dtype)
        grad -= onehot
        grad *= g / local.numel()
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, lo: int, h: TPHandle) -> torch.Tensor:
    """Mean cross-entropy of vocabulary-split logits (columns [lo, lo + width) on this rank)."""
    if h.size == 1:  # exactly what the data-parallel model computes
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return _VocabParallelCE.apply(logits, target, lo, h)
