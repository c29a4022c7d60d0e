"""The job token: HMAC challenge-response admission of agents, and signed topologies.

torch's `TCPStore` has no authentication: whoever reaches its port reads and writes every key. So
the token itself, or anything it follows from, never goes into the store; only nonces and HMACs
(SHA-256) keyed with it do.

Admission (`request_admission` in the agent, `AdmissionDesk` in the coordinator), over the store:

    agent        seq = add(admit/seq, 1); set admit/<seq>/req = {name, spare, workers, host, ..., nonce}
    coordinator  set admit/<seq>/challenge = {nonce: 32 random bytes (hex), run_id}: its own, fresh
    agent        set admit/<seq>/resp = {nonce, mac: HMAC(token, "join", run_id, seq, nonce, req)}
                 ("" without a token), for every challenge it finds there
    coordinator  takes the response to its own nonce only, verifies it (constant time), decides, and sets
                 admit/<seq>/verdict = {ok, node | reason, note, run_id, nonce,
                                        mac = HMAC(token, "verdict", run_id, seq, nonce, sha256(req), verdict)}
                 then admit/done = {the request numbers it answered, HMAC(token, run_id, them)}

Every MAC binds the run id and the request's number, and the request carries a nonce of the agent's,
so a response or verdict seen in the store can be replayed for no other request, challenge or run.
The coordinator never reuses a challenge it finds in the store (someone else may have written it, to
replay a response it saw): a response to any other nonce than its own is ignored, and an agent
answers again when the challenge changes. The agent acts only on a verdict whose MAC binds its
request and a challenge it answered, refusals included, so a planted challenge or verdict can delay
or fail a join, never admit anyone: a refusal is shown (control characters stripped) once it
verifies, and an answer that does not verify is reported as such after UNVERIFIED_GRACE_S (the
coordinator's own answer replaces a planted one). The signed record of answered requests keeps a
restarted coordinator from answering one again (a request whose verdict was deleted would otherwise
be challenged afresh, and refused for want of a new response). The verdicts let a restarted
coordinator rebuild the membership from the store without trusting it. Every wait is bounded.

The config: the launcher writes `config/sig` = the config's signature with the run key
(`signed.sign(token, run id, "config", config JSON)`) with `config`. Every process checks it before it
uses the config; a coordinator that joins a running job (`phoenixft coordinator --standby`) checks its
token on it (`token_matches_job`) before it stands by: one with another token would sign topologies
that no worker accepts.

Topologies: the coordinator writes `topo/<e>/sig` = HMAC(token, "topology", e, topology JSON)
before `topo/<e>`; workers (`verified_topology`) act only on a topology whose signature verifies
with the token their agent put in their environment (`PHOENIXFT_TOKEN`).

What this does not do: it keeps strangers and other jobs' agents out of the membership, it does not
make the store private. A party that can reach the store can still disturb the job (overwrite or
delete keys, forge heartbeats): serve it through TLS (`controlplane/tls.py`) or on a private network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from phoenixft.controlplane import keys, signed
from phoenixft.controlplane.keeper import Keeper
from phoenixft.controlplane.signed import mac, read_topology, sign_topology
from phoenixft.controlplane.signed import same as _same
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.tokens import (
    MIN_TOKEN_BITS,
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    check_token,
    generate_token,
    read_token_file,
    resolve_token,
    token_bits,
    token_source,
    write_token_file,
)
from phoenixft.controlplane.values import (
    clean,
    note_bad,
    parse_int,
    parse_json,
    read_int,
    read_json,
    read_raw,
    read_text,
)
from phoenixft.errors import RunAborted, UserError

__all__ = ["TOKEN_ENV", "MIN_TOKEN_CHARS", "MIN_TOKEN_BITS", "resolve_token", "token_source", "read_token_file",
           "write_token_file", "generate_token", "token_bits", "check_token", "mac",
           "sign_topology", "verified_topology", "read_topology", "token_matches_job", "request_admission",
           "Application", "AdmissionDesk", "NAME_RE"]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_PENDING_TTL_S = 300.0  # a request whose agent went away is forgotten after this long


# ---------------------------------------------------------------------------------------- topologies
def verified_topology(store: Store, epoch: int, raw: bytes, timeout_s: float = 30.0) -> Any:
    """The `Topology` of `raw` (just read from `topo/<epoch>`) once its signature verifies with the
    job token; a wrong one (or none: deleted) is re-read every 50 ms (the coordinator puts back what it
    published, and overwrites a forgery when it publishes) until `timeout_s`, then RunAborted: a worker
    never acts on an unsigned plan."""
    from phoenixft.distributed.topology import Topology

    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise RunAborted(f"no job token in this worker's environment ({TOKEN_ENV}): it cannot verify the "
                         f"coordinator's plans, so it acts on none")
    deadline = time.monotonic() + timeout_s
    while True:
        sig = store.get(keys.topo_sig(epoch)) if store.check([keys.topo_sig(epoch)]) else b""
        if sig and _same(sig, sign_topology(token, epoch, raw)):
            topo = Topology.parse(raw, keys.topo(epoch))
            if topo is not None:
                return topo
        if time.monotonic() > deadline:
            raise RunAborted(f"the topology of epoch {epoch} in the store is not signed with this job's token: "
                             "refusing to act on it (something other than the coordinator wrote it)")
        time.sleep(0.05)
        raw = store.get_nowait(keys.topo(epoch)) or b""


def token_matches_job(store: Store, token: str, run_id: str | None = None) -> bool | None:
    """Whether `token` is the token of the job in `store`: its config's signature verifies with the run
    key of `token` and `run_id` (None: the run id in the store). None if the store holds no signed config."""
    from phoenixft.controlplane.signed import sign

    if not store.check([keys.CONFIG_SIG, keys.CONFIG]):
        return None
    if run_id is None:
        run_id = bytes(store.get(keys.RUN_ID)).decode(errors="replace") if store.check([keys.RUN_ID]) else ""
    return _same(bytes(store.get(keys.CONFIG_SIG)), sign(token, run_id, keys.CONFIG, bytes(store.get(keys.CONFIG))))


# ---------------------------------------------------------------------------------------- admission
UNVERIFIED_GRACE_S = 2.0  # an agent that read an answer it cannot verify waits this long for a signed one
WRONG_GRACE_S = 2.5  # a response that does not verify is refused once its request stayed unchanged this long
FULL_LOOK_S = 1.0  # the desk looks at its open requests this often even if no agent bumped the counter
MAX_OPEN = 256  # join requests the desk keeps open at most (a counter bumped by a stranger opens no more)
SCAN_LIMIT = 1024  # request numbers a restarted coordinator looks at beyond its signed record


def _digest(raw: str | bytes) -> str:
    return hashlib.sha256(raw if isinstance(raw, bytes) else raw.encode()).hexdigest()


def _response_mac(token: str, run_id: str, seq: int, nonce: str, raw_req: str) -> str:
    return mac(token, "join", run_id, seq, nonce, raw_req)


def _verdict_mac(token: str, run_id: str, seq: int, nonce: str, raw_req: str, body: dict[str, Any]) -> str:
    return mac(token, "verdict", run_id, seq, nonce, _digest(raw_req), json.dumps(body, sort_keys=True))


def _challenge(raw: bytes, key: str) -> tuple[str, str] | None:
    """(nonce, run id) of a challenge as the coordinator writes it; None (logged) if it is not one."""
    c = parse_json(raw, key)
    if c is None or not isinstance(c.get("nonce"), str) or not isinstance(c.get("run_id"), str) \
            or not 16 <= len(c["nonce"]) <= 128:
        if c is not None:
            note_bad(key, "not a join challenge", raw)
        return None
    return c["nonce"], c["run_id"]


def _verdict(raw: bytes, token: str | None, seq: int, raw_req: str, answered: dict[str, str]) -> dict[str, Any] | None:
    """The verdict's body if its MAC verifies with `token` for this request and a challenge this agent
    answered (`answered`: nonce -> run id); None otherwise."""
    v = parse_json(raw, keys.admit_verdict(seq))
    if not token or v is None:
        return None
    body = {k: x for k, x in v.items() if k != "mac"}
    nonce, run_id = body.get("nonce"), body.get("run_id")
    if not isinstance(nonce, str) or answered.get(nonce) != run_id or not isinstance(run_id, str):
        return None
    return body if _same(str(v.get("mac", "")), _verdict_mac(token, run_id, seq, nonce, raw_req, body)) else None


def _run_over(store: Store, token: str | None, run_ids: list[str]) -> str | None:
    """The run's final state if one is in the store, signed with the run key of the run the store names
    or of a challenge this agent answered (unsigned, printable, when this agent has no token to check it)."""
    if not store.check([keys.RUN_STATE]):
        return None
    if not token:
        return clean(store.get(keys.RUN_STATE), 40)
    for rid in dict.fromkeys([read_text(store, keys.RUN_ID), *run_ids]):
        state = signed.run_ended(store, rid, token)
        if state is not None:
            return state
    return None


SEQ_TRIES = 10_000  # request numbers an agent tries past the counter before it gives up (all taken: forged)
BUMP_TRIES = 100  # compare_set rounds of one counter update (each lost to a concurrent writer)
SEQ_REPAIR_WAIT_S = 10.0  # how long an agent waits for the coordinator to repair a request counter made garbage


def _bump(store: Store, key: str, at_least: int | None = None) -> None:
    """Counter `key` up by one, or (`at_least`) up to at least that, by compare_set: never an `add`, which a
    value someone else made a non-number would answer by cutting the connection. A non-number is replaced.
    Losing a round to a concurrent writer reads the counter again."""
    for _ in range(BUMP_TRIES):
        raw = read_raw(store, key)
        cur = b"" if raw is None else raw
        v = parse_int(raw, key, -1) if raw is not None else 0
        if at_least is not None and v >= at_least:
            return
        want = str(at_least if at_least is not None else max(v, 0) + 1).encode()
        if bytes(store.compare_set(key, cur, want)) == want:
            return


def _counter_now(store: Store, timeout_s: float = SEQ_REPAIR_WAIT_S) -> int:
    """The request counter (0 if absent). One someone made a non-number: the coordinator puts a number back
    when it next looks (which `admit/posted` moving makes it do), waited for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    nudged = False
    while True:
        raw = read_raw(store, keys.ADMIT_SEQ)
        v = 0 if raw is None else parse_int(raw, keys.ADMIT_SEQ, -1)
        if v >= 0:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"the request counter {keys.ADMIT_SEQ} is not a number, and no coordinator "
                               f"put one back within {timeout_s:g}s")
        if not nudged:
            _bump(store, keys.ADMIT_POSTED)
            nudged = True
        time.sleep(0.05)


def _post_request(store: Store, raw_req: str, name: str, where: str) -> int:
    """Post the join request under the first free number past the counter (claimed by compare_set on the
    request's own key: the request is unique, so the claim is unambiguous), raise the counter to it, then
    signal the coordinator (`admit/posted`)."""
    try:
        seq = _counter_now(store) + 1
        mine = raw_req.encode()
        for _ in range(SEQ_TRIES):
            if bytes(store.compare_set(keys.admit_req(seq), b"", mine)) == mine:
                break
            seq += 1
        else:
            raise RuntimeError(f"no free request number in {SEQ_TRIES} past the counter")
        _bump(store, keys.ADMIT_SEQ, at_least=seq)
        _bump(store, keys.ADMIT_POSTED)
    except Exception as e:  # noqa: BLE001 - the store went away, or the numbers were all taken
        why = clean(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)
        raise UserError(f"the store at {where} did not take the join request of {name!r} ({why}): is it this "
                        "job's, and reachable?") from None
    return seq


def request_admission(store: Store, request: dict[str, Any], token: str | None, timeout_s: float,
                      where: str) -> dict[str, Any]:
    """Ask the coordinator behind `store` to admit this agent; return its verdict ({node, run_id, note}).

    It answers every challenge it finds for its request (the coordinator writes a fresh one; one written
    by someone else only draws an answer the coordinator ignores) and acts only on a verdict whose MAC
    binds its request, a challenge it answered and that challenge's run id. UserError (one line) if it
    is refused (the reason printable only), if an answer to one of its responses is not signed with our
    token (after UNVERIFIED_GRACE_S), or if no answer comes within `timeout_s`. What it wrote (its request,
    its responses) it puts back if something else overwrites it, and a value that answers none of its
    responses (planted, or junk) is waited past."""
    raw_req = json.dumps({**request, "nonce": secrets.token_hex(16)}, sort_keys=True)  # (no two requests alike)
    name, host = request["name"], request.get("host") or "?"
    seq = _post_request(store, raw_req, name, where)
    kept = Keeper(store)  # the request and our responses, put back if something else overwrites them
    kept.keep(keys.admit_req(seq), raw_req.encode())
    deadline = time.monotonic() + timeout_s
    wait = _Waiting(name, host, where, token)
    polls = 0
    while True:
        try:
            raw_c = read_raw(store, keys.admit_challenge(seq))
            c = _challenge(raw_c, keys.admit_challenge(seq)) if raw_c is not None else None
            if c is not None and c[0] not in wait.answered:
                wait.answered[c[0]] = c[1]
                resp = _response_mac(token, c[1], seq, c[0], raw_req) if token else ""
                kept.put_raw(keys.admit_resp(seq), json.dumps({"nonce": c[0], "mac": resp}).encode())
                _bump(store, keys.ADMIT_POSTED)
            if kept.tick() or (not wait.answered and polls % 50 == 49):
                # (put back, or no challenge yet: the counter raised to our number again, in case something else
                # reset it meanwhile, and the coordinator nudged to look)
                _bump(store, keys.ADMIT_SEQ, at_least=seq)
                _bump(store, keys.ADMIT_POSTED)
            raw_v = read_raw(store, keys.admit_verdict(seq))
            if raw_v is not None:
                body = _verdict(raw_v, token, seq, raw_req, wait.answered)
                if body is not None:
                    return _verdict_result(body, name, host, where)
                wait.unsigned(raw_v, seq)
            if polls % 10 == 0:
                state = _run_over(store, token, list(wait.answered.values()))
                if state is not None:
                    raise UserError(f"the run at {where} ended ({state}) before {name!r} was admitted")
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - a call that failed or timed out: retry until the deadline
            pass
        if time.monotonic() > deadline:
            raise UserError(wait.late(timeout_s))
        polls += 1
        time.sleep(0.02)


@dataclass
class _Waiting:
    """An agent waiting for its verdict: the challenges it answered, the answers it could not verify."""

    name: str
    host: str
    where: str
    token: str | None
    answered: dict[str, str] = field(default_factory=dict)  # nonce -> run id of every challenge answered
    unverified: tuple[float, bool] | None = None  # when an answer to our response we cannot verify came; it said ok
    planted: bool = False  # a value there answered none of our responses

    def unsigned(self, raw_v: bytes, seq: int) -> None:
        """A verdict that does not verify: UserError once one that answers our response stays so for
        UNVERIFIED_GRACE_S (a wrong token, or a rogue coordinator); any other (planted, junk) is waited past."""
        v = parse_json(raw_v, keys.admit_verdict(seq))
        if v is None or v.get("nonce") not in self.answered:
            self.planted = True
            return
        if not self.token:
            raise UserError(f"the coordinator at {self.where} refused to admit {self.name!r} (from {self.host}): it "
                            f"presented no token (start the agent with this job's token: --token-file or "
                            f"${TOKEN_ENV})")
        self.unverified = self.unverified or (time.monotonic(), bool(v.get("ok")))
        if time.monotonic() - self.unverified[0] > UNVERIFIED_GRACE_S:
            raise UserError(_unverified_message(self.unverified[1], self.name, self.host, self.where))

    def late(self, timeout_s: float) -> str:
        head = f"the coordinator at {self.where} did not answer the join request of {self.name!r} within {timeout_s:g}s"
        if self.planted:
            return (head + ": the only answer there is not signed with this agent's token (a wrong token, or an "
                    "answer written by someone other than the job's coordinator)")
        return head + " (see --join-timeout; is a phoenixft coordinator serving that address?)"


def _unverified_message(said_ok: bool, name: str, host: str, where: str) -> str:
    if said_ok:
        return (f"the answer to the join request of {name!r} at {where} is not signed with this agent's token: not "
                "this job's coordinator (or a wrong token)")
    return (f"the coordinator at {where} refused to admit {name!r} (from {host}) with an answer not signed with this "
            "agent's token: a wrong token (not this job's), or an answer written by someone other than the job's "
            "coordinator")


def _verdict_result(body: dict[str, Any], name: str, host: str, where: str) -> dict[str, Any]:
    """A verified verdict: its {node, run_id, note} if it admits us; UserError with its reason if it refuses."""
    if not body.get("ok"):
        raise UserError(f"the coordinator at {where} refused to admit {name!r} (from {host}): "
                        f"{clean(str(body.get('reason') or 'no reason given'), 400)}")
    return {"node": clean(str(body.get("node", "")), 64), "run_id": clean(str(body["run_id"]), 64),
            "note": clean(str(body.get("note", "")), 200)}


@dataclass
class Application:
    """A join request whose response has arrived, verified (`proof` is "ok", "none" or "wrong")."""

    seq: int
    request: dict[str, Any]
    proof: str
    challenge: str  # the nonce the coordinator issued for it
    raw_req: str = ""


@dataclass
class _Pending:
    t: float
    nonce: str = ""
    raw_req: str = ""
    wrong_at: float = 0.0  # when a response to our challenge first did not verify (0: none yet)


def _ranges(seqs: set[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in sorted(seqs):
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


@dataclass
class AdmissionDesk:
    """The coordinator's side of admission: issues challenges, checks responses, signs verdicts.

    Every challenge is its own, fresh (one found in the store is never reused: its response could be a
    replay); every MAC binds the run id; the requests it answered are recorded (`keys.ADMIT_DONE`,
    signed), so a restarted coordinator answers none of them again, even one whose verdict was deleted.
    `poll()` does nothing but read one counter unless an agent wrote something since the last call (or
    FULL_LOOK_S passed with requests open). The coordinator decides who is admitted (`answer`)."""

    store: Store
    token: str
    run_id: str = ""  # (default: the store's run id, as the coordinator reads it)
    _posted_seen: int = -1
    _next_seq: int = 1
    _last_look: float = 0.0
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    keeper: Keeper | None = None  # where given, the challenges, verdicts and the record are put back if overwritten

    def _set(self, name: str, value: str) -> None:
        if self.keeper is not None:
            self.keeper.put_raw(name, value.encode())
        else:
            self.store.set(name, value)

    def __post_init__(self) -> None:
        if not self.run_id:
            self.run_id = read_text(self.store, keys.RUN_ID)
        self._done = self._load_done()

    # -------------------------------------------------------------- the record of answered requests
    def _done_mac(self, ranges: list[list[int]]) -> str:
        return mac(self.token, "admitted-requests", self.run_id, json.dumps(ranges))

    def _load_done(self) -> set[int]:
        rec = read_json(self.store, keys.ADMIT_DONE)
        if rec is None:
            return set()
        ranges = rec.get("ranges")
        ok = isinstance(ranges, list) and all(isinstance(r, list) and len(r) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in r) and 0 < r[0] <= r[1] for r in ranges)
        if not ok or sum(r[1] - r[0] + 1 for r in ranges) > 10 * SCAN_LIMIT \
                or not _same(str(rec.get("mac", "")), self._done_mac(ranges)):
            note_bad(keys.ADMIT_DONE, "not signed with this run's key", json.dumps(rec))
            return set()
        return {s for a, b in ranges for s in range(a, b + 1)}

    def _mark_done(self, seq: int) -> None:
        self._done.add(seq)
        ranges = _ranges(self._done)
        self._set(keys.ADMIT_DONE, json.dumps({"ranges": ranges, "mac": self._done_mac(ranges)}))

    # -------------------------------------------------------------- counters
    def _counter(self, key: str, repair: int) -> int | None:
        """A counter agents `add` to; one someone made a non-number is set to `repair` (an agent's `add` on it
        would lose its connection). None if absent."""
        raw = read_raw(self.store, key)
        if raw is None:
            return None
        v = parse_int(raw, key, -1)
        if v < 0:
            self.store.set(key, str(repair))
            return repair
        return v

    def poll(self, force: bool = False) -> list[Application]:
        now = time.monotonic()
        posted = self._counter(keys.ADMIT_POSTED, max(self._posted_seen, 0) + 1) or 0
        if posted == self._posted_seen and not force and not (self._pending and now - self._last_look > FULL_LOOK_S):
            return []
        self._posted_seen, self._last_look = posted, now
        top = self._counter(keys.ADMIT_SEQ, max(self._next_seq - 1, 0)) or 0  # (a repair opens no numbers)
        for seq in range(max(self._next_seq, top - MAX_OPEN + 1), top + 1):
            if seq not in self._done:
                self._pending[seq] = _Pending(t=now)
        self._next_seq = max(self._next_seq, top + 1)
        for seq in sorted(self._pending)[:-MAX_OPEN]:  # the oldest beyond MAX_OPEN: forgotten
            del self._pending[seq]
        out: list[Application] = []
        for seq, p in list(self._pending.items()):
            app = self._look(seq, p, now)
            if app is not None:
                out.append(app)
        return out

    def _look(self, seq: int, p: _Pending, now: float) -> Application | None:
        """Challenge request `seq` (fresh), or take its response to our challenge; None while there is none."""
        expired = now - p.t > _PENDING_TTL_S
        if not p.nonce:
            raw_req = read_raw(self.store, keys.admit_req(seq))
            if raw_req is None:
                if expired:
                    del self._pending[seq]
                return None
            p.raw_req = raw_req.decode(errors="replace")
            raw_v = read_raw(self.store, keys.admit_verdict(seq))
            if raw_v is not None and self._signed_verdict(seq, p.raw_req, raw_v) is not None:
                self._mark_done(seq)  # answered by a coordinator of this run before a restart (and not recorded)
                del self._pending[seq]
                return None
            p.nonce = secrets.token_hex(32)  # ours, fresh: never one found in the store
            self._set(keys.admit_challenge(seq), json.dumps({"nonce": p.nonce, "run_id": self.run_id}))
            return None
        raw_resp = read_raw(self.store, keys.admit_resp(seq))
        resp = parse_json(raw_resp, keys.admit_resp(seq)) if raw_resp is not None else None
        if resp is None or not _same(str(resp.get("nonce", "")), p.nonce):  # none yet, or one to another challenge
            if expired:
                del self._pending[seq]
            return None
        answer = str(resp.get("mac", ""))
        proof = "none" if not answer else "wrong"
        # the response binds the request as its agent wrote it: the one read when it was challenged, or (one
        # that something else overwrote meanwhile, which its agent puts back) the one there now
        now_raw = read_raw(self.store, keys.admit_req(seq))
        for raw in dict.fromkeys([p.raw_req, now_raw.decode(errors="replace") if now_raw is not None else ""]):
            if answer and raw and _same(answer, _response_mac(self.token, self.run_id, seq, p.nonce, raw)):
                proof, p.raw_req = "ok", raw
                break
        if proof == "wrong" and now_raw is not None and now_raw.decode(errors="replace") != p.raw_req \
                and not expired:
            p.raw_req = now_raw.decode(errors="replace")  # (changed since: looked at again, its agent answers again)
            p.nonce, p.wrong_at = "", 0.0
            return None
        if proof == "wrong" and not expired and now - (p.wrong_at or now) < WRONG_GRACE_S:
            p.wrong_at = p.wrong_at or now  # (a request overwritten as it was challenged: its agent puts it back)
            return None
        del self._pending[seq]
        req = parse_json(p.raw_req, keys.admit_req(seq)) or {"name": "?", "unreadable": True}
        return Application(seq=seq, request=req, proof=proof, challenge=p.nonce, raw_req=p.raw_req)

    def answer(self, app: Application, node: str | None, reason: str = "", note: str = "") -> None:
        """Admit `app` as `node`, or refuse it with `reason` (node None): a verdict signed either way, then the
        request recorded as answered."""
        body: dict[str, Any] = {"ok": node is not None, "run_id": self.run_id, "nonce": app.challenge,
                                **({"node": node, "note": note} if node is not None else {"reason": reason})}
        sig = _verdict_mac(self.token, self.run_id, app.seq, app.challenge, app.raw_req, body)
        self._set(keys.admit_verdict(app.seq), json.dumps({**body, "mac": sig}))
        self._mark_done(app.seq)

    def _signed_verdict(self, seq: int, raw_req: str, raw_v: bytes) -> dict[str, Any] | None:
        v = parse_json(raw_v, keys.admit_verdict(seq))
        if v is None:
            return None
        body = {k: x for k, x in v.items() if k != "mac"}
        if body.get("run_id") != self.run_id or not isinstance(body.get("nonce"), str):
            return None
        want = _verdict_mac(self.token, self.run_id, seq, body["nonce"], raw_req, body)
        return body if _same(str(v.get("mac", "")), want) else None

    def admitted(self) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
        """(seq, request, verdict) of every admission in the store whose verdict verifies with this run's key,
        in order: what a restarted coordinator (or a new leader) rebuilds its membership from. It looks at the
        requests its signed record names, and at the first and the last SCAN_LIMIT numbers."""
        self._done |= self._load_done()
        top = max(0, read_int(self.store, keys.ADMIT_SEQ))
        seqs = self._done | set(range(1, min(top, SCAN_LIMIT) + 1)) | set(range(max(1, top - SCAN_LIMIT + 1), top + 1))
        out = []
        for seq in sorted(seqs):
            raw_req = read_raw(self.store, keys.admit_req(seq))
            raw_v = read_raw(self.store, keys.admit_verdict(seq)) if raw_req is not None else None
            if raw_req is None or raw_v is None:
                continue
            text = raw_req.decode(errors="replace")
            body = self._signed_verdict(seq, text, raw_v)
            req = parse_json(text, keys.admit_req(seq))
            if body is not None and body.get("ok") and req is not None:
                out.append((seq, req, body))
        return out
