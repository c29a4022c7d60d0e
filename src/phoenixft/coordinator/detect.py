"""Failure detection on the node level, and the recovery's gather.

In steady state (`failure_pending`): exits the launcher reported, heartbeats that stopped changing
(judged on this process's own monotonic clock, never by comparing another host's clock with its
own), and a ready spare while the job is below its size (a grow). During a recovery (`gather`): wait
until every live worker has posted its descriptor of the epoch, and decide on the way which nodes
are dead (reported exits, stale heartbeats with no answer, no answer within `--failure-timeout`:
those nodes are fenced). Idle spares are watched too, so that a dead one is never promoted
(`Membership.gone_spares`).

Its cost per poll does not grow with the number of workers W: it polls one hint that workers set
when they post (`desc_posted/<e>`), plus the launcher's exit hint and the agents' restart hint (hints,
never counters: see `controlplane.sealed`); the descriptors are checked in one call when the hint
moved (and every HB_CHECK_S anyway); heartbeats are read with one `multi_get`; single keys are looked
at only when something happened (an exit, a restart, a stale node), every few seconds anyway (a
stranger freezing a hint delays what it signals, no more) or, after the deadline, to name the nodes that
did not answer. Exits, restarts and descriptors count only sealed with the run key.
"""

from __future__ import annotations

import time

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, multi_get_nowait, sealed
from phoenixft.coordinator.admission import Admission
from phoenixft.coordinator.shared import Job, Membership, hint_moved

__all__ = ["ALL_SILENT_WAIT_S", "HB_CHECK_S", "HB_RECOVER_S", "FailureDetector"]

HB_CHECK_S = 0.25  # heartbeats are read this often in steady state
HB_RECOVER_S = 0.05  # ... and this often while a recovery waits for descriptors
EXITS_EVERY_S = 1.0  # the nodes' exit keys are looked at this often even when the launcher's hint did not move
RESTARTS_EVERY_S = 2.0  # ... the workers' restart keys
ALL_SILENT_WAIT_S = 15.0  # every node (and spare) silent at once: how much longer before they are judged dead


class FailureDetector:
    """Which nodes failed: in steady state (`failure_pending`) and during a recovery (`gather`).
    `gather_poll_s`: how often the gather polls."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership, admission: Admission,
                 gather_poll_s: float) -> None:
        self.job = job
        self.store = job.store
        self.g = job.g
        self.cfg = cfg
        self.state = state
        self.admission = admission
        self.gather_poll_s = gather_poll_s
        self._last_hb_check = 0.0
        self._last_grow_check = 0.0
        self._exits = sealed.Hint(keys.EXITS, EXITS_EVERY_S)
        self.exited_nodes: set[str] = set()  # nodes whose exit the launcher reported (exit keys stay)
        self._exit_checked: set[str] = set()  # nodes whose exit key was looked at since the hint moved
        self._restarts = sealed.Hint(keys.WORKER_EXITS, RESTARTS_EVERY_S)
        self._hb_seen: set[str] = set()  # nodes whose heartbeat key exists (it is never deleted)
        self._hb_last: dict[str, tuple[int, float]] = {}  # node -> (its writer's clock in its beat, when first seen)
        # node -> when its workers last answered a gather: a sign of life like a heartbeat (a starved or stopped
        # agent's node whose workers answered is not judged stale again before another --failure-timeout)
        self._answered: dict[str, float] = {}
        self._read_at: float | None = None  # when this process last read the heartbeats (its monotonic clock)

    def exited(self, nodes: list[str]) -> set[str]:
        """Those of `nodes` whose exit the launcher reported (`exit/<node>`, sealed). A node's exit key is
        looked at once per move of the launcher's `exits` hint (set after the key), and every EXITS_EVERY_S."""
        # the hint is read with `get`, never `add(key, 0)`: an `add` on a value a stranger made a non-number would
        # cut this process's store connection; any change of the value (a garbage one too) only means "look again"
        if hint_moved(self._exits, self.store):
            self._exit_checked.clear()
        elif self._exit_checked.issuperset(nodes):  # nothing moved: O(1) amortised per poll
            return self.exited_nodes.intersection(nodes)
        todo = [n for n in nodes if n not in self._exit_checked and n not in self.exited_nodes]
        if todo:
            there = sealed.present(self.store, [keys.node_exit(n) for n in todo])
            self.exited_nodes |= {n for n, t in zip(todo, there, strict=True) if t}
        self._exit_checked.update(nodes)
        return self.exited_nodes.intersection(nodes)

    def restarts(self, nodes: list[str]) -> set[str]:
        """Those workers of `nodes` that their agent restarted in place (`wexit/<wid>`, sealed, deleted once a
        recovery has dealt with it). Single keys are looked at only when the agents' restart hint moved (and
        every RESTARTS_EVERY_S): a poll that finds it unchanged costs one store call. Then one key per node
        says whether its agent ever restarted a worker (`wexit-node/<node>`, set after the worker's key), and
        only those nodes' workers are looked at: a store without a multi-key existence check (TCPStore)
        answers one key per round trip."""
        if not hint_moved(self._restarts, self.store):
            return set()
        flagged = sealed.present(self.store, [keys.node_restarts(n) for n in nodes])
        wids = [w for node, t in zip(nodes, flagged, strict=True) if t for w in self.job.wids(node)]
        if not wids:
            return set()
        return {w for w, t in zip(wids, sealed.present(self.store, [keys.worker_exit(w) for w in wids]), strict=True)
                if t}

    def stale(self, nodes: list[str], now: float) -> set[str]:
        """Those of `nodes` whose last heartbeat is older than the failure timeout: one `multi_get`
        of the heartbeat keys known to exist (a node not yet seen is looked for on its own). Old means
        unchanged, on this process's monotonic clock, for longer than the failure timeout."""
        new = [n for n in nodes if n not in self._hb_seen]
        if new and self.store.check([keys.heartbeat(n) for n in new]):
            self._hb_seen.update(new)
        elif new:
            self._hb_seen.update(n for n in new if self.store.check([keys.heartbeat(n)]))
        have = [n for n in nodes if n in self._hb_seen]
        if not have:
            return set()
        beats = multi_get_nowait(self.store, [keys.heartbeat(n) for n in have])
        seen = time.monotonic()  # judged on this clock: a heartbeat's value is another host's wall time
        # this process read nothing for a while (it, or the store serving it, was stopped or starved: a
        # `phoenixft run` paused and continued): a value unchanged since says nothing about that time, as
        # the agents' beats could not land either; every node's silence counts from now
        blind = self._read_at is not None and seen - self._read_at > max(1.0, self.cfg.failure_timeout / 2)
        self._read_at = seen
        gone = set()  # the key expired with its agent's lease (silent for --failure-timeout)
        for n, b in zip(have, beats, strict=True):
            if b is None:
                gone.add(n)
                continue
            # a beat is a sealed value whose writer's monotonic clock grew: a forged one, or an older one
            # written back, is no beat (silence goes on counting)
            count, last = sealed.beat_count(keys.heartbeat(n), b), self._hb_last.get(n)
            if last is None or blind or (count is not None and count > last[0]):
                self._hb_last[n] = (max(count if count is not None else -1, last[0] if last else -1), seen)
        return gone | {n for n in have if n not in gone and seen - self._hb_last[n][1] > self.cfg.failure_timeout}

    def failure_pending(self) -> bool:
        assert self.state.topo is not None
        now = time.monotonic()  # (throttles: this process's own clock, which no NTP step moves)
        if len(self.state.topo.nodes) < self.cfg.nodes and now - self._last_grow_check > 0.25:
            self._last_grow_check = now
            self.admission.refresh_pool()
            # (a mesh grows by a whole data-parallel column: one node per pipeline stage)
            if len(self.admission.ready_spares()) >= self.state.topo.pp:
                self.job.event("grow_requested", epoch=self.state.topo.epoch)
                return True  # recover() repartitions over the grown world at this step boundary
        if self.exited(self.state.topo.nodes):
            return True
        now = time.monotonic()
        if now - self._last_hb_check > HB_CHECK_S:
            self._last_hb_check = now
            # idle spares are watched too (one multi_get with the nodes'): a dead one is never promoted
            spares = [s for s in self.state.spare_pool if s not in self.state.dead]
            stale = self.stale(self.state.topo.nodes + spares, now)
            self.state.gone_spares = (stale | self.exited(spares)) & set(spares)
            # a member's workers that answered a gather within the failure timeout are alive: its agent is
            # starved or stopped, and asking them again at every poll would be a recovery every 0.25 s
            ft = self.cfg.failure_timeout
            if {n for n in stale - set(spares) if now - self._answered.get(n, -float("inf")) > ft}:
                return True
        return False

    def gather(self, e: int, nodes: list[str]) -> tuple[set[str], set[str], set[str]]:
        """Wait until every worker of every live node of epoch e has posted its descriptor; decide
        which nodes are dead on the way. Returns (dead, fenced, restarted).

        Dead: reported exits; nodes with a stale heartbeat whose workers have not answered within a
        short grace either (a stale heartbeat alone is not death: a starved agent); and, once the
        failure timeout has passed, every node that still has not answered (fenced). A worker that
        its agent restarts in place gets the full timeout again."""
        dead: set[str] = set()
        fenced: set[str] = set()
        restarted: set[str] = set()
        stale_since: dict[str, float] = {}
        grace = min(1.0, self.cfg.failure_timeout / 2)
        deadline = time.monotonic() + self.cfg.failure_timeout
        # every member and spare silent at once, nobody posting: this host is more likely cut off than all of
        # them dead, and fencing them all would end the run when its link comes back; wait that long more
        # (an agent stops its node after --control-plane-timeout, 15 s by default, without the store)
        silent_until = deadline + ALL_SILENT_WAIT_S
        said = silent = False
        last_hb, checked_live = 0.0, None
        posts = sealed.Hint(keys.desc_posted(e), HB_CHECK_S)  # (set by each worker after its descriptor)
        while True:
            dead |= self.exited(nodes)
            live = [n for n in nodes if n not in dead]
            new = self.restarts(live) - restarted
            if new:
                restarted |= new  # its agent restarts it in place: give it the full timeout again
                deadline = time.monotonic() + self.cfg.failure_timeout
            # complete? looked at on the keys when a worker said it posted, the live nodes changed, or every
            # HB_CHECK_S (a hint says "look", never how many: anyone can write it)
            moved = hint_moved(posts, self.store)
            if (moved or live != checked_live) and self.job.posted(e, live):
                break
            checked_live = live
            posted = self.store.check([keys.desc_posted(e)])
            now = time.monotonic()
            if now - last_hb >= HB_RECOVER_S:
                last_hb = now
                spares = [s for s in self.state.spare_pool if s not in self.state.dead]
                stale = self.stale(live + spares, now)
                all_silent = not dead and bool(live) and stale >= set(live + spares) and not posted
                was, silent = silent, all_silent and time.monotonic() < silent_until
                if was and not all_silent:  # heard from again: reconnecting takes a while, give all the full time
                    deadline = time.monotonic() + self.cfg.failure_timeout
                    grace = self.cfg.failure_timeout
                    stale_since.clear()
                if silent and not said:
                    said = True
                    self.job.event("all_silent", epoch=e, nodes=live, spares=spares,
                                   wait_s=round(silent_until - time.monotonic(), 1))
                for n in stale & set(live) if not silent else ():
                    if not self.job.posted(e, [n]) and now - stale_since.setdefault(n, now) >= grace:
                        dead.add(n)
                        fenced.add(n)
            if silent and time.monotonic() > deadline:
                time.sleep(self.gather_poll_s)
                continue
            if time.monotonic() > deadline:
                unresponsive = {n for n in live if n not in dead and not self.job.posted(e, [n])}
                fenced |= unresponsive  # fence the whole node
                dead |= unresponsive
                break
            time.sleep(self.gather_poll_s)
        now = time.monotonic()
        self._answered.update((n, now) for n in nodes if n not in dead)  # every live node's workers posted
        return dead, fenced, restarted
