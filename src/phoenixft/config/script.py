"""What a run that protects a user's own training script (`phoenixft launch`) must satisfy.

The script trains its own model on its own data (`phoenixft.init()`, docs/script.md); the run's flags
that describe the built-in trainer's model, data and recipe do not apply, and the job is data-parallel:
the script's own tensor or pipeline parallelism is not something phoenixft can rebuild.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from phoenixft.config.checks import need

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["validate_script"]


def validate_script(cfg: RunConfig) -> None:
    path = cfg.script
    need(os.path.isabs(path), "script", path, "the script's path must be absolute (phoenixft launch resolves it)")
    need(os.path.isfile(path), "script", path, "no such file: give the path of the training script to run")
    need(cfg.tp == 1 and cfg.pp == 1, "--tp/--pp", f"{cfg.tp}/{cfg.pp}",
         "a script is protected data-parallel (its model may be FSDP2-sharded): --tp 1 --pp 1")
    need(not cfg.resume, "--resume", cfg.resume, "a script's state is restored from memory, not from --resume")
    for f in cfg.faults:
        why = f.kind_of.built_in_only
        need(not why, "--inject", f.text, f"not under `phoenixft launch`: {why}")
