"""The reference workload: a small decoder-only GPT (nanoGPT-like), byte level (vocabulary 256) by default.

Presets: `tiny` (~0.8M parameters, for tests), `small` (~11M, for benchmarks), `medium`
(~100M, for scaling runs). Dropout is 0 so a step is a pure function of its inputs.
`workload(ctx)` is the default `--workload`; with `--data` it trains on that token file, with
the data's vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from phoenixft.workload import Workload, WorkloadContext

__all__ = ["GPTConfig", "GPT", "PRESETS", "workload"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int = 256


PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=32),  # tiny's shape at 1/14 of its parameters
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),
    "medium": GPTConfig(n_layer=14, n_head=12, n_embd=768, block_size=256),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.fc_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()  # weight tying


def workload(ctx: WorkloadContext) -> Workload:
    """The default workload: GPT preset `ctx.model` on `ctx.data` (a token file) or the stdlib corpus.

    With a token file the model's vocabulary is the data's (sidecar `vocab_size`, else max id + 1).
    """
    from phoenixft.data import Corpus, TokenData, open_data

    cfg = PRESETS[ctx.model]
    opened: list[Corpus | TokenData] = []  # opened lazily, once per process

    def source() -> Corpus | TokenData:
        if not opened:
            opened.append(open_data(ctx.data, ctx.data_dtype) if ctx.data else Corpus())
        return opened[0]

    def build_model() -> GPT:
        src = source()
        return GPT(replace(cfg, vocab_size=src.vocab_size) if isinstance(src, TokenData) else cfg)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = source()
        if isinstance(src, TokenData):
            return src.sample(seed=ctx.seed, step=step, index=index, batch=ctx.micro_batch,
                              microbatches=ctx.microbatches, block=cfg.block_size)
        return src.sample(seed=ctx.seed, step=step, index=index, batch=ctx.micro_batch, block=cfg.block_size)

    def eval_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return source().eval_sample(seed=ctx.seed, index=index, batch=ctx.micro_batch, block=cfg.block_size)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def prepare() -> None:  # in the launcher, once: builds the corpus cache, or the data's vocabulary cache
        source()

    from phoenixft.parallel.gpt import split_gpt

    return Workload(
        split=split_gpt,
        build_model=build_model,
        loss=loss,
        batch=batch,
        eval_batch=eval_batch,
        tokens_per_microbatch=ctx.micro_batch * cfg.block_size,
        prepare=prepare,
    )
