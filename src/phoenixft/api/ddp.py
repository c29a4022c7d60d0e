"""Data parallelism for a script's model that survives a recovery: torch's DDP, rebuilt every epoch.

`ResilientDDP(module)` is what `job.wrap_model` returns for a plain module: an `nn.Module` whose
`module` is the user's (so its `state_dict()` keys read `module.…` as DDP's do) and whose forward runs
a `DistributedDataParallel` over the job's `ResilientGroup`. After every recovery each rank builds
that DDP anew around the same module (`rebuild`): a DDP's reducer keeps per-iteration state (its
rebuilt buckets, a half-done reduction) that a new member would not share, so every member starts
the epoch from a fresh one, in step. It is built with `init_sync=False` (no collective while a
member may still be setting up; the job synchronises the state itself).

The gradient reduction goes through a communication hook: it divides by the world size as DDP does
while every rank draws the same number of samples, and weighs each rank's gradient by its share of the
step's samples when a shrink made the split uneven, so that the sum is the gradient of the whole global
batch; the sum itself is computed in rank order whatever DDP's bucket layout (api/ordered.py), so the
first step after a recovery, with DDP's buckets as a new DDP lays them out, sums as the failure-free
run did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from phoenixft.api.ordered import OrderedReducer

__all__ = ["ResilientDDP"]


class ResilientDDP(torch.nn.Module):
    """A module trained data-parallel over the job's group, across epochs."""

    _group: Any
    _before: Callable[[], None]
    _share: Callable[[], tuple[int, int]]
    _kw: dict[str, Any]
    _reducer: OrderedReducer

    def __init__(self, module: torch.nn.Module, group: Any, share: Callable[[], tuple[int, int]],
                 before_reduce: Callable[[], None] = lambda: None, wait: Any = None, **ddp_kwargs: Any) -> None:
        """`share()`: (samples this rank drew, samples of the global batch) in the current step; `before_reduce()`
        runs before every bucket's reduction (the job waits there, once a step, for the previous step's
        protection: a failure during the reduction then finds it complete)."""
        super().__init__()
        self.module = module
        object.__setattr__(self, "_before", before_reduce)
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_share", share)
        object.__setattr__(self, "_kw", ddp_kwargs)
        object.__setattr__(self, "_ddp", None)
        object.__setattr__(self, "_reducer", OrderedReducer(group, wait or (lambda w, _what: w.wait())))

    def rebuild(self) -> None:
        """A fresh DDP around the module, over the group as the current epoch has it."""
        old = self.__dict__.get("_ddp")
        object.__setattr__(self, "_ddp", None)
        del old  # (its reducer's hooks go with it)
        ddp = DistributedDataParallel(self.module, process_group=self._group, init_sync=False, **self._kw)
        me = self

        def hook(_state, bucket):  # (no annotations: DDP refuses any but its own, and these are strings here)
            return me._reduce(bucket)

        ddp.register_comm_hook(None, hook)
        object.__setattr__(self, "_ddp", ddp)

    def _reduce(self, bucket: Any) -> Any:
        self._before()
        t = bucket.buffer()
        mine, total = self._share()
        world = self._group.size()
        if total == 0 or mine * world == total:
            t.div_(world)  # (DDP's own: the same bits as an unprotected run's)
        else:
            t.mul_(mine / total)
        return self._reducer.submit(t)

    @property
    def ddp(self) -> DistributedDataParallel:
        d = self.__dict__.get("_ddp")
        if d is None:
            raise RuntimeError("phoenixft: the model is trained once the job has joined its first epoch "
                               "(inside `for step in job.steps(n)`)")
        return d

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (as `DistributedDataParallel.no_sync`)."""
        with self.ddp.no_sync():
            yield
