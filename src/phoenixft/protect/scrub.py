"""Scrubbing: the committed copies a rank holds are re-verified at rest, and a bad one is repaired at once.

A rank holds committed copies that nothing reads until a recovery needs them: the two halves of its
own optimizer shard, the replicas it keeps for its ring peers (`replicas:K`) or the parity blocks of
its groups (`ec:D+H`). Each half's header records the checksum its bytes had when they were committed.
A bit that flips there afterwards (silent data corruption at rest) is found by a recovery's descriptor,
which then refuses the copy: too late if that copy was the only one of its step. With `--scrub-every N`
the rank re-hashes its held halves in the background and compares them with their recorded checksums;
a half that differs is repaired from a good copy held by a peer, on this host or another (the repair
round, scrub_round.py and scrub_repair.py: its owner's committed half, another holder's replica, or for a
parity block a fresh encode of its group's data) before any recovery needs it, and every finding is
reported (an event: the live line, the report's `scrub`).

Only halves that are recovery points are hashed: a half of a step older than both steps the rank's
parameter buffers hold is the staging half of the next protection job (a replica's or parity block's
older half, every other step), which no recovery can resume from and which is about to be rewritten.

`ScrubSchedule` is the rate limiter, pure logic: a *pass* visits every held half once, in a fixed
order, and is spread over at most N steps: each step may verify ceil(pass bytes / N) bytes (plus the
one half that crosses the line), so the per-step cost is bounded and every byte held when the pass
began is verified within N steps of its start. With N = 1 every held half is verified every step.

The scrub runs on the replication thread, at the start of each step's protection job (`Scrubber.tick`),
so it is off the training loop's critical path, and it never races a writer: the holdings and parity
blocks are written by that thread itself, and the own shard's halves do not change during the job
(the optimizer that writes the next one waits for the job to complete).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from phoenixft.protect.snapshot import H_CRC, H_STEP, H_VALID, PingPong, checksum

__all__ = ["ScrubSchedule", "HeldCopy", "Finding", "Repair", "Scrubber", "ScrubStats"]


class ScrubSchedule:
    """Which items (key -> size in bytes) to verify at each tick so that every pass covers every item
    present at its start within `every` ticks, with at most ceil(total / every) + one item's bytes per tick."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._pending: list[Hashable] = []
        self._budget = 0  # bytes per tick of the current pass
        self._allowed = 0  # bytes the pass may have verified by now
        self._spent = 0
        self.passes = 0  # passes completed
        self.pass_ticks = 0  # ticks the current pass has taken

    def tick(self, sizes: Mapping[Hashable, int]) -> list[Hashable]:
        """The items to verify now, from those that exist now (`sizes`, in a stable order)."""
        if not self._pending:
            self._pending = sorted(sizes, key=repr)
            total = sum(sizes[k] for k in self._pending)
            self._budget = max(1, math.ceil(total / self.every))
            self._allowed = self._spent = 0
            self.pass_ticks = 0
        self.pass_ticks += 1
        self._allowed += self._budget
        due: list[Hashable] = []
        while self._pending and (self._spent < self._allowed or not sizes.get(self._pending[0])):
            k = self._pending.pop(0)
            if k in sizes:  # (an item gone since the pass began is skipped)
                due.append(k)
                self._spent += sizes[k]
        if not self._pending:
            self.passes += 1
        return due


@dataclass(frozen=True)
class HeldCopy:
    """A ping-pong pair of committed copies a rank holds: `kind` own | replica | parity, `ident` the shard
    (own, replica) or the group id (parity)."""

    kind: str
    ident: int
    pp: PingPong

    def nbytes(self) -> int:
        return int(self.pp.payload(0).numel()) * 4


@dataclass
class Finding:
    """A held half whose bytes no longer match their committed checksum."""

    kind: str
    ident: int
    half: int
    step: int
    crc: int
    repaired_from: str | None = None  # who the good bytes came from (None: not repaired)
    why_not: str = ""  # why it could not be repaired
    repair_s: float = 0.0


@dataclass
class ScrubStats:
    ticks: int = 0
    verified_bytes: int = 0  # over the run
    last_bytes: int = 0  # verified by the newest tick
    last_s: float = 0.0  # wall seconds of the newest tick (verification and repairs)
    last_cpu_s: float = 0.0  # CPU seconds the thread spent on it (what it took from the cores training uses)
    found: int = 0
    repaired: int = 0
    findings: list[Finding] = field(default_factory=list)


Repair = Callable[[list[tuple[HeldCopy, Finding]]], None]


class Scrubber:
    """One rank's scrubber. `copies()`: what it holds now; `repair(found)`: restore each (copy, finding)
    from a good source, setting the finding's `repaired_from` (where the bytes came from) or `why_not`;
    called once per tick, with the tick's findings, none included (in the product it is a collective
    round that every rank makes); `report(finding)`: publish it."""

    def __init__(self, every: int, copies: Callable[[], list[HeldCopy]],
                 repair: Repair, report: Callable[[Finding], Any],
                 oldest: Callable[[], int] = lambda: 0) -> None:
        """`oldest()`: the oldest step a recovery could resume from now (the older of the two steps the
        rank's parameter buffers hold); a half of an older step is the next protection job's staging half,
        a recovery point no more, and is not hashed."""
        self.schedule = ScrubSchedule(every)
        self._copies, self._repair, self._report, self._oldest = copies, repair, report, oldest
        self._reported: set[tuple[str, int, int, int, int]] = set()  # (kind, ident, half, step, crc)
        self.stats = ScrubStats()

    def tick(self, abort: Callable[[], str | None] = lambda: None) -> None:
        """Verify the halves this step's share of the pass names; repair and report what does not match."""
        t0, c0 = time.perf_counter(), time.thread_time()
        done = 0
        found: list[tuple[HeldCopy, Finding]] = []
        try:
            oldest = self._oldest()
            held = {(c.kind, c.ident, x): c for c in self._copies() for x in (0, 1) if c.pp.step_of(x) >= oldest}
            due = self.schedule.tick({k: c.nbytes() for k, c in held.items()})
            for key in due:
                if abort():
                    break
                c, half = held[key], key[2]  # type: ignore[index]
                done += self._verify(c, half, found)
        finally:  # the repair is a round every rank makes, whatever its own verification did
            t1 = time.perf_counter()
            self._repair(found)
        for _, f in found:
            f.repair_s = time.perf_counter() - t1
            self.stats.found += 1
            self.stats.repaired += f.repaired_from is not None
            self.stats.findings.append(f)
            self._report(f)
        self.stats.ticks += 1
        self.stats.verified_bytes += done
        self.stats.last_bytes = done
        self.stats.last_s = time.perf_counter() - t0
        self.stats.last_cpu_s = time.thread_time() - c0

    def _verify(self, c: HeldCopy, half: int, found: list[tuple[HeldCopy, Finding]]) -> int:
        """Verify one half (a half not committed, or whose checksum is not recorded yet, is skipped), adding
        it to `found` when its bytes do not match; returns the bytes hashed."""
        hdr = c.pp.header[half]
        if not int(hdr[H_VALID]) or int(hdr[H_CRC]) == 0:
            return 0
        step, crc = int(hdr[H_STEP]), int(hdr[H_CRC])
        payload = c.pp.payload(half)
        if checksum(payload) == crc:
            return payload.numel() * 4
        sig = (c.kind, c.ident, half, step, crc)
        if sig in self._reported:  # found before and not repairable: said once
            return payload.numel() * 4
        self._reported.add(sig)
        found.append((c, Finding(kind=c.kind, ident=c.ident, half=half, step=step, crc=crc)))
        return payload.numel() * 4
