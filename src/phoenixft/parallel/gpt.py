"""The reference GPT cut into (pp, tp) stages, Megatron-style, from the full model built on every rank.

Building the full model under the run's seed and slicing it gives every layout the same initial
weights, so a 3D run and a data-parallel run of the same model start identical. A stage holds:

- first stage: the vocabulary-parallel token embedding and the (replicated) position embedding;
- layers [pp * L / P, (pp + 1) * L / P): attention with heads split over TP (column-parallel QKV,
  row-parallel output projection), MLP column-parallel up, row-parallel down; layer norms replicated;
- last stage: the final layer norm and the output layer tied to the token embedding (its own copy
  when P > 1, kept equal to the first stage's by summing both copies' gradients), with the
  vocabulary-parallel cross-entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from phoenixft.errors import UserError
from phoenixft.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPHandle,
    VocabParallelEmbedding,
    copy_to_tp,
    split_range,
    vocab_parallel_cross_entropy,
)
from phoenixft.parallel.logical import Piece
from phoenixft.parallel.stage import Stage, StageSpec

__all__ = ["GPTStage", "split_gpt"]


def _ln(src: nn.LayerNorm) -> nn.LayerNorm:
    ln = nn.LayerNorm(src.normalized_shape, eps=src.eps, device=src.weight.device)
    ln.load_state_dict(src.state_dict())
    return ln


class TPBlock(nn.Module):
    def __init__(self, blk: Any, prefix: str, tp: int, T: int, h: TPHandle, pieces: dict[str, list[Piece]]) -> None:
        super().__init__()
        d = blk.qkv.in_features
        self.hd = d // blk.n_head
        hlo, hhi = split_range(blk.n_head, T, tp)
        self.n_local = hhi - hlo
        a, b = hlo * self.hd, hhi * self.hd
        rows = [slice(j * d + a, j * d + b) for j in range(3)]
        self.ln1, self.ln2 = _ln(blk.ln1), _ln(blk.ln2)
        self.qkv = ColumnParallelLinear(torch.cat([blk.qkv.weight[r] for r in rows]),
                                        torch.cat([blk.qkv.bias[r] for r in rows]), h)
        self.proj = RowParallelLinear(blk.proj.weight[:, a:b], blk.proj.bias, h)
        flo, fhi = split_range(blk.fc.out_features, T, tp)
        self.fc = ColumnParallelLinear(blk.fc.weight[flo:fhi], blk.fc.bias[flo:fhi], h)
        self.fc_proj = RowParallelLinear(blk.fc_proj.weight[:, flo:fhi], blk.fc_proj.bias, h)
        p = prefix
        for ln in ("ln1", "ln2"):
            for w in ("weight", "bias"):
                pieces[f"{ln}.{w}"] = [(f"{p}.{ln}.{w}", 0, 0, d)]
        pieces["qkv.weight"] = [(f"{p}.qkv.weight", 0, r.start, r.stop) for r in rows]
        pieces["qkv.bias"] = [(f"{p}.qkv.bias", 0, r.start, r.stop) for r in rows]
        pieces["proj.weight"] = [(f"{p}.proj.weight", 1, a, b)]
        pieces["proj.bias"] = [(f"{p}.proj.bias", 0, 0, d)]
        pieces["fc.weight"] = [(f"{p}.fc.weight", 0, flo, fhi)]
        pieces["fc.bias"] = [(f"{p}.fc.bias", 0, flo, fhi)]
        pieces["fc_proj.weight"] = [(f"{p}.fc_proj.weight", 1, flo, fhi)]
        pieces["fc_proj.bias"] = [(f"{p}.fc_proj.bias", 0, 0, d)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        w = self.n_local * self.hd
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.n_local, self.hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, w))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


REPLICATED = ("ln1.", "ln2.", "proj.bias", "fc_proj.bias", "wpe.", "ln_f.")  # identical on every TP rank


class GPTStage(Stage):
    def __init__(self, full: Any, spec: StageSpec) -> None:
        c = full.config
        T, tp = spec.tp_size, spec.tp
        self.handle = spec.handle
        self.first, self.last = spec.first, spec.last
        self.n_embd = c.n_embd
        self.vlo, vhi = split_range(c.vocab_size, T, tp)
        self._full = [(n, tuple(p.shape)) for n, p in full.named_parameters() if p.requires_grad]
        m = nn.Module()
        pieces: dict[str, list[Piece]] = {}
        wte = full.wte.weight[self.vlo : vhi]
        if self.first:
            m.wte = VocabParallelEmbedding(wte, self.vlo, spec.handle)
            m.wpe = nn.Embedding.from_pretrained(full.wpe.weight.detach().clone(), freeze=False)
            pieces["wte.weight"] = [("wte.weight", 0, self.vlo, vhi)]
            pieces["wpe.weight"] = [("wpe.weight", 0, 0, c.block_size)]
        lo, hi = split_range(c.n_layer, spec.pp_size, spec.pp)
        m.blocks = nn.ModuleList()
        for i in range(lo, hi):
            bp: dict[str, list[Piece]] = {}
            m.blocks.append(TPBlock(full.blocks[i], f"blocks.{i}", tp, T, spec.handle, bp))
            pieces.update({f"blocks.{i - lo}.{k}": v for k, v in bp.items()})
        if self.last:
            m.ln_f = _ln(full.ln_f)
            pieces["ln_f.weight"] = [("ln_f.weight", 0, 0, c.n_embd)]
            pieces["ln_f.bias"] = [("ln_f.bias", 0, 0, c.n_embd)]
            if not self.first:  # the tied output layer's own copy
                m.head = nn.Parameter(wte.detach().clone())
                pieces["head"] = [("wte.weight", 0, self.vlo, vhi)]
        self.module = m
        self._pieces = pieces
        self._tp = tp

    def _names(self) -> list[str]:
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    def pieces(self) -> list[list[Piece]]:
        return [self._pieces[n] for n in self._names()]

    def full(self) -> list[tuple[str, tuple[int, ...]]]:
        return self._full

    def counted(self) -> list[bool]:
        """TP-replicated parameters count on tp rank 0 only; the output layer's copy not at all."""
        return [n != "head" and (self._tp == 0 or not any(r in n for r in REPLICATED)) for n in self._names()]

    def tied(self) -> list[bool]:
        if self.first and self.last:
            return [False for _ in self._names()]
        return [n in ("wte.weight", "head") for n in self._names()]

    def act_shape(self, batch: Any) -> tuple[int, ...]:
        x = batch[0]
        return (*x.shape, self.n_embd)

    def forward(self, inp: torch.Tensor | None, batch: Any) -> torch.Tensor:
        m: Any = self.module
        x, y = batch
        if self.first:
            h = m.wte(x) + m.wpe(torch.arange(x.shape[1], device=x.device))
        else:
            assert inp is not None
            h = inp
        for blk in m.blocks:
            h = blk(h)
        if not self.last:
            return h
        w = m.wte.weight if self.first else m.head
        assert self.handle is not None
        logits = copy_to_tp(m.ln_f(h), self.handle) @ w.t()
        return vocab_parallel_cross_entropy(logits, y, self.vlo, self.handle)


def split_gpt(full: torch.nn.Module, spec: StageSpec) -> GPTStage:
    c: Any = full.config
    if spec.pp_size > c.n_layer:
        raise UserError(f"--pp={spec.pp_size} is invalid: the model has only {c.n_layer} layers to split into stages")
    if c.n_head % spec.tp_size:
        raise UserError(f"--tp={spec.tp_size} is invalid: the model's {c.n_head} attention heads must split evenly "
                        f"(valid: a divisor of {c.n_head})")
    return GPTStage(full, spec)
