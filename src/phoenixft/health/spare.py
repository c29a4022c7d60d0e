"""A spare's side of the health gate: its agent checks the host when it joins and again whenever the
coordinator asks (`keys.HEALTH_ASK`, at the start of a recovery that may promote it), and posts each
result at `keys.health(node)`.

The check runs in a process forked from the agent (`run_check`): the device is initialised there, never
in the agent whose workers are forked later, and a check that hangs is killed after its bound
(`check_bound_s`) without the agent missing a heartbeat (its `tick` is called while it waits).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.values import note_bad, parse_int, parse_json
from phoenixft.faults.kinds import Point

__all__ = ["BUILTIN_BOUND_S", "REF_KEY", "check_bound_s", "SpareHealth", "run_check"]

BUILTIN_BOUND_S = 30.0  # the built-in probes take well under a second; this bounds a device that hangs
REF_KEY = "health/ref"  # the reference checksum of the matrix product, published by the coordinator


def check_bound_s(cfg: RunConfig) -> float:
    """The longest a whole check may take: the built-in probes' bound and the command's timeout."""
    return BUILTIN_BOUND_S + (cfg.health_check_timeout if cfg.health_check else 0.0)


def _child(cfg: RunConfig, node: str, run_id: str, reference: str, perturb: bool, phase: str) -> dict[str, Any]:
    import torch

    from phoenixft.dist.device import place
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


def run_check(cfg: RunConfig, node: str, run_id: str, reference: str, perturb: bool,
              tick: Callable[[], None] = lambda: None, phase: str = "join") -> dict[str, Any]:
    """Run the check in a forked process; its result ({ok, reason, times}), a failure if it crashed or
    outlived `check_bound_s`. `tick` is called about every 0.2 s while it runs."""
    from phoenixft.runtime.procs import die_with_parent

    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the check's process
        code = 0
        try:
            os.close(r)
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_DFL)
            die_with_parent(signal.SIGKILL, parent)
            out = _child(cfg, node, run_id, reference, perturb, phase)
        except BaseException as e:  # noqa: BLE001 - the check itself failed: that is its finding
            traceback.print_exc()
            out = {"ok": False, "reason": f"the check failed: {type(e).__name__}: {str(e)[:200]}", "times": {}}
            code = 1
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    bound = check_bound_s(cfg)
    deadline = time.monotonic() + bound
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                return {"ok": False, "reason": f"the health check did not finish within {bound:g}s", "times": {}}
            ready, _, _ = select.select([r], [], [], min(0.2, left))
            tick()
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                buf += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = parse_json(buf, "health check result")
    if not isinstance(out, dict) or not isinstance(out.get("ok"), bool):
        return {"ok": False, "reason": "the health check's process died without a result", "times": {}}
    return out


class SpareHealth:
    """Spare `node`'s checks: `at_join` once admitted, `answer` in every look of its agent."""

    def __init__(self, cfg: RunConfig, node: str, run_id: str, host: str) -> None:
        self.cfg, self.node, self.run_id, self.host = cfg, node, run_id, host
        self.on = cfg.health_gate and node.startswith("s")
        self.answered = 0  # the last ask answered

    def _sick(self, store: Store) -> bool:
        """A `sick:` fault of this spare applies now; recorded as fired the first time."""
        faults = [f for f in self.cfg.faults if f.point is Point.HEALTH]
        if not faults:
            return False
        progress = parse_int(sealed.get(store, keys.PROGRESS), keys.PROGRESS, 0)
        hit = [f for f in faults if f.kind_of.fails_health_check(f, self.node, progress)]
        for f in hit:
            if sealed.claim(store, keys.fault(f.index) + "/fired"):
                rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": f.kind,
                       "node": self.node, "slot": None, "step": progress, "phase": "health"}
                sealed.put(store, keys.fault(f.index), json.dumps(rec))
                sealed.append(store, keys.EVENTS, rec)
        return bool(hit)

    def check(self, store: Store, phase: str, ask: int, tick: Callable[[], None]) -> dict[str, Any]:
        """Run one check now and post its result; the result."""
        ref = sealed.get(store, REF_KEY)
        reference = ref.decode(errors="replace") if ref is not None else ""  # ('': the check computes it)
        t0 = time.time()
        out = run_check(self.cfg, self.node, self.run_id, reference, self._sick(store), tick, phase)
        rec = {**out, "node": self.node, "host": self.host, "phase": phase, "ask": ask, "t": t0,
               "duration_s": round(time.time() - t0, 3)}
        sealed.put(store, keys.health(self.node), json.dumps(rec))
        verdict = "healthy" if out["ok"] else f"UNHEALTHY: {out['reason']}"
        print(f"phoenixft agent {self.node}: health check ({phase}): {verdict}", flush=True)
        return rec

    def at_join(self, store: Store, tick: Callable[[], None] = lambda: None) -> None:
        if self.on:
            self.check(store, "join", 0, tick)

    def answer(self, store: Store, tick: Callable[[], None] = lambda: None) -> None:
        """Check again if the coordinator asked this spare since its last check (one read)."""
        if not self.on:
            return
        ask = sealed.get_json(store, keys.HEALTH_ASK)
        if not isinstance(ask, dict):
            return
        try:
            seq, nodes = int(ask["seq"]), [str(n) for n in ask["nodes"]]
        except (KeyError, TypeError, ValueError):
            note_bad(keys.HEALTH_ASK, "not a health-check request", json.dumps(ask))
            return
        if seq > self.answered and self.node in nodes:
            self.answered = seq
            self.check(store, "promotion", seq, tick)
