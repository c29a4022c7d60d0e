"""phoenixft: keep PyTorch training alive through node failures.

Per-step in-memory checkpoints replicated to peers off the critical path, and spare-node
hot-swap with communicators rebuilt inside the running job (the PHOENIX design).
`Workload` and `WorkloadContext` are imported lazily so that `phoenixft simulate` and `--help`
do not pay for `import torch`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Workload", "WorkloadContext", "init", "__version__"]
__version__ = "0.1.0"


def init(seed: int | None = None) -> Any:
    """Join the job this training script runs in and return its `Job` (docs/script.md): under
    `phoenixft launch` every step is protected and every failure recovered in the running processes;
    under `python` or `torchrun` the same script runs unprotected."""
    from phoenixft.api import init as _init

    return _init(seed)


def __getattr__(name: str) -> Any:
    if name in ("Workload", "WorkloadContext"):
        from phoenixft import workload
        return getattr(workload, name)
    raise AttributeError(name)
