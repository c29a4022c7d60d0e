"""A training script that uses what real scripts use, each behind a flag, for tests/test_script_features.py:

    --opt adamw|sgd|adagrad|rmsprop|adam   any torch.optim optimizer (SGD with momentum and Nesterov)
    --sched cosine|lambda|step|onecycle    any LR scheduler
    --accum K                              gradient accumulation over K microbatches (DDP no_sync)
    --amp                                  torch.autocast to bfloat16 (CPU)
    --loader map|stateful                  a map-style DataLoader, or torchdata's StatefulDataLoader over an
                                           iterable dataset this rank streams its own share of
    --ema                                  an exponential moving average of the weights (job.register_state)
    --batchnorm                            a BatchNorm layer: running statistics, a buffer each rank updates
    --fsdp                                 FSDP2 (fully_shard) instead of DDP
    --pace S                               each step sleeps S seconds (a run that outlasts a node's repair)
    --exact                                no dropout and no noise in the samples, and the loss logged is the mean
                                           over the whole global batch (a sum over the ranks): a shrink then
                                           changes only the grouping of the gradient's sums

It prints nothing but what phoenixft reports (job.log(loss=...)).
"""

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

import phoenixft


class Teacher(Dataset):
    noise = 0.01

    def __init__(self, n: int = 4096, dim: int = 16, classes: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, classes, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + self.noise * torch.randn(self.x.shape[1]), self.y[i]  # (a draw from the step's generator)


class Stream(IterableDataset):
    """This rank's share of an endless stream: sample i goes to rank i % world. Its position is its state (so a
    StatefulDataLoader resumes it there rather than replaying the stream)."""

    def __init__(self, rank: int, world: int) -> None:
        self.data, self.rank, self.world = Teacher(), rank, world
        self.i = rank

    def __iter__(self):
        while True:
            x = self.data[self.i % len(self.data)]
            self.i += self.world  # (first: the state says which sample comes next)
            yield x

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--opt", default="adamw")
    p.add_argument("--sched", default="cosine")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--loader", default="map")
    p.add_argument("--ema", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--exact", action="store_true")
    p.add_argument("--pace", type=float, default=0.0, help="seconds each step sleeps (a run that lasts a while)")
    a = p.parse_args()
    if a.exact:
        Teacher.noise = 0.0

    job = phoenixft.init()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64)] + ([torch.nn.BatchNorm1d(64)] if a.batchnorm else []) + [
        torch.nn.GELU(), torch.nn.Dropout(0.0 if a.exact else 0.1), torch.nn.Linear(64, 8)]
    net = torch.nn.Sequential(*layers)
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)) \
        if a.ema else None
    if a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.world_size,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = job.wrap_model(fully_shard(net, mesh=mesh))
    else:
        model = job.wrap_model(net)
    opt = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
           "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3, amsgrad=True),
           "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
           "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
           "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5)}[a.opt](model.parameters())
    sched = {"cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps),
             "lambda": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s)),
             "step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
             "onecycle": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=a.steps + 1)}[
        a.sched]()
    job.wrap_optimizer(opt, scheduler=sched)
    if ema is not None:
        job.register_state("ema", ema)
    if a.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = job.wrap_loader(StatefulDataLoader(Stream(job.rank, job.world_size), batch_size=16))
        data = iter(loader)
    else:
        data = job.wrap_loader(DataLoader(Teacher(), batch_size=16, shuffle=True))
    for step in job.steps(a.steps):
        with job.step(step):
            total, seen = 0.0, 0
            for k in range(a.accum):
                x, y = next(data)
                seen += len(y)
                sync = model.no_sync() if (a.accum > 1 and k < a.accum - 1 and not a.fsdp) else None
                with sync if sync is not None else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp):
                        loss = F.cross_entropy(model(x), y) / a.accum
                    loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            if ema is not None:
                ema.update_parameters(net)
            if a.exact:  # the whole global batch's mean: each rank's mean weighed by its samples
                t = torch.tensor([total * seen, float(seen)], dtype=torch.float64)
                torch.distributed.all_reduce(t)
                total = float(t[0] / t[1])
            job.log(loss=total)
            time.sleep(a.pace)


if __name__ == "__main__":
    main()
