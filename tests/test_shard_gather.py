"""gather_shards (the ZeRO-1 parameter gather on gloo) against gloo's own all-gather, bit for bit,
between real processes: three ranks, fp32 and bf16, shards that the chunk size does not divide,
special values (-0.0, NaN, inf) included."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import FakeGroup, run_ranks

from phoenixft.train.shard_gather import Works, gather_shards


def _shard(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g).to(dtype)
    x[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")]).to(dtype)
    return x


def _worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        out = []
        for dtype, numel, chunk in ((torch.float32, 10_007, 4096), (torch.bfloat16, 3_001, 1000),
                                    (torch.float32, 5, 1 << 20)):
            mine = _shard(rank, numel, dtype)
            ref = torch.empty(world * numel, dtype=dtype)
            pg._allgather_base(ref, mine).wait()
            got = torch.full((world * numel,), 7.0, dtype=dtype)
            w = gather_shards(pg, got, mine, chunk_bytes=chunk)
            assert isinstance(w, Works)
            while not w.is_completed():
                pass
            w.wait()
            out.append(bool(torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                        ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))))
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_gather_shards_equals_gloo_allgather_bitwise() -> None:
    world = 3
    res = run_ranks(_worker, world)
    assert res == {r: [True, True, True] for r in range(world)}, res


def test_gather_shards_refuses_a_wrong_output_size() -> None:
    try:
        gather_shards(FakeGroup(2), torch.empty(5), torch.empty(3))
    except ValueError as e:
        assert "expected 2 x 3" in str(e)
    else:
        raise AssertionError("no error for a wrong output size")
