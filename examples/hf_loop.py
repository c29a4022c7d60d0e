"""A HuggingFace `transformers` model in a plain PyTorch loop, protected by phoenixft.

    pip install transformers
    phoenixft launch --nodes 2 --spares 1 examples/hf_loop.py --steps 40
    phoenixft launch --nodes 2 --spares 1 --inject kill:node=1@step=20,phase=backward examples/hf_loop.py --steps 40
    torchrun --nproc-per-node 2 examples/hf_loop.py --steps 40     # the same script, unprotected

A tiny GPT-2 (`GPT2LMHeadModel(GPT2Config(...))`: 2 layers, 64 wide, a byte vocabulary; nothing is downloaded)
trained from random init with AdamW, a linear warm-up then cosine decay from `transformers`, gradient
accumulation and clipping, on fixed-length windows of a text corpus (the Python standard library's source, as
phoenixft's own data reads it) through a plain `DataLoader`. The loss is the model's own (`labels=`).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import phoenixft

BLOCK = 64


class Windows(Dataset):  # type: ignore[type-arg]
    """Non-overlapping windows of BLOCK + 1 bytes of the corpus: (input ids, labels)."""

    def __init__(self, n: int = 20_000) -> None:
        from phoenixft.data import ensure_corpus

        data = np.memmap(ensure_corpus(), dtype=np.uint8, mode="r")
        self.data, self.n = data, min(n, len(data) // BLOCK - 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.asarray(self.data[i * BLOCK : i * BLOCK + BLOCK]).astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    args = p.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

    job = phoenixft.init()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_layer=2, n_embd=64, n_head=2, n_positions=BLOCK, bos_token_id=0,
                        eos_token_id=0)
    model = job.wrap_model(GPT2LMHeadModel(config).to(job.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=args.steps)
    job.wrap_optimizer(opt, scheduler=sched)
    data = job.wrap_loader(DataLoader(Windows(), batch_size=args.batch_size, shuffle=True))

    for step in job.steps(args.steps):
        with job.step(step):
            total = 0.0
            for k in range(args.accum):
                batch = {name: t.to(job.device) for name, t in next(data).items()}
                with model.no_sync() if k < args.accum - 1 else torch.enable_grad():
                    loss = model(**batch).loss / args.accum
                    loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            job.log(loss=total)
            if job.rank == 0 and step % 10 == 0:
                print(f"step {step}: loss {total:.4f}", flush=True)


if __name__ == "__main__":
    main()
