"""`phoenixft.init()` outside a phoenixft job: the same methods, nothing protected.

Run with `python train.py` (one process) or `torchrun train.py` (torch.distributed's own group, from
the environment torchrun sets): models are wrapped in plain `DistributedDataParallel` (none with one
process), loaders draw the same samples by step as under `phoenixft launch` (api/loader.py), and every
step is seeded the same way, so a script's run here and its protected run compute the same thing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.api.loader import StepLoader, is_map_style, seed_step

__all__ = ["LocalJob"]


class LocalJob:
    """An unprotected job: `python train.py` or `torchrun train.py`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized():  # (one process: a group of one, so that the script's dist.* calls work)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if world > 1:
                dist.init_process_group(backend=backend)
            else:
                dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.node = os.environ.get("HOSTNAME", "local")
        self.loaders: list[StepLoader] = []
        torch.manual_seed(seed)

    def wrap_model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        if self.world_size == 1 or any(hasattr(p, "placements") for p in module.parameters()):
            return module
        return torch.nn.parallel.DistributedDataParallel(module, **ddp_kwargs)

    def wrap_optimizer(self, optimizer: Any, scheduler: Any = None) -> Any:  # noqa: ARG002 - nothing to protect
        return optimizer

    def wrap_scheduler(self, scheduler: Any) -> Any:
        return scheduler

    def wrap_loader(self, loader: Any) -> Any:
        if is_map_style(loader):
            sl = StepLoader(loader, self.seed, self.world_size, lambda: (self.rank, self.world_size))
            self.loaders.append(sl)
            return sl
        return loader

    def register_state(self, name: str, obj: Any, per_rank: bool = False) -> Any:  # noqa: ARG002
        return obj

    def log(self, **metrics: Any) -> None:
        pass

    def steps(self, n: int) -> Iterator[int]:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"phoenixft: job.steps({n!r}): the number of steps must be an int >= 1")
        yield from range(1, n + 1)

    @contextmanager
    def step(self, s: int) -> Iterator[int]:
        cuda = self.local_rank if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        seed_step(self.seed, s, self.rank, cuda)
        for sl in self.loaders:
            sl.begin_step()
        yield s
