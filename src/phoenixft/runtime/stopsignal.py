"""The head's stop signals (`phoenixft coordinator --stop-signal SIG[,SIG...]`): the notice that every node of the job
goes (a scheduler's time limit or preemption), turned into a stop of the whole job with its state saved.

The first stop signal asks the coordinator to stop at the next step boundary and write that step to the
persistent tier (`controlplane.drain.request_stop`; coordinator/stop.py); the run then ends `stopped` and the head
exits with code 75 (runtime/exitcode.py). The handler only records the signal (a handler may run anywhere in the
launcher's loop, whose store client must not be used from it); `tick`, called from the launcher's look at the store,
writes the request. A stop signal that comes again while the job stops changes nothing (Slurm may send its notice
to the batch script and its processes alike); Ctrl-C and SIGHUP still stop the head at once.

SIGTERM with no notice before it (Slurm at `scancel` or at the time limit, a preemption without
`send_user_signal`, `kill`) is a stop signal too whenever the job has a persistent tier (`term_stops`): the job is
being ended, so it stops at the next step boundary with that step saved, as after a notice, but within
TERM_WINDOW_S (Slurm sends SIGKILL KillWait after its SIGTERM: 30 s by default). The request carries that deadline
(coordinator/stop.py bounds its waits by it), and a stop not over TERM_OVERDUE_S after it ends the head as Ctrl-C
does. Without a persistent tier there is nothing to save: SIGTERM stops the head at once (exit 130).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from phoenixft.controlplane import Store
from phoenixft.errors import UserError

__all__ = ["StopOnSignal", "parse_stop_signals", "term_stops", "TERM_WINDOW_S", "TERM_OVERDUE_S"]

TERM_WINDOW_S = 25.0  # a SIGTERM's stop is over within this (Slurm's default KillWait, 30 s, less a margin)
TERM_OVERDUE_S = 5.0  # ... and one still going this long after that ends the head at once (as Ctrl-C)

_REFUSED = (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP)


def parse_stop_signals(text: str) -> list[int]:
    """The signals `--stop-signal` names (comma-separated names or numbers); UserError for one that is not a
    signal, or one that cannot be caught or already means something to the head."""
    from phoenixft.faults.notice import signal_number

    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            sig = signal_number(part)
        except (KeyError, ValueError):
            raise UserError(f"--stop-signal={text}: {part!r} is not a signal name (e.g. SIGUSR1) or number") from None
        if sig in _REFUSED:
            raise UserError(f"--stop-signal={text}: {signal.Signals(sig).name} cannot be caught or already means "
                            "something to the head; use SIGUSR1, SIGUSR2 or SIGTERM")
        if sig not in out:
            out.append(sig)
    return out


def term_stops(persist_every: int, stop_signals: list[int]) -> list[int]:
    """The head's stop signals: `stop_signals`, and SIGTERM when the job has a persistent tier to save to."""
    if persist_every and signal.SIGTERM not in stop_signals:
        return [*stop_signals, signal.SIGTERM]
    return list(stop_signals)


class StopOnSignal:
    """Records the first of `signals` and, at the launcher's next look, asks the coordinator to stop the job."""

    def __init__(self, signals: list[int]) -> None:
        self.signals = signals
        self.pending: tuple[int, float] | None = None  # (signal, when) of the notice, not yet written
        self.sent = False
        self.deadline: float | None = None  # (a SIGTERM's: when the stop must be over, wall clock)

    def install(self) -> None:
        """Main thread only (as every signal handler)."""
        for s in self.signals:
            signal.signal(s, self.on_signal)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.pending is None and not self.sent:
            self.pending = (signum, time.time())

    def tick(self, store: Store, say: Any = None) -> None:
        """Write the stop request of a notice received (once); `say(text)` tells the person watching.
        KeyboardInterrupt when a SIGTERM's stop is overdue (the head then ends as at Ctrl-C)."""
        if self.sent and self.deadline is not None and time.time() > self.deadline + TERM_OVERDUE_S:
            raise KeyboardInterrupt
        if self.pending is None or self.sent:
            return
        from phoenixft.controlplane.drain import request_stop

        signum, t = self.pending
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM:  # the job is being ended: no notice, SIGKILL follows
            self.deadline = t + TERM_WINDOW_S
        request_stop(store, f"{name} received", "signal", deadline=self.deadline, t=t)
        self.sent = True
        if say is not None:
            within = f" (within {TERM_WINDOW_S:g}s)" if self.deadline is not None else ""
            say(f"== {name} received: the job stops at the next step boundary with its state saved{within}")
