"""The four recovery invariants of the paper, checked collectively after every (re)join.

Each rank contributes what its *state* says, not what the plan intended, so a wrong transfer
or a wrong shard map shows up here:

- I1 topology consistency: every member holds the same topology (same epoch, same digest).
- I2 shard completeness: every logical shard of the plan has exactly one owner, and the state
  each rank holds for the resume step is the shard the plan gives that rank (the shard id is
  written into the snapshot header by whoever filled the half: the optimizer, a verified
  transfer, a repartition or the persistent tier).
- I3 optimizer availability: every rank's optimizer state was verified against the checksum
  its source committed for the resume step (own half, transfer, repartition, persistent shard).
- I4 step atomicity: every member restored exactly the resume step, parameters and optimizer
  state alike; nothing of the interrupted step was kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phoenixft.topology import Topology

__all__ = ["check_invariants"]


def check_invariants(
    pg: Any,
    topo: Topology,
    rank: int,
    resume_step: int,
    param_step: int,
    opt_steps: list[int],
    held_shard: tuple[int, int],
    opt_ok: bool,
    wait: Callable[[Any, str], None],
) -> dict[str, bool]:
    digest = int(topo.digest()[:15], 16)
    mine = torch.tensor(
        [digest, topo.epoch, rank, int(opt_ok), param_step, opt_steps[0] if opt_steps else -1, *held_shard],
        dtype=torch.int64,
    )
    out = torch.empty(topo.world * mine.numel(), dtype=torch.int64)
    wait(pg._allgather_base(out, mine), "invariant check")
    rows = out.view(topo.world, -1).tolist()
    return {
        "I1": all(r[0] == digest and r[1] == topo.epoch for r in rows),
        "I2": sorted(r[2] for r in rows) == list(range(topo.world))
        and all(r[6] == r[2] and r[7] == topo.world for r in rows),
        "I3": all(r[3] == 1 for r in rows),
        "I4": all(r[4] == resume_step and r[5] == resume_step for r in rows),
    }
