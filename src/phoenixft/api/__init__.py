"""Protect a user's own training script: `phoenixft.init()` and the `Job` it returns (api/job.py).

Under `phoenixft launch` (or an agent of `phoenixft coordinator`), the worker process that runs the
script has the job's address in its environment: `init()` joins the job (a spare waits inside it until
it is promoted), installs the job's `ResilientGroup` as torch.distributed's default group, sets
`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT` as torchrun does, and returns a
`Job`. Anywhere else (`python train.py`, `torchrun train.py`) it returns an unprotected `LocalJob` with
the same methods, on torch.distributed's own group when torchrun started the script: the same script
runs both ways.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["init", "LAUNCH_ENV"]

LAUNCH_ENV = "PHOENIXFT_SCRIPT_STORE"  # set by the agent for a script's worker: the job's store address
DEFAULT_SEED = 1234


def init(seed: int | None = None) -> Any:
    """Join the job this process belongs to and return its `Job` (see the module docstring). `seed`: of the
    model's construction and of every step's generators (default: the run's `--seed`, else 1234)."""
    if os.environ.get(LAUNCH_ENV):
        from phoenixft.api.launched import join_job

        return join_job(seed)
    from phoenixft.api.local import LocalJob

    return LocalJob(DEFAULT_SEED if seed is None else seed)
