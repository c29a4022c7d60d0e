"""Lost nodes come back repaired, as fresh spares (`--repair-after SECONDS`).

On a real cluster a failed node is drained, repaired or replaced, and handed back to the job's
spare pool some time later. `RepairQueue` models that for the local launcher: each node whose
agent exited or was fenced is scheduled, once, to come back `after_s` seconds later under a new
spare id `s<k>` (k counting up past the configured spares), which the launcher starts as a normal
spare agent; the coordinator admits it to the pool from the store key "spares". Pure
bookkeeping (no processes, no store), so the launcher's part stays a few lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container

__all__ = ["RepairQueue"]


class RepairQueue:
    """Schedules the return of lost nodes as new spares; `due()` says which to start now."""

    def __init__(self, after_s: float, first_index: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self._next = first_index
        self._clock = clock
        self._seen: set[str] = set()
        self._pending: list[tuple[float, str]] = []  # (due time, lost node)

    def lost(self, node: str) -> None:
        """A node was lost (exit or fence); schedule its repair once. No-op when repair is off."""
        if self.after_s <= 0 or node in self._seen:
            return
        self._seen.add(node)
        self._pending.append((self._clock() + self.after_s, node))

    def due(self, taken: Container[str]) -> list[tuple[str, str]]:
        """(new spare id, the lost node it replaces) for every repair whose time has come."""
        now = self._clock()
        ready = [p for p in self._pending if p[0] <= now]
        self._pending = [p for p in self._pending if p[0] > now]
        out = []
        for _, node in ready:
            while f"s{self._next}" in taken:
                self._next += 1
            out.append((f"s{self._next}", node))
            self._next += 1
        return out
