"""A spare's side of the health gate: its agent checks the host when it joins (once its workers have
started: the check takes no CPU from their start) and again whenever the coordinator asks
(`keys.HEALTH_ASK`: before a promotion when its last verdict is no longer fresh, and now and then while
it waits idle), and posts each verdict at `keys.health(node)`.

A check runs in a process forked from the agent (`CheckProcess`): the device is initialised there, never in
the agent whose workers are forked from it, and the agent goes on supervising its workers and heartbeating
meanwhile (`SpareHealth.poll`, at each of its looks and whenever it reaps the check's process). Before its
workers start, the agent posts `keys.health_running(node)` ({n, phase, t}): the coordinator then knows a
verdict is on its way (a spare whose join check has not posted its verdict yet may be chosen for a
promotion, which waits, bounded, for that verdict). A check that outlives its bound (`check_bound_s`) is
killed and fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.keeper import Keeper
from phoenixft.controlplane.values import note_bad, parse_int, parse_json
from phoenixft.faults import struck
from phoenixft.faults.kinds import Point

__all__ = ["BUILTIN_BOUND_S", "REF_KEY", "JOIN_DEFER_S", "check_bound_s", "CheckProcess", "SpareHealth"]

BUILTIN_BOUND_S = 30.0  # the built-in probes take well under a second; this bounds a device that hangs
REF_KEY = keys.HEALTH_REF  # the reference checksum of the matrix product, published by the coordinator
JOIN_DEFER_S = 30.0  # the join check starts once the spare's workers are ready, or after this long at most
BACKGROUND = ("join", "recheck")  # the checks no recovery asked for run at a lower CPU priority ...
BACKGROUND_NICE = 10  # (a promotion waiting for one gets the CPU anyway: the job's other ranks wait with it)


def check_bound_s(cfg: RunConfig) -> float:
    """The longest a whole check may take: the built-in probes' bound and the command's timeout."""
    return BUILTIN_BOUND_S + (cfg.health_check_timeout if cfg.health_check else 0.0)


def _child(cfg: RunConfig, node: str, run_id: str, reference: str, perturb: bool, phase: str) -> dict[str, Any]:
    import torch

    from phoenixft.distributed.device import place
    from phoenixft.health.check import SHM_CAP, SHM_CAP_PROMOTION, builtin_checks, run_command
    from phoenixft.protect.shm import node_prefix

    torch.set_num_threads(1)  # (a spare's workers share the host; the probes are small)
    if not reference:  # (computed here, never in the agent: torch's thread pools do not survive a fork)
        from phoenixft.health.check import reference_checksum

        reference = reference_checksum()
    device = place(cfg.device, 0, node, cfg.nodes, cfg.workers_per_node)
    path = f"/dev/shm/{node_prefix(run_id, node)}health-{os.getpid()}"
    # a sample of the snapshot memory (sizing the node's halves builds the model: seconds, not worth it here)
    res = builtin_checks(device, path, SHM_CAP if phase == "join" else SHM_CAP_PROMOTION, reference, perturb)
    if cfg.health_check:
        t = time.perf_counter()
        why = run_command(cfg.health_check, cfg.health_check_timeout)
        res.times["command"] = time.perf_counter() - t
        if why:
            res.fail("command", why)
    return res.to_json()


def _failed(reason: str) -> dict[str, Any]:
    return {"ok": False, "reason": reason, "times": {}}


class CheckProcess:
    """One check, running in a process forked now; `poll` says when it is done and what it found (a failure if
    it crashed or outlived `check_bound_s`)."""

    def __init__(self, cfg: RunConfig, node: str, run_id: str, reference: str, perturb: bool, phase: str,
                 ignore_signal: int = 0) -> None:
        from phoenixft.runtime.procs import die_with_parent, fork

        self.bound = check_bound_s(cfg)
        self.deadline = time.monotonic() + self.bound
        self.result: dict[str, Any] | None = None
        self._buf = b""
        r, w = os.pipe()
        parent = os.getpid()
        pid = fork()
        if pid == 0:  # the check's process
            code = 0
            try:
                os.close(r)
                for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                    signal.signal(s, signal.SIG_DFL)
                if ignore_signal not in (0, signal.SIGTERM):  # (a drain notice sent to the node's process group)
                    signal.signal(ignore_signal, signal.SIG_IGN)
                die_with_parent(signal.SIGKILL, parent)
                if phase in BACKGROUND:  # (the workers starting, or training, on this host come first)
                    os.nice(BACKGROUND_NICE)
                out = _child(cfg, node, run_id, reference, perturb, phase)
            except BaseException as e:  # noqa: BLE001 - the check itself failed: that is its finding
                traceback.print_exc()
                out = _failed(f"the check failed: {type(e).__name__}: {str(e)[:200]}")
                code = 1
            try:
                os.write(w, json.dumps(out).encode())
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(w)
        fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_NONBLOCK)
        fcntl.fcntl(r, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
        self.pid, self._r = pid, r

    def _drain_pipe(self) -> None:
        while self._r >= 0:
            try:
                chunk = os.read(self._r, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._buf += chunk

    def reaped(self) -> None:
        """Its process has exited (and was reaped, here or by the agent's `waitpid(-1)`): read its result."""
        if self.result is not None:
            return
        self._drain_pipe()
        os.close(self._r)
        self._r = -1
        out = parse_json(self._buf, "health check result")
        self.result = (out if isinstance(out, dict) and isinstance(out.get("ok"), bool)
                       else _failed("the health check's process died without a result"))

    def poll(self) -> dict[str, Any] | None:
        """Its result once it is done (never blocks); None while it runs."""
        if self.result is not None:
            return self.result
        self._drain_pipe()
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # (reaped by someone else: it has exited)
            pid = self.pid
        if pid == self.pid:
            self.reaped()
        elif time.monotonic() > self.deadline:
            self.kill()
            self.result = _failed(f"the health check did not finish within {self.bound:g}s")
        return self.result

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Poll until it is done, at most `timeout_s`."""
        end = time.monotonic() + timeout_s
        while (res := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.01)
        return res

    def kill(self) -> None:
        """Stop it now (it failed to finish, or its agent leaves); never raises."""
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        if self._r >= 0:
            os.close(self._r)
            self._r = -1


class SpareHealth:
    """Spare `node`'s checks: `start_join` once admitted (its workers start meanwhile), `answer` in every look
    of its agent (a check the coordinator asked for), `poll` to post a finished check's verdict."""

    def __init__(self, cfg: RunConfig, node: str, run_id: str, host: str, ignore_signal: int = 0,
                 workers: int = 0) -> None:
        self.cfg, self.node, self.run_id, self.host = cfg, node, run_id, host
        self.ignore_signal = ignore_signal
        # a spare checks itself when it joins; any node answers the coordinator's asks (a mesh's node released from
        # a dropped data-parallel replica is a spare from then on, checked before it is promoted again)
        self.on = cfg.health_gate
        self.workers = [keys.ready(f"{node}.{i}") for i in range(workers)]  # (the keys its workers set when ready)
        self.answered = 0  # the last ask seen
        self.n = 0  # checks started
        self.running: CheckProcess | None = None
        self.deferred_until: float | None = None  # the join check waits for the workers' start, at most until then
        self._rec: dict[str, Any] = {}  # what the running check's verdict will say besides its result
        self._kept: Keeper | None = None  # its records, put back if overwritten

    def _keeper(self, store: Store) -> Keeper:
        """The keeper of this spare's records, on the agent's current client (it reconnects after a failure)."""
        if self._kept is None:
            self._kept = Keeper(store)
        self._kept.store = store
        return self._kept

    def _sick(self, store: Store) -> bool:
        """A `sick:` fault of this spare applies now; recorded as fired the first time."""
        faults = [f for f in self.cfg.faults if f.point is Point.HEALTH]
        if not faults:
            return False
        progress = parse_int(sealed.get(store, keys.PROGRESS), keys.PROGRESS, 0)
        hit = [f for f in faults if f.kind_of.fails_health_check(f, self.node, progress)]
        for f in hit:
            struck.mark(store, self.node, f)  # (the failed check is the fault's, not its host's)
            if sealed.claim(store, keys.fault_fired(f.index)):
                rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": f.kind,
                       "node": self.node, "slot": None, "step": progress, "phase": "health"}
                sealed.put(store, keys.fault(f.index), json.dumps(rec))
                sealed.append(store, keys.EVENTS, rec)
        return bool(hit)

    def start(self, store: Store, phase: str, ask: int, defer_s: float = 0.0) -> None:
        """Start a check (its verdict is posted by `poll` once it is done); the coordinator is told first.
        `defer_s`: its process starts once this node's workers have announced themselves ready (at most
        that many seconds from now), so that it takes no CPU from their start."""
        self.n += 1
        t0 = time.time()
        running = {"n": self.n, "phase": phase, "ask": ask, "t": t0}
        self._keeper(store).put(keys.health_running(self.node), json.dumps(running))
        self._rec = {"node": self.node, "host": self.host, "phase": phase, "ask": ask, "n": self.n, "t": t0}
        if defer_s > 0 and self.workers:
            self.deferred_until = time.monotonic() + defer_s
        else:
            self._launch(store)

    def _launch(self, store: Store) -> None:
        self.deferred_until = None
        ref = sealed.get(store, REF_KEY)
        reference = ref.decode(errors="replace") if ref is not None else ""  # ('': the check computes it)
        self._rec["t"] = time.time()  # (what a verdict's age counts from)
        self.running = CheckProcess(self.cfg, self.node, self.run_id, reference, self._sick(store),
                                    str(self._rec["phase"]), self.ignore_signal)

    @property
    def busy(self) -> bool:
        """A check is running, or waiting for the workers' start."""
        return self.running is not None or self.deferred_until is not None

    def owns(self, pid: int) -> bool:
        return self.running is not None and self.running.pid == pid

    def poll(self, store: Store | None, reaped: bool = False) -> dict[str, Any] | None:
        """Post the running check's verdict if it is done (`reaped`: its process was reaped by the agent); the
        verdict posted, else None."""
        if store is None:
            return None
        self._keeper(store).tick()  # (its records, put back if something else overwrote them)
        if self.deferred_until is not None and (time.monotonic() > self.deferred_until or store.check(self.workers)):
            self._launch(store)
        job = self.running
        if job is None:
            return None
        if reaped:
            job.reaped()
        out = job.poll()
        if out is None:
            return None
        rec = {**out, **self._rec, "duration_s": round(time.time() - self._rec["t"], 3)}
        self._keeper(store).put(keys.health(self.node), json.dumps(rec))
        self.running = None
        verdict = "healthy" if out["ok"] else f"UNHEALTHY: {out['reason']}"
        print(f"phoenixft agent {self.node}: health check ({rec['phase']}): {verdict}", flush=True)
        return rec

    def start_join(self, store: Store) -> None:
        if self.on and self.node.startswith("s"):
            self.start(store, "join", 0, defer_s=JOIN_DEFER_S)

    def answer(self, store: Store) -> None:
        """Check again if the coordinator asked this spare since its last check (one read). A check already
        running answers the ask: it started no earlier than the coordinator last heard from this spare."""
        if not self.on:
            return
        self.poll(store)
        ask = sealed.get_json(store, keys.HEALTH_ASK)
        if not isinstance(ask, dict):
            return
        try:
            seq, nodes = int(ask["seq"]), [str(n) for n in ask["nodes"]]
            rechecks = [str(n) for n in ask.get("recheck", [])]
        except (KeyError, TypeError, ValueError):
            note_bad(keys.HEALTH_ASK, "not a health-check request", json.dumps(ask))
            return
        if seq <= self.answered or self.node not in nodes:
            return
        self.answered = seq
        if self.busy:
            self._rec["ask"] = seq
        else:
            self.start(store, "recheck" if self.node in rechecks else "promotion", seq)

    def stop(self) -> None:
        """The agent leaves: a running check is killed (its verdict is never posted)."""
        self.deferred_until = None
        if self.running is not None:
            self.running.kill()
            self.running = None
