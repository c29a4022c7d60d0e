"""The redundancy scheme seam: how a rank keeps the committed optimizer shards of the ring recoverable.

Two schemes implement `RedundancyScheme`: `replicas:K` (full copies on K peers: `protect.replicas`)
and `ec:D+H` (parity blocks of groups of D shards: `protect.redundancy.erasure`). Both run their
per-step job on the `Replicator`'s background thread, which they share; `protection.make_scheme` picks
one from the parsed `--redundancy`, and nothing else looks at the kind. A scheme

- protects a step (`protect`, `wait`: the job of the committed half of that step),
- describes what it holds for the recovery planner (`describe`: verified copies and parity blocks),
- provides or rebuilds a lost shard in a recovery (`copy_of`: a verified replica it keeps;
  `rebuild`: the plan's decode jobs), and keeps the new epoch's copies of a state every member
  has whole (`keep`),
- follows the rank's partition (`attach`, `drop`, `invalidate_after`, `adopt`) and closes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from phoenixft.distributed.comm import EpochComm
from phoenixft.distributed.topology import Topology
from phoenixft.protect.replication import Replicator
from phoenixft.protect.scrub import HeldCopy
from phoenixft.protect.snapshot import ShardState
from phoenixft.recovery.planner import Descriptor

__all__ = ["RedundancyScheme", "RankView", "BadSource"]

BadSource = tuple[str, int, str]  # (shard or parity block, step, holder wid) whose copy failed verification


class RankView(Protocol):
    """What a scheme's recovery side needs of the rank it runs on (a `core.context.RankContext`)."""

    rank: int
    comm: EpochComm | None
    bad_sources: list[BadSource]

    def wait(self, work: Any, what: str) -> None: ...

    def copy_of(self, shard: int, shards: int, r: int) -> torch.Tensor: ...


class RedundancyScheme(ABC):
    """One rank's side of a redundancy scheme; its job runs on `repl`, the rank's replication thread."""

    def __init__(self, repl: Replicator) -> None:
        self.repl = repl

    # ---------------------------------------------------------------- every step
    def attach(self, state: ShardState) -> None:
        """The rank's shard state to protect (after every (re)partition)."""
        self.repl.state = state

    @abstractmethod
    def configure(self, comm: EpochComm, topo: Topology, rank: int, r: int) -> None:
        """A new epoch: this rank's part in the scheme; nothing newer than the resume step r is kept."""

    def protect(self, step: int) -> None:
        """Start protecting committed step `step` in the background."""
        self.repl.start(step)

    def wait(self, step: int) -> float:
        """Block until step `step` is protected on every side; returns the seconds waited."""
        return self.repl.wait(step)

    def close(self) -> None:
        self.repl.close()

    # ---------------------------------------------------------------- what it holds
    @abstractmethod
    def describe(self, d: Descriptor, shards: int, tp: int, pp: int) -> None:
        """Add to `d` what this rank holds for other ranks (verified, with checksums), and what failed
        verification (`d.rejected`); `shards` is the data-parallel width of the rank's partition."""

    def held(self) -> list[HeldCopy]:
        """The committed copies this rank keeps for other ranks (what the scrubber re-verifies)."""
        return []

    @abstractmethod
    def drop(self) -> None:
        """Forget every holding: the partition changed, the shards they were copies of are gone."""

    @abstractmethod
    def invalidate_after(self, r: int) -> None:
        """Drop every held step newer than r (r = -1: all of them)."""

    @abstractmethod
    def adopt(self, run_id: str, wid: str, gen: int) -> None:
        """A worker restarted in place takes over the holdings retained in shared memory."""

    # ---------------------------------------------------------------- in a recovery
    def copy_of(self, shard: int, r: int) -> torch.Tensor | None:
        """A verified copy of (shard, step r) this rank keeps for its owner, or None."""
        return None

    @abstractmethod
    def keep(self, topo: Topology, rank: int, r: int, fill: Callable[[int, torch.Tensor], Any]) -> None:
        """Every member has the whole state of step r (a fresh start, a reshard, a reload): commit at once
        what this rank keeps of it in the new epoch; `fill(shard, out)` writes shard's payload into `out`."""

    @abstractmethod
    def rebuild(self, rank: RankView, topo: Topology, r: int, n: int, timings: dict[str, Any],
                bad: list[str]) -> dict[int, tuple[torch.Tensor, int]]:
        """Carry out the plan's rebuild of shards with no copy left (`topo.meta["decode"]`), on every rank;
        returns {shard: (payload of n float32, checksum)} for the shards rebuilt for this rank."""
