"""What `phoenixft chaos` draws: one scenario class per kind of campaign fault, in one registry.

A scenario is one or two `--inject` specs of the fault kinds (kinds.py) that together make one failure
to survive: a kill, a crash, a hang, a corrupt replica then its owner killed, a kill during the
recovery of another, a coordinator kill, two nodes at once. Each says how it is labelled, how often it
is drawn beyond one of each, how many nodes it takes out of the job, and how it is drawn from the
campaign's random stream (`draw`: the same stream, in the same order, gives the same schedule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from phoenixft.distributed.topology import Topology
from phoenixft.faults.spec import parse_fault

__all__ = ["ChaosFault", "Draw", "Scenario", "SCENARIOS", "corrupt_owners"]

_PAIR_PHASES = ("forward", "backward", "optimizer")  # both nodes reach these before a collective fails


@dataclass(frozen=True)
class ChaosFault:
    """One drawn fault: one or two `--inject` specs, the slots it loses together, survivability."""

    index: int  # 1-based position in the schedule
    kind: str
    step: int
    specs: tuple[str, ...]
    what: str  # one line for people
    lost: tuple[int, ...]  # node slots lost together (by one recovery)
    unsurvivable: str | None = None  # why not, by design; None if survivable
    unusable: tuple[int, ...] = ()  # slots whose copies of the lost shards recovery cannot use (corrupted)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "step": self.step, "inject": list(self.specs),
                "what": self.what, "lost_slots": list(self.lost), "survivable": self.unsurvivable is None,
                "unsurvivable": self.unsurvivable}


@dataclass(frozen=True)
class Draw:
    """What a scenario draws against: fault `i` at step `s` of a job of `n` nodes (`world` ranks)."""

    i: int
    s: int
    n: int
    world: int
    ring: Topology
    phase: str  # drawn for every fault, first
    rng: Any  # random.Random: the campaign's stream
    cfg: Any  # RunConfig: the campaign's
    spares: int  # the job's spares now
    ok_pairs: Callable[[int], list[tuple[int, int]]]  # pairs of slots whose loss at a step is survivable
    pair_ok: Callable[[tuple[int, int], int], bool]  # whether losing this pair of slots at a step is survivable


def _fault(d: Draw, name: str, spec: str, why: str, lost: tuple[int, ...]) -> ChaosFault:
    """A scenario of one spec, described by its fault kind (and `why`, what the campaign expects of it)."""
    f = parse_fault(spec)
    return ChaosFault(d.i, name, d.s, (spec,), f.kind_of.describe(f) + why, lost)


class Scenario:
    name: ClassVar[str]
    label: ClassVar[str]  # its column in the schedule
    weight: ClassVar[int]  # how often it is drawn beyond one of each
    losses: ClassVar[int]  # nodes it takes out of the job
    by_journal: ClassVar[bool] = False  # recovered by the coordinator's restart, not by a recovery epoch

    def fallback(self, d: Draw) -> str | None:
        """Another scenario to draw instead, when this one cannot be drawn at step d.s."""
        return None

    def draw(self, d: Draw) -> ChaosFault:
        raise NotImplementedError


class Kill(Scenario):
    name, label, weight, losses = "kill", "kill", 3, 1

    def draw(self, d: Draw) -> ChaosFault:
        node = d.rng.randrange(d.n)
        return _fault(d, self.name, f"kill:node={node}@step={d.s},phase={d.phase}", "", (node,))


class Crash(Scenario):
    name, label, weight, losses = "crash", "crash", 2, 0

    def draw(self, d: Draw) -> ChaosFault:
        rank = d.rng.randrange(d.world)
        return _fault(d, self.name, f"crash:rank={rank}@step={d.s},phase={d.phase}", " (restarted in place)", ())


class Hang(Scenario):
    name, label, weight, losses = "hang", "hang", 1, 1

    def draw(self, d: Draw) -> ChaosFault:
        node = d.rng.randrange(d.n)
        return _fault(d, self.name, f"hang:node={node}@step={d.s},phase={d.phase}",
                      f" (found after --failure-timeout {d.cfg.failure_timeout:g}s, fenced)", (node,))


def corrupt_owners(ring: Topology, n: int, pair_ok: Callable[[tuple[int, int]], bool]) -> list[int]:
    """Owners whose shard survives its loss together with its first holder's copy (which a corrupt fault
    damages): another replica, or the persistent tier, still has it. None with --replicas 1 and no tier."""
    pairs = ((o, ring.holders(o)[0]) for o in range(n))
    return [o for o, h in pairs if pair_ok((min(o, h), max(o, h)))]


class Corrupt(Scenario):
    name, label, weight, losses = "corrupt", "corrupt replica", 2, 1

    def fallback(self, d: Draw) -> str | None:
        return None if corrupt_owners(d.ring, d.n, lambda p: d.pair_ok(p, d.s)) else "kill"

    def draw(self, d: Draw) -> ChaosFault:
        owners = corrupt_owners(d.ring, d.n, lambda p: d.pair_ok(p, d.s))
        owner = owners[d.rng.randrange(len(owners))]
        holder = d.ring.holders(owner)[0]  # node level: local rank 0's holder is on the same node as all
        # the replicas node `holder` receives during step s are those of step s - 1; node `owner` killed in its
        # optimizer phase of step s (no rank commits s without it), s - 1 is the step recovery resumes from, so
        # the corrupted copy is the one it would load: its checksum must reject it
        return ChaosFault(d.i, self.name, d.s, (f"corrupt:node={holder}@step={d.s}",
                                                f"kill:node={owner}@step={d.s},phase=optimizer"),
                          f"corrupt node {holder}'s replica of node {owner}'s shard of step {d.s - 1}, then SIGKILL "
                          f"node {owner} in its optimizer step {d.s}: recovery's copy of step {d.s - 1} is the "
                          "corrupt one, which the checksum must reject", (owner,), unusable=(holder,))


class KillDuringRecovery(Scenario):
    name, label, weight, losses = "kill_during_recovery", "kill during recovery", 2, 2

    def draw(self, d: Draw) -> ChaosFault:
        j = d.rng.randrange(d.n)
        mates = [b if a == j else a for a, b in d.ok_pairs(d.s) if j in (a, b)]
        if d.spares == 0 and not mates:  # no spare to promote into slot j, no survivor whose loss is survivable
            return _fault(d, "kill", f"kill:node={j}@step={d.s},phase={d.phase}", "", (j,))
        other = d.rng.choice(mates) if mates else j
        # with spares the lost node's slot is taken by a spare and the others keep theirs; without, the
        # job shrinks: the survivors keep their order, so node `other` is in slot `other - 1` past j
        slot = other - 1 if d.spares == 0 and other > j else other
        who = (f"node {other}" + (f" (slot {slot} once the job has shrunk)" if slot != other else "")
               if other != j else f"the spare promoted into slot {j}")
        return ChaosFault(d.i, self.name, d.s, (f"kill:node={j}@step={d.s},phase=optimizer",
                                                f"kill:node={slot}@step={d.s},phase=recovery"),
                          f"SIGKILL node {j} in its optimizer phase, then {who} during that recovery's state "
                          "transfer", tuple(sorted({j, other})))


class KillCoordinator(Scenario):
    name, label, weight, losses = "kill_coordinator", "coordinator kill", 1, 0
    by_journal = True

    def draw(self, d: Draw) -> ChaosFault:
        return _fault(d, self.name, f"kill:coordinator@step={d.s},phase={d.phase}", " (restarted from its journal)",
                      ())


class TwoNodes(Scenario):
    name, label, weight, losses = "two_nodes", "two nodes at once", 2, 2

    def fallback(self, d: Draw) -> str | None:
        return None if d.ok_pairs(d.s) else "kill"  # no survivable pair this early (no persistent checkpoint yet)

    def draw(self, d: Draw) -> ChaosFault:
        a, b = d.rng.choice(d.ok_pairs(d.s))
        ph = d.rng.choice(_PAIR_PHASES)
        return _fault(d, self.name, f"kill:node={a},{b}@step={d.s},phase={ph}", "", (a, b))


SCENARIOS: dict[str, Scenario] = {x.name: x for x in (Kill(), Crash(), Hang(), Corrupt(), KillDuringRecovery(),
                                                      KillCoordinator(), TwoNodes())}
