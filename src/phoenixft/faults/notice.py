"""Notices that a node will go, as its agent receives them: the drain signal, and the `preempt:` fault.

`NoticeHandler` is installed by the node agent (runtime/agent.py). Its signal handler only records the
signal (a handler may run anywhere in the agent's loop); `tick(store)`, called from the agent's look at
the control plane, turns a recorded notice into a drain request (`controlplane.drain.request_drain`: the
coordinator moves the node's role to a spare at the next step boundary, and the node's processes then
leave by themselves). The drain signal is `--drain-signal` (SIGUSR1 by default, what Slurm's
`--signal=B:USR1@120` sends); with `--drain-on-sigterm` SIGTERM is one too (Kubernetes' way: preStop,
then SIGTERM, then SIGKILL after the grace period), except that a second SIGTERM, or one after the
launcher died, still stops the node at once.

The fault `preempt:node=I@step=S,notice=T` (kinds.py `Preempt`) fires here, by the agent of slot I, once
the job has completed step S-1: it is claimed once per run in the store and recorded, then the agent sends
itself its drain signal (a real signal, through the same handler), and T seconds later SIGKILLs its
node's process group if the node has not left by then (`expired`): a drain that could not finish in time
becomes an ordinary failure. Every rank holds step S at its start until the drain is asked for
(`fault/<i>/done`), so the notice comes in step S however fast the job trains and however seldom the agent
looks.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.drain import current_nodes, request_drain
from phoenixft.controlplane.values import parse_int
from phoenixft.faults import struck
from phoenixft.faults.kinds import Point
from phoenixft.faults.spec import FaultSpec

__all__ = ["NoticeHandler", "signal_number"]


def signal_number(name: str) -> int:
    """The signal `name` names (SIGUSR1, USR1, 10); ValueError if none."""
    text = name.strip().upper()
    if text.isdigit():
        return int(signal.Signals(int(text)))
    return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])


class NoticeHandler:
    """The drain notices of one node agent (`node`): its drain signal(s), and its preempt faults."""

    def __init__(self, node: str, faults: list[FaultSpec], drain_signal: int, on_sigterm: bool) -> None:
        self.node = node
        self.drain_signal = drain_signal
        self.on_sigterm = on_sigterm
        self.todo = [f for f in faults if f.point is Point.NOTICE]
        self.pending: tuple[int, float] | None = None  # (signal, when) of a notice not yet turned into a request
        self.requested = False  # a drain request was written for this node
        self.source = "signal"
        self.deadline: float | None = None  # when the node goes (wall clock), if the notice said
        self.kill_at: float | None = None  # (monotonic) a preempt fault's SIGKILL of the node
        self.fired: int | None = None  # the preempt fault whose notice this is (its held step goes on once asked)

    def install(self) -> None:
        signal.signal(self.drain_signal, self.on_signal)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.pending is None:
            self.pending = (signum, time.time())

    def takes_sigterm(self) -> bool:
        """SIGTERM is a drain notice now (`--drain-on-sigterm`, and not already one: a second stops the node)."""
        return self.on_sigterm and self.pending is None and not self.requested

    def tick(self, store: Store) -> None:
        """Fire due preempt faults, then write the drain request of a notice received."""
        if self.todo:
            self._fire_due(store)
        if self.pending is not None and not self.requested:
            signum, t = self.pending
            reason = (f"preemption notice ({signal.Signals(signum).name})" if self.source == "preempt"
                      else f"{signal.Signals(signum).name} received")
            slot = request_drain(store, self.node, reason, self.source, self.deadline)
            self.requested = True
            if slot is None:
                print(f"phoenixft agent {self.node}: {reason}, but the node is no member of the current epoch: "
                      "nothing to drain", flush=True)
            else:
                print(f"phoenixft agent {self.node}: {reason}: asked the coordinator to drain slot {slot}",
                      flush=True)
        if self.fired is not None:  # the workers holding the fault's step go on (the drain is asked for)
            sealed.put(store, keys.fault_done(self.fired), "1")
            self.fired = None

    def expired(self) -> bool:
        """A preempt fault's notice ran out (the node is to be SIGKILLed now)."""
        return self.kill_at is not None and time.monotonic() >= self.kill_at

    def _fire_due(self, store: Store) -> None:
        nodes = current_nodes(store)
        if self.node not in nodes:
            return
        slot = nodes.index(self.node)
        progress = parse_int(sealed.get(store, keys.PROGRESS), keys.PROGRESS, 0)
        for f in list(self.todo):
            if slot not in f.nodes or f.step is None or progress < f.step - 1:
                continue
            self.todo.remove(f)
            if not sealed.claim(store, keys.fault_claim(f.index, slot)):
                continue  # (fired on the node this one replaced: once a run)
            notice = f.notice or 0.0
            rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": "preempt",
                   "node": self.node, "nodes": [self.node], "slot": slot, "step": progress + 1, "phase": "notice",
                   "notice_s": notice}
            if sealed.claim(store, keys.fault_fired(f.index)):
                sealed.put(store, keys.fault(f.index), json.dumps(rec))
            struck.mark(store, self.node, f)  # (if its notice runs out: the fault's failure, not the host's)
            sealed.append(store, keys.EVENTS, rec)
            self.source, self.deadline = "preempt", time.time() + notice
            self.kill_at = time.monotonic() + notice
            self.fired = f.index
            os.kill(os.getpid(), self.drain_signal)  # a real signal, through the same handler
            return
