"""The quarantine rule, pure: a host with `after` failures within any `window` seconds is quarantined.

A failure history is a list of times (seconds, one clock: the coordinator's wall clock, as recorded
in the store). A host is quarantined at the time of its `after`-th failure inside some window of
`window` seconds: the earliest `t[j + after - 1]` (times sorted) with `t[j + after - 1] - t[j] <=
window`. Once quarantined a host stays so for the rest of the run (a repaired host that failed
`after` times within the window is not handed back to the job). `after` 0 turns the rule off.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["quarantined_at", "failures_in_window"]


def quarantined_at(times: Sequence[float], after: int, window: float) -> float | None:
    """When the failures at `times` quarantine their host (the time of the failure that completes
    `after` failures within `window` seconds); None if they never do (or `after` is 0)."""
    if after <= 0 or len(times) < after:
        return None
    t = sorted(times)
    for j in range(len(t) - after + 1):
        if t[j + after - 1] - t[j] <= window:
            return t[j + after - 1]
    return None


def failures_in_window(times: Sequence[float], now: float, window: float) -> int:
    """How many of the failures at `times` lie within the `window` seconds up to `now`."""
    return sum(1 for x in times if now - window <= x <= now)
