"""The coordinator's side of the health gate and of the quarantine (`HealthGate`).

- Which spares may be promoted (`healthy`): those whose latest check (posted by their agent at
  `keys.health(node)`) passed. A spare that failed one is marked unhealthy (a `spare_unhealthy` event with
  its reason, once) and counts as a failure of its host.
- Just before a promotion (`vet`): the spares the recovery would promote are asked to check again
  (`ask`, at the start of the recovery, so that the check runs while the survivors report), and the first
  of them whose fresh check passed are the pool handed to the planner; one that fails, or does not answer
  within the check's bound, is passed over for the next.
- Which hosts are quarantined (`quarantined`, `refusal`): by the failure history in the store
  (`health.history`); a node declared dead counts as a failure of its host (`note_dead`).

With `--no-health-gate` every spare counts as healthy and nothing is asked; the quarantine is kept
either way (`--quarantine-after 0` turns it off).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import parse_json
from phoenixft.health.history import HostRecord, quarantined_hosts, record_failure
from phoenixft.health.spare import REF_KEY, check_bound_s

if TYPE_CHECKING:
    from phoenixft.coordinator.shared import Job, Membership

__all__ = ["HealthGate", "ANSWER_MARGIN_S", "host_of_request"]

ANSWER_MARGIN_S = 10.0  # beyond the check's own bound: the spare's agent sees the ask and posts its answer
QUARANTINE_TTL_S = 1.0  # the quarantined hosts are read again at most this often (forced on a join or a recovery)


def host_of_request(req: dict[str, Any]) -> str:
    """The host a join request comes from: its agent's host id (PHOENIXFT_HOST_ID, else HOSTNAME@ADDRESS)."""
    return str(req.get("hostid") or req.get("hostname") or "")[:128]


class HealthGate:
    """Health records, pre-promotion checks and quarantine, over `job`'s store and `state`'s members."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership) -> None:
        self.job, self.store, self.cfg, self.state = job, job.store, cfg, state
        self.on = cfg.health_gate
        self._said: set[str] = set()  # health failures already announced (node:t)
        self._quarantined: dict[str, HostRecord] = {}
        self._q_read = 0.0
        # (hosts quarantined before this process started, e.g. before a coordinator restart: said already)
        self._q_said: set[str] = set(quarantined_hosts(self.store, cfg.quarantine_after, cfg.quarantine_window))
        self.asked: dict[str, int] = {}  # spare -> the ask its next answer must carry

    def publish_reference(self) -> None:
        """The matrix product's reference checksum, for every spare's check (once per job)."""
        if self.on and not sealed.has(self.store, REF_KEY):
            from phoenixft.health.check import reference_checksum

            sealed.put(self.store, REF_KEY, reference_checksum())

    # ------------------------------------------------------------------ hosts
    def host(self, node: str) -> str:
        m = self.state.members.get(node, {})
        return str(m.get("hostid") or "")

    def quarantined(self, force: bool = False) -> dict[str, HostRecord]:
        """The quarantined hosts (re-read at most every QUARANTINE_TTL_S unless `force`)."""
        if force or time.monotonic() - self._q_read > QUARANTINE_TTL_S:
            self._q_read = time.monotonic()
            self._quarantined = quarantined_hosts(self.store, self.cfg.quarantine_after, self.cfg.quarantine_window)
            for h, r in self._quarantined.items():
                if h not in self._q_said:
                    self._q_said.add(h)
                    self.job.event("host_quarantined", host=h, reason=r.reason, failures=r.failures)
                self._dismiss(h)
        return self._quarantined

    def _dismiss(self, host: str) -> None:
        """The idle spares of quarantined `host` leave the pool, fenced (their agents stop; the nodes the job
        runs on are left alone: moving them off is a drain's business)."""
        st = self.state
        for n in [s for s in st.spare_pool if self.host(s) == host and not st.in_use(s)]:
            st.spare_pool.remove(n)
            st.dead.add(n)
            sealed.put(self.store, keys.fence(n), str(time.time()))
            self.job.event("spare_dismissed", node=n, host=host, reason="its host is quarantined")

    def refusal(self, req: dict[str, Any]) -> str:
        """Why a join request is refused because its host is quarantined ('' if it is not)."""
        host = host_of_request(req)
        rec = self.quarantined(force=True).get(host) if host else None
        if rec is None:
            return ""
        last = (rec.failures[-1]["reason"] if rec.failures else rec.reason)[:160]
        return (f"host {host} is quarantined ({rec.reason}; {len(rec.failures)} failure(s), the last: {last}): it is "
                "not admitted to this job again")

    def failed(self, node: str, reason: str, ident: str) -> None:
        """A failure of `node`'s host, into the history (quarantining it when it is one too many)."""
        host = self.host(node)
        if host:
            record_failure(self.store, host, node, reason, ident)
            self.quarantined(force=True)

    def note_dead(self, dead: set[str], epoch: int) -> None:
        """The nodes a recovery declared dead: a failure of each one's host."""
        for n in sorted(dead):
            self.failed(n, f"node {n} lost (declared dead in epoch {epoch})", f"dead:{n}")

    # ------------------------------------------------------------------ spares
    def records(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """The latest health record of each of `nodes` that has one (one store round trip)."""
        if not nodes:
            return {}
        raw = self.store.multi_get_nowait([keys.health(n) for n in nodes])
        out = {}
        for n, r in zip(nodes, raw, strict=True):
            rec = parse_json(sealed.unseal(keys.health(n), r), keys.health(n))
            if isinstance(rec, dict) and isinstance(rec.get("ok"), bool):
                out[n] = rec
        return out

    def healthy(self, nodes: list[str]) -> list[str]:
        """Those of `nodes` whose latest check passed (all of them with the gate off), and not on a
        quarantined host; a spare found unhealthy is announced once, and counted against its host."""
        q = self.quarantined()
        nodes = [n for n in nodes if self.host(n) not in q]
        if not self.on:
            return nodes
        recs = self.records(nodes)
        for n, rec in recs.items():
            if not rec["ok"]:
                self._unhealthy(n, rec)
        return [n for n in nodes if n in recs and recs[n]["ok"]]

    def _unhealthy(self, node: str, rec: dict[str, Any]) -> None:
        key = f"{node}:{rec.get('t')}"
        if key in self._said:
            return
        self._said.add(key)
        reason = str(rec.get("reason", "?"))[:400]
        self.job.event("spare_unhealthy", node=node, host=self.host(node), phase=rec.get("phase"), reason=reason)
        self.failed(node, f"health check ({rec.get('phase')}) of {node} failed: {reason}", f"health:{key}")

    def begin(self, nodes: list[str]) -> None:
        """A recovery starts: ask `nodes` (the ready spares) to check themselves again, now."""
        self.asked = {}
        self.ask(nodes)

    def ask(self, nodes: list[str]) -> None:
        """Ask `nodes` to check themselves again (those asked before and not answered yet are named again:
        the ask is one key, and a spare that has not read it yet must still find itself in it)."""
        if not self.on or not nodes:
            return
        old = sealed.get_json(self.store, keys.HEALTH_ASK)
        seq = int(old.get("seq", 0)) + 1 if isinstance(old, dict) and isinstance(old.get("seq"), int) else 1
        self.asked.update({n: seq for n in nodes})
        sealed.put(self.store, keys.HEALTH_ASK, json.dumps({"seq": seq, "nodes": sorted(self.asked), "t": time.time()}))

    def vet(self, pool: list[str], need: int) -> list[str]:
        """The first `need` spares of `pool` whose check just before this promotion passed (asked at the
        recovery's start, or now); all of `pool` when none is needed or the gate is off."""
        if not self.on or need <= 0 or not pool:
            return pool
        unasked = [s for s in pool if s not in self.asked]
        self.ask(unasked)
        deadline = time.monotonic() + check_bound_s(self.cfg) + ANSWER_MARGIN_S
        out: list[str] = []
        failed: list[str] = []
        for s in pool:
            if len(out) >= need:
                break
            rec = self._answer(s, deadline)
            if rec is None:
                rec = {"ok": False, "phase": "promotion", "t": time.time(), "node": s, "host": self.host(s),
                       "reason": f"no answer to the check before its promotion within "
                                 f"{check_bound_s(self.cfg) + ANSWER_MARGIN_S:g}s"}
                sealed.put(self.store, keys.health(s), json.dumps(rec))
            self.asked.pop(s, None)
            if rec["ok"]:
                out.append(s)
            else:
                failed.append(s)
                self._unhealthy(s, rec)
        if failed:
            self.job.event("spares_passed_over", promotable=out, unhealthy=failed)
        return out

    def _answer(self, spare: str, deadline: float) -> dict[str, Any] | None:
        """Spare's record answering its latest ask, once posted; None past `deadline`."""
        want = self.asked.get(spare, 0)
        while True:
            rec = self.records([spare]).get(spare)
            if rec is not None and isinstance(rec.get("ask"), int) and rec["ask"] >= want:
                return rec
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
