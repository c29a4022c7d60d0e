"""What stops a local job: each node's cleanup once its agent exited, and the teardown of the whole job.

`JobTeardown` is the part of `phoenixft.runtime.localjob.LocalJob` that ends things. A node whose agent
exited is reaped (`_reap`): processes of its group still there after a moment are killed and recorded as
leaks, and segments of an agent that was not killed by a signal are removed and recorded. `teardown`
makes the run state final (`aborted` if it is not), which every process of the run obeys by itself within
STOP_GRACE_S; what has to be killed or removed after that is recorded in `leaks`. It is idempotent and
runs on every exit path, so no process of the job outlives it (the head also waits, bounded, for every
live node's agent to say it left before it stops serving the store), and it never ends a job that a
coordinator of another host leads (`_may_end_job`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from phoenixft.config.protection import PERSIST_CLOSE_S
from phoenixft.controlplane import LEADER_KEY, Store, keys, multi_get_nowait, sealed
from phoenixft.controlplane.signed import set_signed
from phoenixft.protect import shm
from phoenixft.runtime.procs import group_members, group_stopped

if TYPE_CHECKING:
    from phoenixft.config import RunConfig
    from phoenixft.controlplane import ProvisionedCluster
    from phoenixft.observe.live import LiveMetrics
    from phoenixft.runtime.localjob import Proc

__all__ = ["JobTeardown", "STOP_GRACE_S"]

STOP_GRACE_S = 10.0  # how long the run's processes get to exit by themselves once the run state is final


def _reap(procs: Any, timeout_s: float) -> None:
    """Wait for each of `procs` (Popen) to exit, at most `timeout_s` each; one still running is left to the caller."""
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass


class JobTeardown:
    """The cleanup of a job's nodes and its teardown (a base of LocalJob, which sets these attributes)."""

    cfg: RunConfig
    local: bool
    token: str
    run_id: str
    store: Store
    agents: dict[str, Proc]
    coords: dict[int, Proc]
    cluster: ProvisionedCluster | None
    live: LiveMetrics | None
    leaks: dict[str, list[Any]]
    stopped_starting: list[str]
    control_plane_lost: str | None
    handed_over: str | None
    _torn_down: bool
    _coord_pids: list[int]
    _reapers: dict[str, threading.Thread]
    _lock: threading.Lock
    _owner: bool
    _gateway: Any
    _front: Any

    def _kill_group(self, node: str, sig: int = signal.SIGKILL) -> None:
        p = self.agents.get(node)
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap_async(self, node: str) -> None:
        with self._lock:
            if node not in self._reapers:
                t = threading.Thread(target=self._reap, args=(node,), name=f"phoenixft-reap-{node}", daemon=True)
                self._reapers[node] = t
                t.start()

    def _reap(self, node: str) -> None:
        """A node's agent has exited: make sure nothing of the node is left.

        Its workers die with it (parent-death signal) and an agent that exits by itself frees its
        node's memory; so processes still there after a moment, and segments left by an agent that
        was not killed, are recorded as leaks. An agent killed by a signal (a failed or fenced node)
        could not clean up: removing its segments is the launcher's job, not a leak."""
        p = self.agents[node]
        killed_by_signal = (p.returncode or 0) < 0
        deadline = time.monotonic() + 3.0
        left = group_members(p.pid)
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = group_members(p.pid)
        if left:
            self._kill_group(node)
            with self._lock:
                self.leaks["killed"].append({"node": node, "pids": left, "why": "outlived its agent"})
            deadline = time.monotonic() + 5.0
            while group_members(p.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        removed = shm.unlink_segments(self.run_id, node)
        if removed and not killed_by_signal:
            with self._lock:
                self.leaks["removed_segments"].extend(name for name, _ in removed)

    def _never_up(self, node: str) -> bool:
        """The node's agent never reached the control plane (no heartbeat): it was still starting."""
        try:
            return self.store is not None and not self.store.check([keys.heartbeat(node)])
        except Exception:  # noqa: BLE001 - no store: nothing can tell
            return False

    def teardown(self) -> None:
        """Stop every process this job started and free its memory; safe to call more than once.

        The run state is made final first (`aborted` if it is not), which every process of the run
        obeys by itself within STOP_GRACE_S; what has to be killed or removed after that is recorded
        in `self.leaks` (see the module docstring)."""
        if self._torn_down:
            return
        self._torn_down = True
        try:
            if self.store is not None and self._may_end_job() and not self.store.check([keys.RUN_STATE]):
                set_signed(self.store, self.token, self.run_id, keys.RUN_STATE, "aborted")
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
        # a persistent tier finishes the checkpoints it is writing first (a run stopped by its --timeout, Ctrl-C)
        deadline = time.monotonic() + STOP_GRACE_S + (PERSIST_CLOSE_S if self.cfg.persist_every else 0.0)
        if not self.local and self._may_end_job():  # (cut off, or the job handed over: nobody leaves through us)
            self._await_remote_agents(deadline)
        procs = [*self.agents.values(), *self.coords.values()]
        while time.monotonic() < deadline:
            running = [p for p in procs if p.poll() is None]
            # a node whose every process is stopped (hung, SIGSTOPped) obeys nothing: waiting out the grace
            # for it only delays Ctrl-C by STOP_GRACE_S; it is killed below at once
            if not running or all(group_stopped(p.pid) for p in running):
                break
            time.sleep(0.05)
        for n, p in self.agents.items():
            if p.poll() is None:
                members = group_members(p.pid)
                self._kill_group(n)
                if self._never_up(n):  # a (repaired) spare still starting: it could not yet see the run end
                    self.stopped_starting.append(n)
                    continue
                self.leaks["killed"].append({"node": n, "pids": members, "why": "still running after the run ended"})
        _reap(self.agents.values(), 5.0)
        for pid in self._coord_pids:
            left = group_members(pid)
            if left:
                self.leaks["killed"].append({"node": "coordinator", "pids": left,
                                             "why": "still running after the run ended"})
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap(self.coords.values(), 5.0)
        for n in self.agents:
            self._reap_async(n)
        for t in list(self._reapers.values()):
            t.join(timeout=15)
        if self.local:  # (the head owns no host memory: each host's agents own theirs)
            for name, _ in shm.unlink_segments(self.run_id):  # not of any node's agent: nobody owned these
                self.leaks["removed_segments"].append(name)
        if self._owner:
            shm.unregister_owner(self.run_id)
        if self.store is not None and self._may_end_job():  # every process of the run is gone: leave no key
            try:
                self.store.clear_job()
            except Exception:  # noqa: BLE001 - the cluster is gone: nothing to clean there
                pass
        if self.cluster is not None:
            self.cluster.stop()
        if self.live is not None:
            self.live.close()
        if self._front is not None:
            self._front.stop()

    def _may_end_job(self) -> bool:
        """Whether this launcher may end the job (announce its end, remove its keys). Not once it was cut
        off from the control plane (`control_plane_lost`) while a coordinator it did not start leads the job: a standby
        on another host took over, and the job goes on without this host (`handed_over` names it); nor
        while it still does not answer. Always, otherwise."""
        if self.control_plane_lost is None or self.handed_over is not None:
            return self.handed_over is None
        try:  # (linearizable: the member this host reaches may have been cut off with it and lag behind)
            leader = self.store.get_nowait(LEADER_KEY, serializable=False)
        except Exception:  # noqa: BLE001 - still cut off: nothing can be written anyway
            return False
        if leader is None:
            return True
        ident = leader.decode(errors="replace")
        host, _, rest = ident.partition(":")
        pid = rest.partition(":")[0]
        if host == socket.gethostname() and pid.isdigit() and int(pid) in self._coord_pids:
            return True  # one of ours leads (then it ends with this launcher, as always)
        self.handed_over = ident
        return False

    def _await_remote_agents(self, deadline: float) -> None:
        """Head: keep serving the store until every admitted node that is not fenced has left (its agent
        saw the final run state and stopped its workers), at most until `deadline`; record who did not. A node
        whose heartbeat does not change for --failure-timeout meanwhile is not waited for any longer: its agent
        is dead or cut off (an idle spare lost during the run, never fenced), and cannot see the end either."""
        silent: list[str] = []
        try:
            members = sealed.get_json(self.store, keys.MEMBERS, {})
            waiting = [n for n in members if not sealed.has(self.store, keys.fence(n))]
            beats: dict[str, tuple[bytes | None, float]] = {}
            while waiting and time.monotonic() < deadline:
                waiting = [n for n in waiting if not sealed.has(self.store, keys.left(n))]
                now = time.monotonic()
                for n, b in zip(waiting, multi_get_nowait(self.store, [keys.heartbeat(n) for n in waiting]),
                                strict=True):
                    if n not in beats or beats[n][0] != b:
                        beats[n] = (b, now)
                silent += [n for n in waiting if now - beats[n][1] > self.cfg.failure_timeout]
                waiting = [n for n in waiting if n not in silent]
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nobody can leave through it any more
            return
        self.leaks["not_left"] = sorted(silent + waiting)
