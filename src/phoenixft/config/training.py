"""The training section: the model and its data, steps and batch, optimizer, learning-rate schedule,
precision, evaluation, the seed, and the checkpoint a run resumes from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phoenixft.config.checks import need, real
from phoenixft.config.names import GPT_PRESETS, OPTIMIZER_NAMES, SCHEDULE_NAMES
from phoenixft.config.options import option

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["TrainingConfig", "validate_training", "DEFAULT_WORKLOAD", "is_file_spec", "absolute_workload",
           "model_label"]

DEFAULT_WORKLOAD = "phoenixft.gpt:workload"
_DEFAULT_MODEL = "tiny"


@dataclass(kw_only=True)
class TrainingConfig:
    """What is trained, for how long, and how."""

    steps: int = option(20, "Training steps to complete.")
    model: str = option(_DEFAULT_MODEL, "GPT size preset for the default workload: nano (~60k, for smoke tests), "
                        "tiny (~1M), small (~11M), medium (~100M). A --workload of your own receives it as it is "
                        "(WorkloadContext.model): any name.")
    workload: str = option(
        DEFAULT_WORKLOAD,
        "Workload factory returning phoenixft.Workload: 'pkg.module:function' (a module in the current directory, "
        "on PYTHONPATH or installed) or 'path/to/file.py:function' (default: the built-in GPT).",
    )
    data: str = option("", "Token file to train on: a flat uint16/uint32 array of token ids (nanoGPT's train.bin "
                           "format; its last 5 percent held out), or a directory holding train.bin and val.bin. "
                           "Make one from text with `phoenixft prepare-data`. '' = the built-in stdlib corpus.")
    data_dtype: str = option("uint16", "Token id type of --data when it has no sidecar JSON (<file>.json or "
                                       "meta.json): uint16 or uint32.", flag="--data-dtype")
    micro_batch: int = option(8, "Sequences per microbatch.", flag="--micro-batch")
    microbatches: int = option(
        0,
        "Microbatches per step across all data-parallel ranks (0 = one per worker). "
        "Global batch = micro-batch x microbatches.",
    )
    optimizer: str = option("adamw", "Optimizer of the flat ZeRO shard: adamw, adam, sgd or lion (a workload may "
                                     "bring its own elementwise one).")
    lr: float = option(1e-3, "Peak learning rate.")
    weight_decay: float = option(0.1, "Weight decay (decoupled for adamw and lion, L2 for adam and sgd).",
                                 flag="--weight-decay")
    beta1: float = option(0.9, "adamw/adam/lion: first-moment coefficient.")
    beta2: float = option(0.95, "adamw/adam: second-moment coefficient; lion: momentum update coefficient.")
    eps: float = option(1e-8, "adamw/adam: denominator epsilon.")
    momentum: float = option(0.9, "sgd: momentum.")
    nesterov: bool = option(False, "sgd: Nesterov momentum.", action="store_true")
    lr_schedule: str = option("constant", "Learning-rate schedule: constant, cosine, linear or wsd "
                                          "(warmup-stable-decay); a pure function of the step.", flag="--lr-schedule")
    warmup_steps: int = option(0, "Linear warm-up steps (the rate reaches --lr at this step).", flag="--warmup-steps")
    min_lr: float = option(0.0, "Final learning rate of cosine, linear and wsd.", flag="--min-lr")
    decay_steps: int = option(0, "Decay length: cosine/linear after the warm-up (0 = to the end of the run); wsd: "
                                 "the last N steps (0 = the last 20%).", flag="--decay-steps")
    clip_grad_norm: float = option(0.0, "Clip gradients to this global norm over the whole model (0 = off).",
                                   flag="--clip-grad-norm")
    precision: str = option("fp32", "fp32, or bf16: bf16 parameters and compute, fp32 master weights and optimizer "
                                    "state in the shard (then the master weights are protected and replicated too).")
    eval_every: int = option(0, "Validation loss every N steps on held-out batches (0 = never).", flag="--eval-every")
    eval_batches: int = option(4, "Held-out microbatches per evaluation, spread over the data-parallel ranks.",
                               flag="--eval-batches")
    seed: int = option(1234, "Seed of the model init and of the (pure) batch function.")
    resume: str = option("", "Start from the newest complete checkpoint in this directory (any node count).")
    # a user's own training script instead of the built-in trainer (set by `phoenixft launch`, not a run flag)
    script: str = option("", "The training script every worker runs (its absolute path).", cli=False)
    script_args: list[str] = field(default_factory=list,
                                   metadata={"help": "The script's own arguments.", "cli": False})


def is_file_spec(target: str) -> bool:
    """Whether the module part of a `--workload` spec names a file (`path/to/file.py`) rather than a module."""
    return target.endswith(".py") or "/" in target or os.sep in target


def absolute_workload(spec: str) -> str:
    """`spec` with a file's path made absolute (the workers, and agents started elsewhere, find the same file)."""
    target, sep, fn = spec.rpartition(":")
    if not sep or not target or not is_file_spec(target):
        return spec
    return f"{os.path.abspath(os.path.expanduser(target))}:{fn}"


def model_label(cfg: Mapping[str, Any]) -> str:
    """What a run trains, as its reports name it (`cfg`: the flat config): `model=PRESET` for the built-in GPT,
    `workload=SPEC` for a workload of the user's own (with its --model when one other than the default was
    given)."""
    workload = str(cfg.get("workload") or DEFAULT_WORKLOAD)
    model = cfg.get("model")
    if workload == DEFAULT_WORKLOAD:
        return f"model={model}"
    return f"workload={workload}" + (f", model={model}" if model and model != _DEFAULT_MODEL else "")


def validate_training(cfg: RunConfig) -> None:
    """The training flags on their own and against the data-parallel size; what needs the workload
    itself (its model, its data, a checkpoint to resume) is checked by `phoenixft.config.workload`."""
    t = cfg.training
    need(t.steps >= 1, "--steps", t.steps, "must be >= 1")
    if t.script:  # a script trains its own model, on its own data, for its own steps
        return
    if t.workload == DEFAULT_WORKLOAD:  # (a workload of the user's own receives --model as it is: free-form)
        need(t.model in GPT_PRESETS, "--model", t.model,
             f"valid presets of the built-in GPT: {', '.join(GPT_PRESETS)} (a --workload of your own takes any name)")
    need("\n" not in t.model and "\0" not in t.model, "--model", t.model, "must be one line")
    need(t.micro_batch >= 1, "--micro-batch", t.micro_batch, "must be >= 1")
    need(t.microbatches >= 0, "--microbatches", t.microbatches, "must be >= 0 (0 = one per worker)")
    dpw = "nodes x workers-per-node" if cfg.tp * cfg.pp == 1 else "the data-parallel size"
    need(cfg.total_microbatches % cfg.dp == 0, "--microbatches", t.microbatches,
         f"must be a multiple of {dpw} = {cfg.dp} so every rank gets the same count")
    _validate_optimizer(t)
    need(t.precision in ("fp32", "bf16"), "--precision", t.precision, "one of fp32, bf16")
    need(t.eval_every >= 0, "--eval-every", t.eval_every, "must be >= 0 (0 = never)")
    need(t.eval_batches >= 1, "--eval-batches", t.eval_batches, "must be >= 1")


def _validate_optimizer(t: TrainingConfig) -> None:
    """The optimizer, its hyperparameters and the learning-rate schedule."""
    real(t.lr, t.lr > 0, "--lr", "> 0")
    real(t.weight_decay, t.weight_decay >= 0, "--weight-decay", ">= 0")
    need(t.optimizer in OPTIMIZER_NAMES, "--optimizer", t.optimizer, f"one of {', '.join(OPTIMIZER_NAMES)}")
    real(t.beta1, 0 <= t.beta1 < 1, "--beta1", "in [0, 1)")
    real(t.beta2, 0 <= t.beta2 < 1, "--beta2", "in [0, 1)")
    real(t.eps, t.eps > 0, "--eps", "> 0")
    real(t.momentum, 0 <= t.momentum < 1, "--momentum", "in [0, 1)")
    need(t.lr_schedule in SCHEDULE_NAMES, "--lr-schedule", t.lr_schedule, f"one of {', '.join(SCHEDULE_NAMES)}")
    need(0 <= t.warmup_steps <= t.steps, "--warmup-steps", t.warmup_steps, f"must be in 0..--steps ({t.steps})")
    real(t.min_lr, 0 <= t.min_lr <= t.lr, "--min-lr", f"in 0..--lr ({t.lr})")
    need(t.decay_steps >= 0, "--decay-steps", t.decay_steps, "must be >= 0")
    real(t.clip_grad_norm, t.clip_grad_norm >= 0, "--clip-grad-norm", ">= 0 (0 = off)")
