"""Failures noticed within one layer's compute, not one step's.

A survivor learns of a failure at its next collective, which on a long forward/backward is most
of a step away; the coordinator cannot plan until every survivor has posted its descriptor. The
`FailureWatcher` thread blocks in the store's server-side `wait` on the current epoch's failure
flag (no polling; an epoch only ever ends by its flag being set, which also wakes the thread for the
next one; the flag counts once it verifies with the run key, `controlplane.sealed`: a forged one
is polled until the job's own replaces it), and `check()` - called by the
trainer between microbatches, in a forward pre-hook of every module and in a post-accumulate-grad
hook of every parameter - raises `PeerFailure` as soon as the flag is set. Checking is one
`Event.is_set()`: no store round trip on the training path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import parse_json
from phoenixft.errors import PeerFailure

__all__ = ["FailureWatcher", "drain_step", "drain_persists"]

WAKE_S = 600.0  # a timed-out wait logs a c10d warning: wake rarely (the epoch always changes by its flag)
FORGED_POLL_S = 0.02  # a flag that is there and does not verify (a wait would return at once): polled this often


class FailureWatcher:
    def __init__(self, store: Store) -> None:
        """Watch on `store`: a client of its own where a blocking wait holds up the client's other
        callers (`Store.independent()`)."""
        self._store = store
        self._epoch = -1
        self._raised = threading.Event()
        self._drain: tuple[int, int] | None = None  # (epoch, step) of a planned drain: stop after that step
        self._persist: tuple[int, int] | None = None  # (epoch, step) of a stop of the whole job: persist that step
        self._stop = threading.Event()
        self.on_raise: Callable[[int], None] | None = None  # called on this thread when a watched flag is raised
        self._t = threading.Thread(target=self._run, name="phoenixft-failure-watcher", daemon=True)
        self._t.start()

    def arm(self, epoch: int) -> None:
        """Watch `epoch`'s failure flag from now on (a new epoch starts clean)."""
        self._raised.clear()
        self._epoch = epoch

    def disarm(self) -> None:
        self._epoch = -1
        self._raised.clear()

    def flagged(self, epoch: int) -> bool:
        """The failure flag of `epoch` is set (and this watcher watches that epoch)."""
        return self._raised.is_set() and self._epoch == epoch

    def drain_step(self, epoch: int) -> int | None:
        """The step after which `epoch` ends for a planned drain (every rank stops at that step boundary),
        or None."""
        d = self._drain
        return d[1] if d is not None and d[0] == epoch == self._epoch else None

    def persist_step(self, epoch: int) -> int | None:
        """The step whose state every rank writes to the persistent tier before `epoch` ends (a stop of the whole
        job, coordinator/stop.py), or None."""
        p = self._persist  # (read once; not tied to the armed epoch: a worker leaving the epoch disarms first)
        return p[1] if p is not None and p[0] == epoch else None

    def check(self) -> None:
        if self._raised.is_set():
            raise PeerFailure("recovery requested by the control plane (noticed mid-step)")

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            e = self._epoch
            if e < 0 or self._raised.is_set():
                time.sleep(0.01)
                continue
            try:
                if not self._await(keys.failflag(e), e):
                    continue
                notice = sealed.get(self._store, keys.drain_notice(e)) if e == self._epoch else None
                if notice is not None:
                    # a planned drain: not a failure to leave the step for; the worker stops at the drain's step
                    # boundary, and only the drain's end (which the coordinator always sets) ends the step
                    self._drain = (e, drain_step(notice))
                    if drain_persists(notice):
                        self._persist = self._drain
                    if not self._await(keys.drain_abort(e), e):
                        continue
            except Exception:  # noqa: BLE001 - a timeout (the flag is not set), or the store is gone
                continue
            if e == self._epoch:
                self._raised.set()
                if self.on_raise is not None:
                    try:
                        self.on_raise(e)
                    except Exception:  # noqa: BLE001 - a callback must not end the watch
                        pass

    def _await(self, name: str, e: int) -> bool:
        """Block until `name` holds a value sealed with the run key; False when the watch should look again
        (the epoch changed, the watcher closed; a wait that times out raises)."""
        while not self._stop.is_set() and e == self._epoch:
            if not self._store.check([name]):
                self._store.wait([name], timedelta(seconds=WAKE_S))
            if sealed.has(self._store, name):
                return True
            time.sleep(FORGED_POLL_S)  # (there, and not the job's: ignored, logged, until replaced)
        return False


def drain_step(raw: bytes) -> int:
    """The step a drain notice's workers stop after (-1: at once, for a notice that does not say)."""
    rec = parse_json(raw, "drain_notice", {})
    after = rec.get("after_step")
    return after if isinstance(after, int) and not isinstance(after, bool) else -1


def drain_persists(raw: bytes) -> bool:
    """The drain notice stops the whole job: its step is written to the persistent tier as well."""
    return parse_json(raw, "drain_notice", {}).get("persist") is True
