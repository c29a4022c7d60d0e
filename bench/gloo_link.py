"""The link a recovery transfer runs on: gloo all-to-all between two processes on this host.

    python bench/gloo_link.py              # 400 MB (medium's parameters), 16 MiB rounds, 2 trials
    python bench/gloo_link.py --mb 86 --chunk-mb 4
    python bench/gloo_link.py --gather --mb 21.6 --chunk-mb 4   # the ZeRO-1 parameter gather, DP=2
    python bench/gloo_link.py --lanes 1,2,3   # 1, 2 and 3 connections per pair (2 threads per lane)

`--gather`: both ranks exchange an `--mb` shard, gloo's `_allgather_base` against
`phoenixft.train.shard_gather.gather_shards` (all-to-all rounds), alternated; checks they agree bitwise.

Two processes, one gloo group on a TCPStore, the sender's tensor in /dev/shm (as a worker's flat
buffer is), received into a pre-touched /dev/shm tensor, in rounds of `--chunk-mb` posted at once
and waited in order - what recovery/transfer.py does, with nothing else running in the processes.
Prints GB/s per trial: the floor a hot-swap's transfer is compared against (bench/transfer.py).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _shm(n: int, tag: str) -> torch.Tensor:
    path = f"/dev/shm/phoenixft-gloo-link-{os.getpid()}-{tag}"
    with open(path, "wb") as f:
        f.truncate(n * 4)
    t = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
    os.unlink(path)
    return t.zero_()


def _wait(w: object) -> None:
    deadline = time.monotonic() + 120
    while not w.is_completed():  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError("gloo all-to-all")
        time.sleep(0.0002)
    w.wait()  # type: ignore[attr-defined]


def _body(rank: int, port: int, n: int, chunk: int, trials: int, lanes: list[int]) -> None:
    from phoenixft.distributed.comm import gloo_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    groups = {k: gloo_group(dist.PrefixStore(f"link{k}", store), rank, 2, timedelta(seconds=120), lanes=k,
                            threads=2 * k) for k in lanes}
    src = _shm(n, "src").normal_() if rank == 0 else torch.empty(0)
    dst = _shm(n, "dst") if rank == 1 else torch.empty(0)
    for trial in range(trials):
        for k, pg in groups.items():
            _trial(rank, pg, n, chunk, src, dst, f"trial {trial}, {k} lane(s)")
    _wait(groups[lanes[0]].allreduce([torch.zeros(1)]))


def _trial(rank: int, pg: Any, n: int, chunk: int, src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    empty = torch.empty(0)
    _wait(pg.allreduce([torch.zeros(1)]))
    t = time.perf_counter()
    works = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        if rank == 0:
            works.append(pg.alltoall_base(empty, src[lo:hi], [0, 0], [0, hi - lo], dist.AllToAllOptions()))
        else:
            works.append(pg.alltoall_base(dst[lo:hi], empty, [hi - lo, 0], [0, 0], dist.AllToAllOptions()))
    for w in works:
        _wait(w)
    dt = time.perf_counter() - t
    if rank == 1:
        print(f"{what}: {n * 4 / 1e6:.0f} MB in {dt:.3f} s = {n * 4 / dt / 1e9:.2f} GB/s "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)


def _gather_body(rank: int, port: int, n: int, chunk: int, trials: int) -> None:
    from phoenixft.train.shard_gather import gather_shards

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gather", store), rank, 2, timedelta(seconds=120))
    mine = _shm(n, "mine").normal_()
    outs = {"allgather": _shm(2 * n, "a"), "gather_shards": _shm(2 * n, "b")}
    for trial in range(trials):
        for name, out in outs.items():
            _wait(pg.allreduce([torch.zeros(1)]))
            t = time.perf_counter()
            _wait(pg._allgather_base(out, mine) if name == "allgather" else gather_shards(pg, out, mine, chunk * 4))
            dt = time.perf_counter() - t
            if rank == 0:
                print(f"trial {trial} {name}: {n * 4 / 1e6:.1f} MB per rank in {dt * 1e3:.1f} ms = "
                      f"{n * 4 / dt / 1e9:.2f} GB/s per direction (load average {os.getloadavg()[0]:.1f})", flush=True)
    assert torch.equal(outs["allgather"].view(torch.int32), outs["gather_shards"].view(torch.int32))
    _wait(pg.allreduce([torch.zeros(1)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=400.0)
    ap.add_argument("--chunk-mb", type=float, default=16.0)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--gather", action="store_true", help="the parameter gather: all-gather vs gather_shards")
    ap.add_argument("--lanes", default="1,2", help="comma-separated connections per pair to compare (gloo devices; "
                    "the recovery transfer uses phoenixft.distributed.comm.XFER_LANES), each with 2 threads per lane")
    a = ap.parse_args()
    try:
        lanes = [int(x) for x in a.lanes.split(",")]
        if not lanes or min(lanes) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--lanes={a.lanes!r} is invalid: comma-separated integers >= 1, e.g. 1,2")
    n, chunk = int(a.mb * 1e6 / 4), max(1, int(a.chunk_mb * (1 << 20) / 4))
    port = 29000 + os.getpid() % 2000
    if a.gather:
        mp.spawn(_gather_body, args=(port, n, chunk, a.trials), nprocs=2)
    else:
        mp.spawn(_body, args=(port, n, chunk, a.trials, lanes), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
