"""Admission of joining nodes and the spare pool.

Membership is the coordinator's alone: an agent is a member only once it has answered the admission
challenge with the job token (`phoenixft.controlplane.auth.AdmissionDesk`); `Admission` names its id (`n<i>`
active slots first, then spares `s<k>`), records it in the shared `Membership`, keeps the spare pool
in id order, and says which spares can be promoted now (`ready_spares`) or are on their way
(`spare_coming`). A poll with no join request pending costs one counter read.
"""

from __future__ import annotations

import json
import time
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import auth, keys
from phoenixft.controlplane.values import clean
from phoenixft.coordinator.shared import NODE_ID, Job, Membership, index
from phoenixft.health.gate import HealthGate, host_of_request

__all__ = ["ADMIT_POLL_S", "Admission"]

ADMIT_POLL_S = 0.025  # join requests are looked at this often (one counter read) while training


class Admission:
    """Answers join requests (`admit`) and keeps `state`'s members and spare pool."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership, desk: auth.AdmissionDesk, run_id: str) -> None:
        self.job = job
        self.store = job.store
        self.g = job.g
        self.cfg = cfg
        self.state = state
        self.desk = desk
        self.run_id = run_id
        self._last_admit = 0.0
        self.health = HealthGate(job, cfg, state)  # which spares may be promoted; quarantined hosts

    def load_members(self) -> None:
        for _, req, verdict in self.desk.admitted():  # a restarted coordinator or a new leader: admissions stand
            self._add_member(str(verdict["node"]), req, quiet=True)

    def spare_coming(self, pool: list[str]) -> bool:
        """A spare is on its way: one admitted that is still starting (not ready yet: a fault in the
        run's first steps), or the spare of `--spare-arrives-at-step`, started once the run reached that
        step. It will be ready within its start-up."""
        st = self.state
        if any(s not in pool and s not in st.dead and not self.job.node_ready(s) for s in st.spare_pool):
            return True
        late = self.cfg.spare_arrives_at_step
        if not late or self.job.progress() < late:
            return False
        sid = f"s{self.cfg.spares}"  # the id the launcher starts it with
        return sid not in pool and sid not in st.dead and (st.topo is None or sid not in st.topo.nodes)

    def ready_spares(self, pending: bool = False) -> list[str]:
        """The spares that can be promoted now: admitted, ready, and alive as far as the coordinator
        knows (a spare whose agent died while it waited is not handed a slot: it would answer nothing,
        and the recovery would wait out --failure-timeout to find that out). With `pending` (a recovery,
        which vets them), also those whose first health check is still running."""
        st = self.state
        ready = [s for s in st.spare_pool if s not in st.dead and s not in st.gone_spares and self.job.node_ready(s)]
        return self.health.healthy(ready, pending)  # (whose last health check passed, on a host not quarantined)

    def refresh_pool(self) -> None:
        """Spares admitted since (`phoenixft agent --spare`, or a repaired node) are in the pool already."""
        self.admit()

    def _add_member(self, node: str, req: dict[str, Any], quiet: bool = False) -> None:
        spare = node.startswith("s")
        self.state.members[node] = {"name": str(req.get("name", node)), "host": str(req.get("host", "")),
                                    "hostid": host_of_request(req), "spare": spare, "t": time.time()}
        if spare and node not in self.state.dead and not self.state.in_use(node) and node not in self.state.spare_pool:
            self.state.spare_pool.append(node)
            self.state.spare_pool.sort(key=index)
        if not quiet:
            self.job.keeper.put(keys.MEMBERS, json.dumps(self.state.members, sort_keys=True))

    def _admission(self, req: dict[str, Any]) -> tuple[str | None, str, str]:
        """(node id or None, why not, a note for the agent) for a request whose token checked out."""
        name, spare = str(req.get("name", "")), bool(req.get("spare"))
        if req.get("workers") != self.g:
            return None, (f"--workers={req.get('workers')} does not match this job's --workers-per-node={self.g}"), ""
        if not auth.NAME_RE.match(name):
            return None, f"--node={name!r} is not a valid node name", ""
        quarantined = self.health.refusal(req)
        if quarantined:
            return None, quarantined, ""
        started = self.state.topo is not None
        m = NODE_ID.match(name)
        if m:  # asks for exactly this id
            if name in self.state.members:
                return None, (f"node id {name} is already taken in this job (ids are never reused; pick another "
                              "--node)"), ""
            if m.group(1) == "s":
                return name, "", ""
            if spare:
                return None, f"--node={name} names an active slot; a spare needs another name", ""
            if int(m.group(2)) >= self.cfg.nodes:
                return None, (f"node id {name} is not an active slot of this job (--nodes {self.cfg.nodes}: n0.."
                              f"n{self.cfg.nodes - 1}); join as a spare (--spare)"), ""
            if started:
                return None, f"the job has started: active slot {name} was filled; join as a spare (--spare)", ""
            return name, "", ""
        if not spare and not started:
            free = [f"n{i}" for i in range(self.cfg.nodes) if f"n{i}" not in self.state.members]
            if free:
                return free[0], "", ""
        k = 0
        while f"s{k}" in self.state.members:
            k += 1
        note = "" if spare else ("the job has started" if started else "every active slot is taken") + \
            f": joined as spare s{k}"
        return f"s{k}", "", note

    def admit(self, force: bool = False) -> None:
        """Answer the join requests that arrived (one counter read when none did)."""
        now = time.monotonic()
        if not force and now - self._last_admit < ADMIT_POLL_S:
            return
        self._last_admit = now
        for app in self.desk.poll():
            req = app.request
            who = {"name": clean(str(req.get("name", "?")), 64), "host": clean(str(req.get("host", "?")), 64)}
            if app.proof == "none":
                why = (f"it presented no token (start the agent with this job's token: --token-file or "
                       f"${auth.TOKEN_ENV})")
                node, note = None, ""
            elif app.proof != "ok":
                why = ("wrong token: its answer to the join challenge does not verify with this job's token (an "
                       "agent of another job, or a mistyped token)")
                node, note = None, ""
            else:
                node, why, note = self._admission(req)
            self.desk.answer(app, node, reason=clean(why, 400), note=note)
            if node is None:
                self.job.event("join_refused", reason=why, **who)
                continue
            self._add_member(node, req)
            self.job.event("admitted", node=node, spare=node.startswith("s"), note=note, **who)
