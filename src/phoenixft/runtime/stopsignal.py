"""The head's stop signals (`phoenixft coordinator --stop-signal SIG[,SIG...]`): the notice that every node of the job
goes (a scheduler's time limit or preemption), turned into a stop of the whole job with its state saved.

The first stop signal asks the coordinator to stop at the next step boundary and write that step to the
persistent tier (`controlplane.drain.request_stop`; coordinator/stop.py); the run then ends `stopped` and the head
exits with code 75 (runtime/exitcode.py). The handler only records the signal (a handler may run anywhere in the
launcher's loop, whose store client must not be used from it); `tick`, called from the launcher's look at the store,
writes the request. A stop signal that comes again while the job stops changes nothing (Slurm may send its notice
to the batch script and its processes alike); Ctrl-C and SIGHUP still stop the head at once, and so does SIGTERM
when it is not one of the stop signals.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from phoenixft.controlplane import Store
from phoenixft.errors import UserError

__all__ = ["StopOnSignal", "parse_stop_signals"]

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


class StopOnSignal:
    """Records the first of `signals` and, at the launcher's next look, asks the coordinator to stop the job."""

    def __init__(self, signals: list[int]) -> None:
        self.signals = signals
        self.pending: tuple[int, float] | None = None  # (signal, when) of the notice, not yet written
        self.sent = False

    def install(self) -> None:
        """Main thread only (as every signal handler)."""
        for s in self.signals:
            signal.signal(s, self.on_signal)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.pending is None and not self.sent:
            self.pending = (signum, time.time())

    def tick(self, store: Store, say: Any = None) -> None:
        """Write the stop request of a notice received (once); `say(text)` tells the person watching."""
        if self.pending is None or self.sent:
            return
        from phoenixft.controlplane.drain import request_stop

        signum, t = self.pending
        name = signal.Signals(signum).name
        request_stop(store, f"{name} received", "signal", t=t)
        self.sent = True
        if say is not None:
            say(f"== {name} received: the job stops at the next step boundary with its state saved")
