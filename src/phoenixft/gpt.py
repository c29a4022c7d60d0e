"""The reference workload: a small decoder-only GPT (nanoGPT-like), byte level (vocabulary 256).

Presets: `tiny` (~0.8M parameters, for tests), `small` (~11M, for benchmarks), `medium`
(~100M, for scaling runs). Dropout is 0 so a step is a pure function of its inputs.
`workload(ctx)` is the default `--workload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """The default workload: GPT preset `ctx.model` on the stdlib corpus."""
    from phoenixft.data import Corpus, ensure_corpus

    cfg = PRESETS[ctx.model]
    corpus: list[Corpus] = []  # opened lazily, once per process

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not corpus:
            corpus.append(Corpus())
        return corpus[0].sample(seed=ctx.seed, step=step, index=index, batch=ctx.micro_batch, block=cfg.block_size)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    return Workload(
        build_model=lambda: GPT(cfg),
        loss=loss,
        batch=batch,
        tokens_per_microbatch=ctx.micro_batch * cfg.block_size,
        prepare=lambda: None if ensure_corpus() else None,
    )
