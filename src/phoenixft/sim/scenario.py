"""Scenario parameters of a simulated training run, and the recovery policies the simulator knows.

A :class:`Scenario` fixes the machine (GPUs, nodes, failure process, spare pool) and the costs
(step time, checkpoint write, restart, hot-swap, ...). Times are in seconds. Failures are per
node: each node fails at rate ``1 / node_mttf`` with ``node_mttf = gpu_mttf * gpus_per_node``
(a node is the failure domain of its GPUs), so the system MTTF of ``N`` nodes is
``node_mttf / N``. The default GPU MTTF, 1.08e8 s (about 3.4 years), makes 100,000 GPUs fail
once every 18 minutes, the FT-HSDP figure the review quotes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = [
    "ARRIVALS",
    "DEFAULT_GPU_MTTF_S",
    "PLACEMENTS",
    "POLICIES",
    "POLICY_ALIASES",
    "Scenario",
    "canonical_policy",
]

#: Per-GPU MTTF that gives one failure every 18 minutes at 100,000 GPUs.
DEFAULT_GPU_MTTF_S: float = 100_000 * 18 * 60.0

#: checkpoint-restart(K); phoenix hot-swap (k replicas, in-place for transient faults, persistent
#: fallback); in-place (retained local state for transient faults, checkpoint-restart otherwise);
#: shrink (continue on the survivors with a constant global batch).
POLICIES: tuple[str, ...] = ("checkpoint-restart", "phoenix", "inplace", "shrink")
POLICY_ALIASES: dict[str, str] = {
    "cr": "checkpoint-restart",
    "ckpt": "checkpoint-restart",
    "checkpoint-restart": "checkpoint-restart",
    "phoenix": "phoenix",
    "hotswap": "phoenix",
    "hot-swap": "phoenix",
    "inplace": "inplace",
    "in-place": "inplace",
    "shrink": "shrink",
}
ARRIVALS: tuple[str, ...] = ("exponential", "weibull")
PLACEMENTS: tuple[str, ...] = ("aware", "unaware")


def canonical_policy(name: str) -> str:
    """Map an alias (``cr``, ``hotswap`` ...) to its canonical policy name."""
    try:
        return POLICY_ALIASES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICY_ALIASES))}") from None


@dataclass(frozen=True)
class Scenario:
    """One training run to simulate; see the module docstring for units and conventions."""

    gpus: int
    gpus_per_node: int = 8
    steps: int = 100_000
    step_s: float = 20.0
    gpu_mttf_s: float = DEFAULT_GPU_MTTF_S
    arrival: str = "exponential"
    weibull_shape: float = 0.7
    transient_frac: float = 0.0
    domain_size: int = 4
    domain_mttf_s: float = math.inf
    spares: int = 16
    provision_s: float = 3600.0
    restart_s: float = 600.0
    ckpt_s: float = 8.9
    hotswap_s: float = 30.0
    inplace_s: float = 30.0
    shrink_s: float = 30.0
    overhead_ratio: float = 1.0
    replicas: int = 1
    placement: str = "aware"
    persist_every: int = 5000
    persist_s: float = 8.9
    no_spare: str = "shrink"
    replica_nodes: int = 1  # nodes a shrink drops per lost node: its data-parallel replica (PP in a TP x PP mesh)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.steps < 1:
            raise ValueError("gpus, gpus_per_node and steps must be >= 1")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}")
        if self.no_spare not in ("shrink", "wait"):
            raise ValueError("no_spare must be 'shrink' or 'wait'")
        if not 0.0 <= self.transient_frac <= 1.0:
            raise ValueError("transient_frac must be in [0, 1]")
        if self.step_s <= 0 or self.gpu_mttf_s <= 0 or self.domain_mttf_s <= 0 or self.weibull_shape <= 0:
            raise ValueError("step time, MTTFs and the Weibull shape must be positive")
        for name in ("provision_s", "restart_s", "ckpt_s", "hotswap_s", "inplace_s", "shrink_s", "persist_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.overhead_ratio < 1.0:
            raise ValueError("overhead_ratio must be >= 1")
        if self.replica_nodes < 1 or self.nodes % self.replica_nodes:
            raise ValueError(f"replica_nodes must be >= 1 and divide the {self.nodes} nodes")
        if self.replicas < 1 or self.domain_size < 1 or self.spares < 0 or self.persist_every < 0:
            raise ValueError("replicas and domain_size must be >= 1, spares and persist_every >= 0")

    @property
    def nodes(self) -> int:
        """Nodes in the job (the last node may be partially filled)."""
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def domains(self) -> int:
        """Correlated failure domains (racks / switches) of ``domain_size`` nodes."""
        return math.ceil(self.nodes / self.domain_size)

    @property
    def node_mttf_s(self) -> float:
        """MTTF of one node: the GPU MTTF divided by the GPUs it holds."""
        return self.gpu_mttf_s / self.gpus_per_node

    @property
    def node_system_mttf_s(self) -> float:
        """Mean time between node failures of the whole job."""
        return self.node_mttf_s / self.nodes

    @property
    def system_mttf_s(self) -> float:
        """Mean time between any failures (node or domain events)."""
        rate = self.nodes / self.node_mttf_s + self.domains / self.domain_mttf_s
        return 1.0 / rate

    @property
    def permanent_mttf_s(self) -> float:
        """Mean time between failures that lose a node (permanent node faults and domain events)."""
        rate = (1.0 - self.transient_frac) * self.nodes / self.node_mttf_s + self.domains / self.domain_mttf_s
        return math.inf if rate == 0 else 1.0 / rate

    @property
    def spares_needed(self) -> float:
        """Mean number of lost nodes waiting for a replacement: node-loss rate x provision time.

        A pool smaller than this cannot keep up: policies that wait for spares stall.
        """
        rate = (1.0 - self.transient_frac) * self.nodes / self.node_mttf_s
        rate += self.domains * min(self.domain_size, self.nodes) / self.domain_mttf_s
        return rate * self.provision_s

    @property
    def failure_free_s(self) -> float:
        """Wall time of the run with no failure and no protection cost: ``steps * step_s``."""
        return self.steps * self.step_s

    def with_(self, **kw: Any) -> Scenario:
        """A copy with some fields replaced."""
        return replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly parameters plus the derived quantities."""
        d = asdict(self)
        d.update(
            nodes=self.nodes,
            domains=self.domains,
            node_mttf_s=self.node_mttf_s,
            system_mttf_s=self.system_mttf_s,
            failure_free_s=self.failure_free_s,
        )
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
