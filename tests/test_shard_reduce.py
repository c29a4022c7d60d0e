"""ShardReduce (the ZeRO-1 gradient reduce-scatter on gloo) between real processes: with two ranks
bitwise what gloo's all-reduce gives on each rank's slice; with three, bitwise the rank-order sum;
buckets of every shape (inside a slice, across slices, across all of them, empty for a rank),
special values included; the rest of the gradient is never read, so only the slice is checked."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import FakeGroup, run_ranks

from phoenixft.train.shard_reduce import ShardReduce


def _grad(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(numel, generator=g) * (10.0 ** torch.randint(-3, 4, (numel,), generator=g))
    x[rank :: 97] = torch.tensor([-0.0, float("inf"), 1e-38])[rank % 3]
    return x


def _buckets(numel: int, seed: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering [0, numel), in reverse order (as backward produces them)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted({0, numel, *(int(c) for c in torch.randint(1, numel, (5,), generator=g))})
    return list(reversed(list(zip(cuts, cuts[1:], strict=False))))


def _worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        out = []
        for size, seed in ((64, 1), (3 * 64 * 7, 2), (1000, 3), (64 * 200, 4)):
            numel = world * size
            every = [_grad(r, numel) for r in range(world)]  # every rank's gradient (to check against)
            grad = every[rank].clone()
            rs = ShardReduce(pg, grad, size)
            works = [(b, rs.post(b, lo, hi)) for b, (lo, hi) in enumerate(_buckets(numel, seed))]
            for b, w in works:
                w.wait()
                rs.finish(b)
            sl = slice(rank * size, (rank + 1) * size)
            if world == 2:
                ref = every[rank].clone()
                pg.allreduce([ref]).wait()
            else:
                ref = every[0].clone()
                for r in range(1, world):
                    ref.add_(every[r])
            out.append(bool(torch.equal(grad[sl].view(torch.int32), ref[sl].view(torch.int32))))
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_reduce_scatter_two_ranks_equals_gloo_allreduce_bitwise() -> None:
    res = run_ranks(_worker, 2)
    assert res == {r: [True] * 4 for r in range(2)}, res


def test_reduce_scatter_three_ranks_is_the_rank_order_sum() -> None:
    res = run_ranks(_worker, 3)
    assert res == {r: [True] * 4 for r in range(3)}, res


def test_reduce_scatter_refuses_a_wrong_gradient_size() -> None:
    try:
        ShardReduce(FakeGroup(2), torch.empty(5), 3)
    except ValueError as e:
        assert "expected 2 x 3" in str(e)
    else:
        raise AssertionError("no error for a wrong gradient size")
