"""phoenixft: keep PyTorch training alive through node failures.

Per-step in-memory checkpoints replicated to peers off the critical path, and spare-node
hot-swap with communicators rebuilt inside the running job (the PHOENIX design).
"""

from phoenixft.workload import Workload, WorkloadContext

__all__ = ["Workload", "WorkloadContext", "__version__"]
__version__ = "0.1.0"
