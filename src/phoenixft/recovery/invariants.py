"""The four recovery invariants of the paper, checked collectively after every (re)join.

Each rank contributes what its *state* says, not what the plan intended, so a wrong transfer
or a wrong shard map shows up here:

- I1 topology consistency: every member holds the same topology (same epoch, same digest).
- I2 shard completeness: every logical shard of the plan has exactly one owner, the state each
  rank holds for the resume step is the shard the plan gives that rank (its snapshot header), and
  its bytes match that shard's checksum recorded before the failure, not another shard's.
- I3 optimizer availability: every rank's optimizer state was verified against the checksum
  recorded when its bytes were first written (own half, transfer, repartition, persistent shard).
- I4 step atomicity: every member restored exactly the resume step, parameters and optimizer
  state alike: the steps the restore set, the bytes (they match no other step's recorded
  checksum, the parameters the recorded one of the resume step) and the data-parallel peers'
  parameter checksums (all equal); nothing of the interrupted step was kept.

The evidence for I2 and I4 (recovery/evidence.py) is what the survivors reported before the restore,
not what the restore wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phoenixft.recovery.evidence import NO_EVIDENCE, NO_MATCH, NOT_READ, Seen

if TYPE_CHECKING:  # (the reports and the live display read entries without loading torch)
    from phoenixft.distributed.topology import Topology

__all__ = ["INVARIANTS", "check_invariants", "failure_message", "failed_invariants", "invariants_hold"]

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


def failure_message(inv: dict[str, bool], detail: str, epoch: int, r: int) -> str:
    """The reason a run stops on a broken invariant: each one named ("invariant I4 failed"), the epoch, the
    resume step, and the ranks, shards and steps `check_invariants` found."""
    failed = " and ".join(f"invariant {k} failed" for k in INVARIANTS if not inv.get(k, False))
    return f"{failed} after recovery to epoch {epoch} to step {r} ({detail})"


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
    seen: Seen | None = None,
) -> tuple[dict[str, bool], str]:
    """The four invariants (True = holds) and which ranks break each one (empty when all hold).

    `seen`: what this rank installed, as the evidence recorded before the failure identifies it
    (recovery/evidence.py): I2 fails where the optimizer bytes are not its own shard's, I4 where they are
    another step's, where the parameters are not the recorded ones of the resume step, or where they differ
    from the parameters of a data-parallel peer of the same stage."""
    import torch

    digest = int(topo.digest()[:15], 16)
    mine = torch.tensor(
        [digest, topo.epoch, rank, int(opt_ok), param_step, opt_steps[0] if opt_steps else -1, *held_shard,
         *(seen or Seen()).row()],
        dtype=torch.int64,
    )
    out = torch.empty(topo.world * mine.numel(), dtype=torch.int64)
    wait(pg._allgather_base(out, mine), "invariant check")
    rows = out.view(topo.world, -1).tolist()
    r = resume_step
    wrong = {
        "I1": [x[2] for x in rows if not (x[0] == digest and x[1] == topo.epoch)],
        "I2": [x[2] for x in rows if not (x[6] == x[2] and x[7] == topo.world) or x[8] not in (NO_EVIDENCE, x[2])],
        "I3": [x[2] for x in rows if x[3] != 1],
        "I4": [x[2] for x in rows if not (x[4] == r and x[5] == r) or x[9] not in (NO_EVIDENCE, NO_MATCH, r)
               or x[10] not in (NO_EVIDENCE, r)],
    }
    for x in _params_disagree(topo, rows):
        if x not in wrong["I4"]:
            wrong["I4"].append(x)
    if sorted(x[2] for x in rows) != list(range(topo.world)):
        wrong["I2"].append(-1)
    inv = {k: not v for k, v in wrong.items()}
    detail = "; ".join(f"{k} fails on ranks {v}" for k, v in wrong.items() if v)
    named = _what_was_installed(topo, r, rows, set(wrong["I2"]) | set(wrong["I4"]))
    return inv, "; ".join(x for x in (detail, named) if x)


def _params_disagree(topo: Topology, rows: list[list[int]]) -> list[int]:
    """Ranks whose installed parameters differ from those most data-parallel peers of their stage installed
    (all of the stage's ranks on a tie); nothing when no rank reported a checksum (0)."""
    lay = topo.layout
    by_stage: dict[str, list[list[int]]] = {}
    for x in rows:
        if 0 <= x[2] < topo.world and x[11] != 0:
            by_stage.setdefault(lay.coord(x[2]).name(), []).append(x)
    out: list[int] = []
    for peers in by_stage.values():
        counts: dict[int, int] = {}
        for x in peers:
            counts[x[11]] = counts.get(x[11], 0) + 1
        if len(counts) < 2:
            continue
        top = max(counts.values())
        winners = [c for c, n in counts.items() if n == top]
        out += [x[2] for x in peers if len(winners) > 1 or x[11] != winners[0]]
    return sorted(out)


def _what_was_installed(topo: Topology, r: int, rows: list[list[int]], ranks: set[int]) -> str:
    """For the ranks that break I2 or I4, which shard and step the evidence says they installed."""
    said = []
    for x in rows:
        if x[2] not in ranks or not 0 <= x[2] < topo.world:
            continue
        name = topo.shard_name(x[2])
        if x[8] == NOT_READ:
            said.append(f"rank {x[2]} ({name}, step {r}): the evidence published for it (evidence/{topo.epoch}/"
                        f"{x[2]}) is missing or does not verify with the run key: its install cannot be checked")
            continue
        if x[8] == NO_MATCH:
            said.append(f"rank {x[2]} ({name}, step {r}): its optimizer state matches no checksum committed "
                        "before the failure")
        elif x[8] != NO_EVIDENCE and (x[8], x[9]) != (x[2], r):
            other = topo.shard_name(x[8]) if 0 <= x[8] < topo.world else str(x[8])
            said.append(f"rank {x[2]} ({name}, step {r}) installed the optimizer state of {other} at step {x[9]}")
        if x[10] not in (NO_EVIDENCE, r):
            got = f"step {x[10]}" if x[10] != NO_MATCH else "no recorded step"
            said.append(f"rank {x[2]} ({name}, step {r}) installed the parameters of {got}")
    return "; ".join(said)
