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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the reports and the live display read entries without loading torch)
    from phoenixft.dist.topology import Topology

__all__ = ["INVARIANTS", "check_invariants", "failed_invariants", "invariants_hold"]

INVARIANTS = ("I1", "I2", "I3", "I4")


def failed_invariants(entry: dict[str, Any]) -> list[str]:
    """The invariants a recovery entry does not show as established: false, or missing (an entry without
    invariants, or without one of I1..I4, proves nothing)."""
    inv = entry.get("invariants")
    inv = inv if isinstance(inv, dict) else {}
    return [k for k in INVARIANTS if inv.get(k) is not True]


def invariants_hold(entry: dict[str, Any]) -> bool:
    """A recovery entry's invariants I1..I4 are all present and true (what every display calls passing)."""
    return not failed_invariants(entry)


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
) -> tuple[dict[str, bool], str]:
    """The four invariants (True = holds) and which ranks break each one (empty when all hold)."""
    import torch

    digest = int(topo.digest()[:15], 16)
    mine = torch.tensor(
        [digest, topo.epoch, rank, int(opt_ok), param_step, opt_steps[0] if opt_steps else -1, *held_shard],
        dtype=torch.int64,
    )
    out = torch.empty(topo.world * mine.numel(), dtype=torch.int64)
    wait(pg._allgather_base(out, mine), "invariant check")
    rows = out.view(topo.world, -1).tolist()
    wrong = {
        "I1": [r[2] for r in rows if not (r[0] == digest and r[1] == topo.epoch)],
        "I2": [r[2] for r in rows if not (r[6] == r[2] and r[7] == topo.world)],
        "I3": [r[2] for r in rows if r[3] != 1],
        "I4": [r[2] for r in rows if not (r[4] == resume_step and r[5] == resume_step)],
    }
    if sorted(r[2] for r in rows) != list(range(topo.world)):
        wrong["I2"].append(-1)
    inv = {k: not v for k, v in wrong.items()}
    detail = "; ".join(f"{k} fails on ranks {v}" for k, v in wrong.items() if v)
    return inv, detail
