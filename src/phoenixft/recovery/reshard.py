"""Repartition the optimizer state when the data-parallel world changes size (shrink or grow).

Under 3D parallelism each (pp, tp) stage is repartitioned among its own data-parallel ranks (a shrink
drops whole data-parallel replicas, so every survivor keeps its stage): a rank gathers the old shards of
its stage only, from the providers of its stage.

Used when a permanent failure finds too few spares (the survivors continue with fewer ranks)
and when a spare arrives later (the job grows back). Every logical shard of the old partition
has one *provider* in the new epoch: its owner if it survived (its own committed half), else a
rank that keeps a verified replica. Providers send their shards' (exp_avg, exp_avg_sq) to every
member in one all-to-all; each member reassembles the full vectors in logical order and cuts
its new contiguous slice. Parameters come from each survivor's own buffer (or, for a new node,
from a healthy peer). The global batch is unchanged: the microbatches of a step are spread over
the new world (uneven counts allowed), so every step still sees the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.distributed.comm import alltoallv
from phoenixft.parallel.layout import shard_numel_of

__all__ = ["gather_full_optimizer", "old_shard_numel"]


def old_shard_numel(numel: int, old_world: int) -> int:
    return shard_numel_of(numel, old_world)


def gather_full_optimizer(
    pg: Any,
    world: int,
    rank: int,
    providers: dict[int, int],
    mine: dict[int, torch.Tensor],
    n_old: int,
    wait: Callable[[Any, str], None],
    rows: int = 2,
    peers: list[int] | None = None,
) -> torch.Tensor:
    """Return (rows, n_old * old_shards): the payload rows (e.g. exp_avg, exp_avg_sq) of every old
    shard of this rank's stage, in logical order.

    `providers[shard]` is the new rank providing old `shard` (numbered by its data-parallel index within the
    stage); `mine[shard]` holds a (rows, n_old) payload for each shard this rank provides. `peers`: the ranks
    of this rank's stage, which need what it provides (every rank when data-parallel only: the default); a
    mesh repartitions each stage among its own data-parallel ranks in the same all-to-all.
    """
    shards = sorted(providers)
    my_shards = [s for s in shards if providers[s] == rank]
    payload = torch.cat([mine[s].reshape(rows, n_old) for s in my_shards], dim=1).reshape(-1) if my_shards \
        else torch.empty(0)
    sends = {dst: payload for dst in (range(world) if peers is None else peers)} if my_shards else {}
    count: dict[int, int] = {}
    for s in shards:
        count[providers[s]] = count.get(providers[s], 0) + 1
    recv = {p: c * rows * n_old for p, c in count.items()}
    work, _, got = alltoallv(pg, world, sends, recv)
    wait(work, "optimizer repartition")
    full = torch.empty(rows, n_old * len(shards))
    for p, buf in got.items():
        block = buf.view(rows, -1)
        for j, s in enumerate(s for s in shards if providers[s] == p):
            full[:, s * n_old : (s + 1) * n_old] = block[:, j * n_old : (j + 1) * n_old]
    return full
