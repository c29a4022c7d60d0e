"""A plain PyTorch DDP training script, as people write it: a DataLoader with a DistributedSampler,
AdamW, a cosine learning-rate schedule and gradient clipping.

    phoenixft launch --nodes 2 --spares 1 examples/ddp_script_phoenixft.py --steps 200  # (or torchrun, unprotected)

examples/ddp_script_phoenixft.py is this script protected by phoenixft: its lines marked `# phoenixft` differ.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import phoenixft  # phoenixft


class TeacherData(Dataset):
    """Inputs drawn once from a seed; labels from a fixed random teacher network."""

    def __init__(self, n: int = 8192, dim: int = 32, classes: int = 10) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        teacher = torch.randn(dim, classes, generator=g)
        self.y = (self.x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model(dim: int = 32, hidden: int = 256, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, classes))


def batches(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    job = phoenixft.init()  # phoenixft
    rank = job.rank  # phoenixft
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = job.wrap_model(make_model().to(device))  # phoenixft
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    job.wrap_optimizer(opt, scheduler=sched)  # phoenixft
    dataset = TeacherData()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    data = job.wrap_loader(loader)  # phoenixft

    def train_step(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        job.log(loss=loss)  # phoenixft
        if rank == 0 and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    for step in job.steps(args.steps):  # phoenixft
        with job.step(step):  # phoenixft
            train_step(*next(data), step)


if __name__ == "__main__":
    main()
