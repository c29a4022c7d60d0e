"""A HuggingFace `transformers` model under phoenixft: a tiny GPT-2, trained from random init.

    pip install transformers
    PYTHONPATH=examples phoenixft run --workload hf_gpt2:workload --nodes 2 --spares 1 --steps 20 \\
        --inject kill:node=1@step=10,phase=backward
    phoenixft export runs/<id> --out model.safetensors

`workload(ctx)` builds `GPT2LMHeadModel(GPT2Config(...))` (vocabulary 256 bytes, 2 layers,
n_embd 64, 2 heads, 64 positions; nothing is downloaded: no weights, no tokenizer) and trains it
on phoenixft's own byte-level data, exactly as the built-in GPT does: the stdlib corpus, or a
token file given with `--data` (then the vocabulary is the data's). `batch(step, index)` and
`eval_batch(index)` are phoenixft.data's pure sampling functions, so recovery needs no
data-loader state. The loss is the cross-entropy of the logits against the next tokens (the
batch is already shifted, so the model's own `labels=` shift is not used).

The exported safetensors file holds the model's full `state_dict` (GPT-2 ties `lm_head.weight`
to `transformer.wte.weight`; the export writes both keys), so it loads into a fresh
`GPT2LMHeadModel` with `load_state_dict`, and `save_pretrained` / `from_pretrained` take it
from there (see `to_pretrained` below and the README section "A HuggingFace model").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from phoenixft import Workload, WorkloadContext

BLOCK = 64  # sequence length = n_positions

__all__ = ["gpt2_config", "workload", "to_pretrained", "BLOCK"]


def gpt2_config(vocab_size: int = 256) -> Any:
    """The tiny GPT-2 of this example (transformers.GPT2Config)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_layer=2, n_embd=64, n_head=2, n_positions=BLOCK,
                      bos_token_id=0, eos_token_id=0)


def workload(ctx: WorkloadContext) -> Workload:
    """Factory for `--workload hf_gpt2:workload`."""
    from phoenixft.data import Corpus, TokenData, open_data

    opened: list[Corpus | TokenData] = []  # opened lazily, once per process

    def source() -> Corpus | TokenData:
        if not opened:
            opened.append(open_data(ctx.data, ctx.data_dtype) if ctx.data else Corpus())
        return opened[0]

    def build_model() -> torch.nn.Module:
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(gpt2_config(source().vocab_size if ctx.data else 256))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = source()
        if isinstance(src, TokenData):
            return src.sample(seed=ctx.seed, step=step, index=index, batch=ctx.micro_batch,
                              microbatches=ctx.microbatches, block=BLOCK)
        return src.sample(seed=ctx.seed, step=step, index=index, batch=ctx.micro_batch, block=BLOCK)

    def eval_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return source().eval_sample(seed=ctx.seed, index=index, batch=ctx.micro_batch, block=BLOCK)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def prepare() -> None:  # in the launcher, once: builds the corpus cache, or the data's vocabulary cache
        source()

    return Workload(build_model=build_model, loss=loss, batch=batch, eval_batch=eval_batch,
                    tokens_per_microbatch=ctx.micro_batch * BLOCK, prepare=prepare)


def to_pretrained(safetensors_path: str | Path, out_dir: str | Path, vocab_size: int = 256) -> torch.nn.Module:
    """Load a `phoenixft export` file into a fresh GPT2LMHeadModel and `save_pretrained` it to `out_dir`."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(vocab_size))
    model.load_state_dict(load_file(str(safetensors_path)))
    model.save_pretrained(str(out_dir))
    return model
