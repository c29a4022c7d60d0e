"""A script's data, by step: each rank's share of every global batch, whatever the world is now.

`job.wrap_loader(loader)` on a `DataLoader` over a map-style dataset (one with `__len__` and
`__getitem__`; a `DistributedSampler`'s or a `StatefulDataLoader`'s alike) returns a `StepLoader`. It
draws the run's samples itself, deterministically: epoch e visits the dataset in the order of a
permutation seeded by (seed, e) when the loader shuffles (its sampler is a `RandomSampler`, or a
`DistributedSampler` with `shuffle=True`), in index order otherwise. Each `next(loader)` is one
*global* microbatch of `batch_size x W0` samples (W0: the data-parallel width the run started with),
of which this rank gets a contiguous share: `batch_size` samples while the world is whole, more
after a shrink, so the global batch stays the same. A microbatch that would cross the end of an
epoch starts the next one (as `drop_last`). Its position is one number, the *cursor*, the same on
every rank: it is part of every step's snapshot, so a recovery resumes mid-epoch at the sample the
failed step started from.

With `num_workers` > 0 the batches are loaded by a `DataLoader` over the same indices (its workers
restarted after a recovery). `share()` tells the gradient reduction this rank's share of the step's
samples (an uneven split after a shrink weighs ranks by their samples).

An iterable dataset has no index to draw by: a loader with `state_dict()`/`load_state_dict()` (a
`StatefulDataLoader`) is protected as it is, as this rank's own state; its stream cannot be
re-divided, so a shrink keeps each rank's batch instead of the global batch, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from phoenixft.data import _mix

__all__ = ["StepLoader", "StatefulLoader", "is_map_style", "shuffles", "seed_step"]


def seed_step(seed: int, step: int, rank: int, cuda_index: int | None) -> None:
    """Seed every generator a step may draw from, from (seed, step, data-parallel rank): torch's CPU generator and
    this rank's GPU's (`cuda_index`, where CUDA is initialised), Python's `random`, NumPy's global one."""
    import random
    import sys

    x = _mix(seed, step, rank)
    torch.default_generator.manual_seed(x)
    if cuda_index is not None:
        torch.cuda.default_generators[cuda_index].manual_seed(x)
    random.seed(x)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(x % (1 << 32))


def is_map_style(loader: Any) -> bool:
    ds = getattr(loader, "dataset", None)
    return ds is not None and hasattr(ds, "__getitem__") and hasattr(ds, "__len__") and \
        getattr(loader, "batch_size", None) is not None


def shuffles(loader: Any) -> bool:
    """Whether `loader` visits its dataset in a random order (its sampler says)."""
    from torch.utils.data import RandomSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, RandomSampler):
        return True
    return bool(getattr(sampler, "shuffle", False))


class StepLoader:
    """Microbatches of the run's global batches for this rank (see the module docstring)."""

    def __init__(self, loader: Any, seed: int, world0: int, rank_share: Callable[[], tuple[int, int]]) -> None:
        """`rank_share()`: (this rank's data-parallel index, the data-parallel width) now."""
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size)
        self.collate = loader.collate_fn
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.shuffle = shuffles(loader)
        self.seed, self.world0 = seed, world0
        self.global_batch = self.batch_size * world0
        self.n = len(self.dataset)
        if self.n < self.global_batch:
            raise ValueError(f"phoenixft: the dataset has {self.n} samples, fewer than one global batch "
                             f"({self.batch_size} x {world0} ranks = {self.global_batch})")
        self.rank_share = rank_share
        self.cursor = 0  # samples drawn since the run started (whole global microbatches)
        self._perm: tuple[int, torch.Tensor] | None = None
        self._workers_iter: Iterator[Any] | None = None
        self._share = (0, 0)

    # ---------------------------------------------------------------- the run's order
    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is not None and self._perm[0] == epoch:
            return self._perm[1]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_mix(self.seed, epoch, 0x10AD))
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        self._perm = (epoch, order)
        return order

    def per_epoch(self) -> int:
        """Global microbatches per epoch."""
        return self.n // self.global_batch

    def __len__(self) -> int:
        return self.per_epoch()

    def indices(self, cursor: int, dp: int, world: int) -> list[int]:
        """This rank's share (data-parallel index `dp` of `world`) of the global microbatch at `cursor`."""
        per = self.per_epoch()
        k = cursor // self.global_batch
        epoch, j = divmod(k, per)
        order = self._order(epoch)
        lo = j * self.global_batch
        a, b = lo + dp * self.global_batch // world, lo + (dp + 1) * self.global_batch // world
        return order[a:b].tolist()

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> Any:
        dp, world = self.rank_share()
        idx = self.indices(self.cursor, dp, world)
        self.cursor += self.global_batch
        self._share = (self._share[0] + len(idx), self._share[1] + self.global_batch)
        if self.num_workers > 0:
            return self._from_workers(idx)
        return self.collate([self.dataset[i] for i in idx])

    def _from_workers(self, idx: list[int]) -> Any:
        from torch.utils.data import DataLoader

        if self._workers_iter is None:
            self._workers_iter = iter(DataLoader(self.dataset, batch_sampler=_Follow(self), collate_fn=self.collate,
                                                 num_workers=self.num_workers, pin_memory=self.loader.pin_memory))
        return next(self._workers_iter)

    def share(self) -> tuple[int, int]:
        """(samples this rank drew, samples of the global microbatches) since the step began."""
        return self._share

    def begin_step(self) -> None:
        self._share = (0, 0)

    # ---------------------------------------------------------------- its state
    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if int(sd.get("global_batch", self.global_batch)) != self.global_batch:
            raise ValueError(f"phoenixft: the snapshot's global batch is {sd['global_batch']} samples, this "
                             f"loader's {self.global_batch}")
        self.cursor = int(sd["cursor"])
        self._workers_iter = None  # (its workers prefetched past the cursor, for the world as it was: restarted)


class _Follow:
    """The batch sampler of a `StepLoader`'s worker-backed `DataLoader`: the shares of the global
    microbatches from the cursor on, for the world as it is when each is drawn."""

    def __init__(self, owner: StepLoader) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        c = self.owner.cursor - self.owner.global_batch
        while True:
            dp, world = self.owner.rank_share()
            yield self.owner.indices(c, dp, world)
            c += self.owner.global_batch

    def __len__(self) -> int:
        return 1 << 62


class StatefulLoader:
    """A loader with `state_dict()`/`load_state_dict()` (torchdata's `StatefulDataLoader`), iterated through one
    iterator this object keeps: after a recovery loads a snapshot's position, the next batch comes from a new
    iterator that resumes there (an iterator the script made earlier would go on from where it was)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._it: Iterator[Any] | None = None
        self._said = False

    def __iter__(self) -> StatefulLoader:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            # (a loader that resumes by replaying its stream up to the position, as StatefulDataLoader does for a
            # dataset without a state of its own, draws from the generators as it replays: those draws must not
            # change what the step itself draws, or a resumed run would not be the run it resumes)
            with torch.random.fork_rng(devices=[]):
                self._it = iter(self.loader)
        return next(self._it)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._it = None
        self.loader.load_state_dict(sd)
        fetcher = sd.get("fetcher_state") or {}
        if "dataset_state" in sd and sd.get("dataset_state") is None and isinstance(fetcher, dict) and \
                fetcher.get("dataset_iter_state") is None and not self._said:
            self._said = True
            print("phoenixft: the loader's iterable dataset has no state_dict()/load_state_dict(): torchdata resumes "
                  "it by replaying its stream up to the position (slow for a long run; and the position it reports "
                  "after such a resume counts the replayed samples twice, so a second recovery would skip ahead). "
                  "Give the dataset (or its iterator) a state_dict() and load_state_dict() (docs/script.md)",
                  flush=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
