"""Stopping the whole job with its state saved: the notice that every node goes at once (a scheduler's time
limit or preemption: Slurm's `--signal=B:USR1@T` to the batch script, which the head takes as one of its
`--stop-signal`s).

A request is one store key (`keys.STOP_REQUEST`, written by `controlplane.drain.request_stop`, in the format of
a drain request, read with `values.parse_drain_request`; one not sealed with the run key is ignored, logged and
removed). The coordinator looks for it before drain requests and carries it out as a drain of every node at once:

1. the step boundary every rank stops at (two steps past rank 0's last completed one, as a drain's) goes into
   the epoch's drain notice with `stop` and `persist` set, then the epoch's failure flag: every rank trains to
   that boundary, stops there, lets the replication of that step finish, stages that step for the persistent
   tier whatever `--persist-every` says (protect/protection.py), and posts its descriptor;
2. once every worker posted (bounded: a few steps' time, and half of the notice left), the drain's end (a rank
   that missed the boundary leaves the step it waits in);
3. once that step's checkpoint is complete (its `MANIFEST.json` in `--persist-dir`, which the head reads like
   every host: bounded by the notice, else `PERSIST_CLOSE_S`), the run ends with state `stopped`. Its workers
   and agents then leave (exit code 0), and the head exits with code 75 ("resume me"): the same flags with
   `--resume DIR` go on from that step with nothing lost.

A request that arrives before the job started ends it at once (nothing trained yet; the checkpoint it resumed
from, if any, is still there); one whose boundary falls after the run's last step is ignored (the run ends by
itself first). A checkpoint that does not complete in time leaves the newest one that did: the report's
`resume_from` names it, and `run_stopped` says `saved: false`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.config.protection import PERSIST_CLOSE_S
from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.signed import env_token, set_signed, sig_key, sign
from phoenixft.controlplane.values import parse_drain_request
from phoenixft.coordinator.shared import Job, Membership, hint_moved

__all__ = ["STOPPED", "StopDesk"]

STOPPED = "stopped"  # the run state of a job stopped with its state saved (the launcher's exit code 75)
STOP_CHECK_S = 0.1  # how often the coordinator looks for a stop request
STOP_WAIT_S = 5.0  # at least this long for every rank to stop at the boundary (more: six of the last step's time)


class StopDesk:
    """Finds the job's stop request and carries it out (see the module docstring)."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership) -> None:
        self.job, self.cfg, self.state = job, cfg, state
        self.store = job.store
        self._last = 0.0

    def requested(self) -> dict[str, Any] | None:
        """The stop request sealed with the run key, if there is one (throttled: None between looks)."""
        now = time.monotonic()
        if now - self._last < STOP_CHECK_S:
            return None
        self._last = now
        if not self.store.check([keys.STOP_REQUEST]):
            return None
        raw = self.store.get_nowait(keys.STOP_REQUEST)
        rec = parse_drain_request(sealed.unseal(keys.STOP_REQUEST, raw), keys.STOP_REQUEST)
        if rec is None:  # (not sealed with the run key, or not a request: logged) never acted on, and removed
            self.store.delete_key(keys.STOP_REQUEST)
            return None
        if rec["t"] is None:
            rec["t"] = time.time()
        return rec

    def before_start(self, req: dict[str, Any]) -> None:
        """A stop asked for before the first epoch: the run ends at once, nothing trained to save."""
        self.job.event("stop_requested", reason=req["reason"], source=req["source"], deadline=req["deadline"],
                       t_notice=req["t"], after_step=None)
        self._end(req, step=None, saved=False, why="the job had not started: nothing trained to save")

    def stop(self, req: dict[str, Any], boundary: int) -> None:
        """Stop every rank after step `boundary`, have that step written to the persistent tier, end the run."""
        topo = self.state.topo
        assert topo is not None
        e = topo.epoch
        self.job.event("stop_requested", reason=req["reason"], source=req["source"], deadline=req["deadline"],
                       t_notice=req["t"], after_step=boundary, epoch=e)
        if boundary > self.cfg.steps:
            self.job.event("stop_ignored", why=f"the run ends at step {self.cfg.steps} before a step boundary could "
                           "stop it")
            self.store.delete_key(keys.STOP_REQUEST)
            return
        self.job.keeper.put(keys.drain_notice(e), json.dumps({
            "node": None, "slot": None, "reason": req["reason"], "source": req["source"], "t_notice": req["t"],
            "deadline": req["deadline"], "after_step": boundary, "stop": True, "persist": True}))
        self.job.keeper.put(keys.failflag(e), "1")
        self.job.keeper.drop(keys.JOB_WHOLE)
        self.store.delete_key(keys.JOB_WHOLE)
        posted = self._await_posted(e, topo.nodes, req)
        self.job.keeper.put(keys.drain_abort(e), "1")  # (whoever is still inside a step of e leaves it now)
        if not posted:
            self._end(req, boundary, saved=False, why="not every worker stopped at the boundary in time (a node "
                      "lost meanwhile cannot write its part of the checkpoint)")
            return
        saved = self._await_checkpoint(boundary, req)
        self._end(req, boundary, saved, "" if saved else f"the checkpoint of step {boundary} did not complete in "
                  "time")

    def _budget(self, base_s: float, req: dict[str, Any]) -> float:
        """`base_s`, but at most half of what is left of the notice."""
        if req["deadline"] is None:
            return base_s
        return min(base_s, max(0.0, (req["deadline"] - time.time()) / 2))

    def _await_posted(self, e: int, nodes: list[str], req: dict[str, Any]) -> bool:
        """Every worker of epoch e stopped at the boundary and posted its descriptor (bounded, see the module)."""
        rec = sealed.get_json(self.store, keys.step(self.job.progress())) or {}
        dt = rec.get("dt")
        end = time.monotonic() + self._budget(max(STOP_WAIT_S, 6 * float(dt) if isinstance(dt, (int, float))
                                                  else 0.0), req)
        posts = sealed.Hint(keys.desc_posted(e), 0.25)  # (each worker sets it after its descriptor: "look")
        while time.monotonic() < end:
            if hint_moved(posts, self.store) and self.job.posted(e, nodes):
                return True
            time.sleep(0.01)
        return self.job.posted(e, nodes)

    def _await_checkpoint(self, step: int, req: dict[str, Any]) -> bool:
        """The persistent checkpoint of `step` is complete (its manifest is in --persist-dir), bounded."""
        from phoenixft.protect.persist import latest_manifest

        manifest = os.path.join(self.cfg.persist_dir, f"step_{step:08d}", "MANIFEST.json")
        end = time.monotonic() + self._budget(PERSIST_CLOSE_S, req)
        while time.monotonic() < end:
            if os.path.exists(manifest):
                man = latest_manifest(self.cfg.persist_dir)
                return man is not None and int(man["step"]) >= step
            time.sleep(0.05)
        return False

    def _end(self, req: dict[str, Any], step: int | None, saved: bool, why: str) -> None:
        """The run's end, `stopped` (signed, and kept: put back if overwritten), with a `run_stopped` event."""
        self.job.event("run_stopped", step=step, saved=saved, checkpoint=self.cfg.persist_dir if saved else None,
                       reason=req["reason"], source=req["source"], notice_to_stopped_s=round(time.time() - req["t"], 3),
                       **({"why": why} if why else {}))
        self.store.delete_key(keys.STOP_REQUEST)
        set_signed(self.store, env_token(), self.job.run_id, keys.RUN_STATE, STOPPED)
        self.job.keeper.keep(sig_key(keys.RUN_STATE), sign(env_token(), self.job.run_id, keys.RUN_STATE,
                                                           STOPPED).encode())
        self.job.keeper.keep(keys.RUN_STATE, STOPPED.encode())
        self.job.final_state = STOPPED
