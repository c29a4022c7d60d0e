"""phoenixft: keep PyTorch training alive through node failures.

Per-step in-memory checkpoints replicated to peers off the critical path, and spare-node
hot-swap with communicators rebuilt inside the running job (the PHOENIX design).
`Workload` and `WorkloadContext` are imported lazily so that `phoenixft simulate` and `--help`
do not pay for `import torch`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Workload", "WorkloadContext", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("Workload", "WorkloadContext"):
        from phoenixft import workload
        return getattr(workload, name)
    raise AttributeError(name)
