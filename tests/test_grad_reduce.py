"""The gradient reduction's choice, and the NCCL reduce-scatter (`OwnerReduce`) run on gloo between
real processes: the same reduced shard as the gloo path (bitwise with two ranks, where a sum of two
is one addition; to rounding with three), buckets of every shape; and a whole training run forced
onto it through `Trainer.step`, bitwise the gloo path's final state with two ranks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import FakeGroup, run_ranks
from test_shard_reduce import _buckets, _grad

from phoenixft.train.grad_reduce import OwnerReduce, gradient_reduction
from phoenixft.train.shard_reduce import ShardReduce


def test_reduce_scatter_is_chosen_on_nccl_and_the_all_to_all_on_gloo() -> None:
    assert gradient_reduction("nccl", tied=False) == "reduce-scatter"
    assert gradient_reduction("gloo", tied=False) == "all-to-all"
    assert gradient_reduction("nccl", tied=True) == gradient_reduction("gloo", tied=True) == "all-reduce"
    with pytest.raises(NotImplementedError):
        gradient_reduction("mpi", tied=False)


def test_parts_cover_the_bucket_once_each_with_its_owner() -> None:
    r = OwnerReduce(FakeGroup(3), torch.empty(30), 10)
    assert r.parts(5, 25) == [(0, 5, 10), (1, 10, 20), (2, 20, 25)]
    assert r.parts(12, 18) == [(1, 12, 18)]
    assert r.parts(20, 20) == []
    with pytest.raises(ValueError, match="expected 3 x 10"):
        OwnerReduce(FakeGroup(3), torch.empty(31), 10)


def _worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        out = []
        for size, seed in ((64, 1), (3 * 64 * 7, 2), (1000, 3), (64 * 200, 4)):
            numel = world * size
            sl = slice(rank * size, (rank + 1) * size)
            got = {}
            for kind in (ShardReduce, OwnerReduce):
                grad = _grad(rank, numel)
                red: Any = kind(pg, grad, size)
                works = [(b, red.post(b, lo, hi)) for b, (lo, hi) in enumerate(_buckets(numel, seed))]
                for b, w in works:
                    w.wait()
                    red.finish(b)
                got[kind.__name__] = grad[sl].clone()
            a, b = got["ShardReduce"], got["OwnerReduce"]
            if world == 2:
                out.append(bool(torch.equal(a.view(torch.int32), b.view(torch.int32))))
            else:  # another order of the same sum: equal to rounding (infinities where the other has them)
                scale = sum(_grad(r, numel)[sl].abs() for r in range(world))
                finite = torch.isfinite(a)
                out.append(bool(torch.equal(finite, torch.isfinite(b)) and torch.equal(a[~finite], b[~finite])
                                and bool(((a - b)[finite].abs() <= 1e-6 * scale[finite]).all())))
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_owner_reduce_two_ranks_is_bitwise_the_gloo_path() -> None:
    res = run_ranks(_worker, 2)
    assert res == {r: [True] * 4 for r in range(2)}, res


def test_owner_reduce_three_ranks_is_the_same_sum() -> None:
    res = run_ranks(_worker, 3)
    assert res == {r: [True] * 4 for r in range(3)}, res


def _train_worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Three steps of the tiny GPT on `world` ranks through `Trainer.step`, once per reduction."""
    try:
        import phoenixft.train.trainer as trainer_mod
        from phoenixft.config import RunConfig
        from phoenixft.distributed.comm import EpochComm, wait_work
        from phoenixft.parallel.layout import Layout
        from phoenixft.parallel.stage import WholeModel
        from phoenixft.workload import WorkloadContext, load_workload

        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        cfg = RunConfig(nodes=world, steps=3, protect="none", spares=0, clip_grad_norm=0.5, device="cpu")
        shas = []
        for epoch, how in enumerate(("all-to-all", "reduce-scatter")):
            trainer_mod.gradient_reduction = lambda backend, tied, how=how: how  # type: ignore[misc]
            wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
            torch.manual_seed(cfg.seed)
            tr = trainer_mod.Trainer(cfg, wl, WholeModel(wl.build_model(), wl.loss))
            tr.partition(world, None)
            comm = EpochComm(store, epoch, rank, world, 60.0)
            tr.init_shard(rank, rank, world)
            tr.resume(0)

            def wait(w: Any, what: str) -> None:
                wait_work(w, what, lambda: None, 60.0)

            per = cfg.total_microbatches // world
            for s in range(1, 4):
                tr.step(s, comm, rank, Layout(world), (rank * per, (rank + 1) * per), wait,
                        before_reduce=lambda: 0.0, fault=lambda phase: None)
            assert type(tr._rs).__name__ == ("OwnerReduce" if how == "reduce-scatter" else "ShardReduce")
            shas.append(tr.final_state(comm, rank, Layout(world), 3, wait)[0])
            comm.retire()
        q.put((rank, shas))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_training_on_the_reduce_scatter_path_is_bitwise_the_gloo_path() -> None:
    res = run_ranks(_train_worker, 2, timeout_s=300.0)
    assert set(res) == {0, 1} and all(isinstance(v, list) for v in res.values()), res
    assert res[0][0] and res[0][0] == res[0][1], res
