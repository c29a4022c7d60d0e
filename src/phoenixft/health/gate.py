"""The coordinator's side of the health gate and of the quarantine (`HealthGate`).

- Which spares may be promoted (`healthy`): those whose latest check (posted by their agent at
  `keys.health(node)`) passed, and, for a recovery (`pending=True`), those whose first check is still
  running (`keys.health_running(node)`: a spare's join check runs while its workers start). A spare that
  failed one is marked unhealthy (a `spare_unhealthy` event with its reason, once) and counts as a failure
  of its host.
- Before a promotion (`vet`): a spare whose passing verdict is at most `--health-max-age` old is taken at
  once; one whose check is running is waited for (bounded); an older one is asked to check again (`begin`
  asks at the start of the recovery, so that the check runs while the survivors report). The first spares
  whose verdict passed are the pool handed to the planner; one that fails, or does not answer within the
  check's bound, is passed over for the next. Idle spares are asked to check again every
  `--health-recheck-every` seconds (`keep_fresh`, from the coordinator's idle loop), so that a promotion
  finds a fresh verdict and waits for none.
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
        self._rechecks: set[str] = set()  # of `asked`: those asked for a background re-check
        self._seen: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {}  # the last records read

    def publish_reference(self) -> None:
        """The matrix product's reference checksum, for every spare's check (once per job)."""
        if self.on and not sealed.has(self.store, REF_KEY):
            from phoenixft.health.check import reference_checksum

            self.job.keeper.put(REF_KEY, reference_checksum())

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
            self.job.keeper.put(keys.fence(n), str(time.time()))
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
        """A failure of `node`'s host, into the history (quarantining it when it is one too many); one an
        `--inject` fault caused is recorded as such and not counted (unless --quarantine-injected)."""
        host = self.host(node)
        if host:
            record_failure(self.store, host, node, reason, ident, injected=self.injected(node))
            self.quarantined(force=True)

    def injected(self, node: str) -> str | None:
        """The `--inject` fault that struck `node` (its failures are the fault's, not its host's); None if none
        did, or with --quarantine-injected (the quarantine itself under test)."""
        if self.cfg.quarantine_injected or not self.cfg.faults:
            return None
        from phoenixft.faults.struck import struck_by

        return struck_by(self.store, node)

    def note_dead(self, dead: set[str], epoch: int) -> None:
        """The nodes a recovery declared dead: a failure of each one's host."""
        for n in sorted(dead):
            self.failed(n, f"node {n} lost (declared dead in epoch {epoch})", f"dead:{n}")

    # ------------------------------------------------------------------ spares
    def records(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """The latest verdict of each of `nodes` that has one (one store round trip)."""
        return {n: v for n, (v, _) in self.states(nodes).items() if v is not None}

    def states(self, nodes: list[str]) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]]:
        """Each of `nodes`' (latest verdict, the check it started last), either None if it has none (one store
        round trip); remembered for `keep_fresh`."""
        if not nodes:
            return {}
        ks = [k for n in nodes for k in (keys.health(n), keys.health_running(n))]
        there = [k for k, e in zip(ks, self.store.exists_many(ks), strict=True) if e]  # (a TCPStore blocks on
        got = dict(zip(there, self.store.multi_get_nowait(there), strict=True)) if there else {}  # a missing key)
        raw = [got.get(k) for k in ks]
        out: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {}
        for i, n in enumerate(nodes):
            v = parse_json(sealed.unseal(keys.health(n), raw[2 * i]), keys.health(n))
            r = parse_json(sealed.unseal(keys.health_running(n), raw[2 * i + 1]), keys.health_running(n))
            prev = self._seen.get(n, (None, None))  # (a record gone or overwritten since: the last one read stands)
            out[n] = (v if isinstance(v, dict) and isinstance(v.get("ok"), bool) else prev[0],
                      r if isinstance(r, dict) and isinstance(r.get("n"), int) else prev[1])
        self._seen.update(out)
        return out

    @staticmethod
    def _running(state: tuple[dict[str, Any] | None, dict[str, Any] | None]) -> bool:
        """A check started after the latest verdict (or before any) has not posted its verdict yet."""
        v, r = state
        return r is not None and (v is None or not isinstance(v.get("n"), int) or v["n"] < r["n"])

    def _fresh(self, verdict: dict[str, Any] | None) -> bool:
        """A passing verdict of a check started at most --health-max-age ago."""
        if verdict is None or not verdict["ok"]:
            return False
        try:
            return time.time() - float(verdict["t"]) <= self.cfg.health_max_age
        except (KeyError, TypeError, ValueError):
            return False

    def healthy(self, nodes: list[str], pending: bool = False) -> list[str]:
        """Those of `nodes` whose latest check passed (all of them with the gate off), and not on a quarantined
        host; with `pending`, also those whose first check is still running (a promotion waits for it: `vet`).
        A spare found unhealthy is announced once, and counted against its host."""
        q = self.quarantined()
        nodes = [n for n in nodes if self.host(n) not in q]
        if not self.on:
            return nodes
        states = self.states(nodes)
        out = []
        for n in nodes:
            v, r = states[n]
            if v is not None and not v["ok"]:
                self._unhealthy(n, v)
            elif v is not None or (pending and r is not None):
                out.append(n)
        return out

    def _unhealthy(self, node: str, rec: dict[str, Any]) -> None:
        key = f"{node}:{rec.get('t')}"
        if key in self._said:
            return
        self._said.add(key)
        reason = str(rec.get("reason", "?"))[:400]
        self.job.event("spare_unhealthy", node=node, host=self.host(node), phase=rec.get("phase"), reason=reason)
        self.failed(node, f"health check ({rec.get('phase')}) of {node} failed: {reason}", f"health:{key}")

    def keep_fresh(self, idle: list[str]) -> None:
        """Ask the `idle` spares (ready, healthy, not in use) whose verdict is older than --health-recheck-every
        to check again, in the background (by the records `healthy` read last: no store read here). Asks
        answered, and those of spares no longer idle, are settled."""
        for n in [n for n in self.asked if n not in idle or self._answered(n)]:
            self._settled(n)
        every = self.cfg.health_recheck_every
        if not self.on or every <= 0 or not idle:
            return
        now = time.time()
        due = []
        for n in idle:
            state = self._seen.get(n, (None, None))
            if state[0] is None or n in self.asked or self._running(state):
                continue
            try:
                if now - float(state[0]["t"]) >= every:
                    due.append(n)
            except (KeyError, TypeError, ValueError):
                continue
        if due:
            self.ask(due, recheck=True)

    def _answered(self, n: str) -> bool:
        v = self._seen.get(n, (None, None))[0]
        return v is not None and self._answers(v, self.asked.get(n, 0), 0)

    def begin(self, nodes: list[str]) -> None:
        """A recovery starts: ask those of `nodes` (the spares it may promote, just read by `healthy`) whose
        verdict is no longer fresh and who are not checking already to check again now (their checks run while
        the survivors report)."""
        if not self.on or not nodes:
            return
        states = {n: self._seen.get(n, (None, None)) for n in nodes}
        self.ask([n for n in nodes if not self._fresh(states[n][0]) and not self._running(states[n])
                  and n not in self.asked])

    def ask(self, nodes: list[str], recheck: bool = False) -> None:
        """Ask `nodes` to check themselves again (those asked before and not answered yet are named again:
        the ask is one key, and a spare that has not read it yet must still find itself in it); `recheck`:
        a background re-check of idle spares, not a promotion's."""
        if not self.on or not nodes:
            return
        old = sealed.get_json(self.store, keys.HEALTH_ASK)
        seq = int(old.get("seq", 0)) + 1 if isinstance(old, dict) and isinstance(old.get("seq"), int) else 1
        self.asked.update({n: seq for n in nodes})
        if recheck:
            self._rechecks.update(nodes)
        else:
            self._rechecks.difference_update(nodes)
        self.job.keeper.put(keys.HEALTH_ASK, json.dumps({"seq": seq, "nodes": sorted(self.asked),
                                                    "recheck": sorted(self._rechecks & set(self.asked)),
                                                    "t": time.time()}))

    def vet(self, pool: list[str], need: int) -> list[str]:
        """The first `need` spares of `pool` whose verdict passed: a fresh one at once, a running check's or an
        ask's once posted (at most the check's bound and a margin), an older one's after asking it again now;
        all of `pool` when none is needed or the gate is off."""
        if not self.on or need <= 0 or not pool:
            return pool
        states = self.states(pool)
        deadline = time.monotonic() + check_bound_s(self.cfg) + ANSWER_MARGIN_S
        out: list[str] = []
        failed: list[str] = []
        for s in pool:
            if len(out) >= need:
                break
            rec = self._verdict(s, states[s], deadline)
            if rec is None:
                rec = {"ok": False, "phase": "promotion", "t": time.time(), "node": s, "host": self.host(s),
                       "reason": f"no answer to the check before its promotion within "
                                 f"{check_bound_s(self.cfg) + ANSWER_MARGIN_S:g}s"}
                sealed.put(self.store, keys.health(s), json.dumps(rec))
            if rec["ok"]:
                out.append(s)
            else:
                failed.append(s)
                self._unhealthy(s, rec)
        if failed:
            self.job.event("spares_passed_over", promotable=out, unhealthy=failed)
        return out

    def _verdict(self, s: str, state: tuple[dict[str, Any] | None, dict[str, Any] | None],
                 deadline: float) -> dict[str, Any] | None:
        """The verdict spare `s` is promoted or passed over by; None if none came by `deadline`."""
        v, r = state
        running = self._running(state)
        if v is not None and (self._fresh(v) or (not v["ok"] and not running)):
            return v  # (a background re-check running or asked for meanwhile is not waited for)
        if s not in self.asked and not running:
            self.ask([s])
        want_ask = self.asked.get(s, 0)
        want_n = r["n"] if r is not None and running else 0
        while True:
            v = self.records([s]).get(s)
            if v is not None and self._answers(v, want_ask, want_n):
                self._settled(s)
                return v
            if time.monotonic() > deadline:
                self._settled(s)
                return None
            time.sleep(0.01)

    def _settled(self, s: str) -> None:
        self.asked.pop(s, None)
        self._rechecks.discard(s)

    @staticmethod
    def _answers(v: dict[str, Any], want_ask: int, want_n: int) -> bool:
        """Verdict `v` answers the ask `want_ask` (0: none) and comes from check `want_n` or a later one."""
        ask, n = v.get("ask"), v.get("n")
        return ((not want_ask or (isinstance(ask, int) and ask >= want_ask))
                and (not want_n or (isinstance(n, int) and n >= want_n)))
