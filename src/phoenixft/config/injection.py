"""The fault-injection section: the `--inject` specs of a run, parsed once by `phoenixft.faults.spec`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import need
from phoenixft.config.options import option
from phoenixft.faults.kinds import COPY_PHASE

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig
    from phoenixft.faults.spec import FaultSpec

__all__ = ["InjectionConfig", "validate_injection"]


@dataclass(kw_only=True)
class InjectionConfig:
    """The faults a run injects into itself."""

    inject: list[str] = option(
        None,
        "Fault to inject, repeatable: kill:node=I[,J]@step=S[,phase=forward|backward|replicate|optimizer], "
        "kill:rack=A@step=S, kill:node=I@recovery=N, kill:node=I@step=S,phase=recovery (in the first recovery "
        "resuming from step S-1 or later), hang:node=I@step=S, crash:rank=R@step=S[,phase=P] (phase=copy, "
        "under `launch`: the step's own side committed, its parameters' copy not yet), "
        "corrupt:node=I@step=S, nan:step=S, partition:node=I@step=S[,for=SECONDS] (hosts with their own "
        "addresses only: `phoenixft coordinator` + agents).",
        action="append",
    )

    @property
    def specs(self) -> list[FaultSpec]:
        """The parsed --inject specs, in order (a parse error is a UserError naming the spec)."""
        return list(_parse(tuple(self.inject or ())))


@functools.lru_cache(maxsize=32)
def _parse(texts: tuple[str, ...]) -> tuple[FaultSpec, ...]:
    from phoenixft.faults.spec import parse_fault

    return tuple(parse_fault(s, i) for i, s in enumerate(texts))


def validate_injection(cfg: RunConfig) -> None:
    """Each fault once, aimed at a node, rack, rank, step or etcd member the run has."""
    seen: set[str] = set()
    for f in cfg.faults:  # parse errors raise UserError themselves
        need(f.text.strip() not in seen, "--inject", f.text, "given twice: each fault fires once per run; give it once")
        seen.add(f.text.strip())
        for n in f.nodes:
            need(0 <= n < cfg.nodes, "--inject", f.text, f"node must be in 0..{cfg.nodes - 1}")
        if f.rack is not None:
            need(0 <= f.rack < cfg.racks, "--inject", f.text, f"rack must be in 0..{cfg.racks - 1} (--racks)")
        if f.rank is not None:
            need(0 <= f.rank < cfg.world, "--inject", f.text, f"rank must be in 0..{cfg.world - 1}")
        if f.step is not None:
            need(1 <= f.step <= cfg.steps, "--inject", f.text, f"step must be in 1..{cfg.steps}")
        if f.recovery is not None:
            need(f.recovery >= 1, "--inject", f.text, "recovery must be >= 1 (the first recovery is 1)")
        if f.member is not None:
            need(cfg.control_plane == "etcd", "--inject", f.text,
                 "an etcd member can be killed only in the cluster the run starts itself: --control-plane etcd")
            need(f.member < 3, "--inject", f.text, "the run's etcd cluster has members 0, 1, 2")
        if f.phase == COPY_PHASE:
            need(bool(cfg.script) and cfg.protect == "phoenix", "--inject", f.text,
                 "phase=copy is the moment a protected script's snapshot has committed its own side and not yet its "
                 "parameters' copy: only under `phoenixft launch` with --protect phoenix")
        if f.kind_of.needs_protection:
            need(cfg.protect == "phoenix", "--inject", f.text, f"a {f.kind} fault needs --protect phoenix")
