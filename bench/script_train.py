"""The training script bench/script_overhead.py runs under torchrun and under phoenixft launch: the example's
DDP loop (examples/ddp_script_phoenixft.py: AdamW, a cosine schedule, clipping, a DataLoader) on a wider MLP,
timing each step (the whole `with job.step(...)`, its snapshot included) on rank 0 into `--times PATH`.

    torchrun --nproc-per-node 2 bench/script_train.py --steps 40 --times /tmp/t.json
    phoenixft launch --nodes 2 bench/script_train.py --steps 40 --times /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import phoenixft


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--times", default="")
    a = p.parse_args()

    job = phoenixft.init()
    torch.manual_seed(0)
    dims = [256] + [a.hidden] * a.layers
    layers: list[torch.nn.Module] = []
    for i in range(a.layers):
        layers += [torch.nn.Linear(dims[i], dims[i + 1]), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(a.hidden, 16))
    model = job.wrap_model(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    job.wrap_optimizer(opt, scheduler=sched)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 256, generator=g)
    data = job.wrap_loader(DataLoader(TensorDataset(x, (x[:, :16] > 0).long().sum(1) % 16), batch_size=a.batch_size,
                                      shuffle=True))
    times: list[float] = []
    for step in job.steps(a.steps):
        t0 = time.perf_counter()
        with job.step(step):
            xb, yb = next(data)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            job.log(loss=loss)
        times.append(time.perf_counter() - t0)
    if a.times and job.rank == 0:
        with open(a.times, "w") as f:
            json.dump({"times": times, "params": sum(p.numel() for p in net.parameters())}, f)


if __name__ == "__main__":
    main()
