"""The link a recovery transfer runs on: gloo all-to-all between two processes on this host.

    python bench/gloo_link.py              # 400 MB (medium's parameters), 16 MiB rounds, 2 trials
    python bench/gloo_link.py --mb 86 --chunk-mb 4

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


def _body(rank: int, port: int, n: int, chunk: int, trials: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("link", store), rank, 2, timedelta(seconds=120))
    src = _shm(n, "src").normal_() if rank == 0 else torch.empty(0)
    dst = _shm(n, "dst") if rank == 1 else torch.empty(0)
    empty = torch.empty(0)
    for trial in range(trials):
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
            print(f"trial {trial}: {n * 4 / 1e6:.0f} MB in {dt:.3f} s = {n * 4 / dt / 1e9:.2f} GB/s "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    _wait(pg.allreduce([torch.zeros(1)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=400.0)
    ap.add_argument("--chunk-mb", type=float, default=16.0)
    ap.add_argument("--trials", type=int, default=2)
    a = ap.parse_args()
    n, chunk = int(a.mb * 1e6 / 4), max(1, int(a.chunk_mb * (1 << 20) / 4))
    mp.spawn(_body, args=(29000 + os.getpid() % 2000, n, chunk, a.trials), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
