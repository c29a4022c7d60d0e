"""The job token: HMAC challenge-response admission of agents, and signed topologies.

torch's `TCPStore` has no authentication: whoever reaches its port reads and writes every key. So
the token itself, or anything it follows from, never goes into the store; only nonces and HMACs
(SHA-256) keyed with it do.

Admission (`request_admission` in the agent, `AdmissionDesk` in the coordinator), over the store:

    agent        seq = add(admit/seq, 1); set admit/<seq>/req = {name, spare, workers, host, ...}
    coordinator  set admit/<seq>/challenge = 32 random bytes (hex), fresh for this request
    agent        set admit/<seq>/resp = HMAC(token, "join", seq, challenge, req)   ("" without a token)
    coordinator  verifies it (constant time), decides membership, and sets admit/<seq>/verdict =
                 {ok, node, run_id, reason, mac = HMAC(token, "verdict", seq, challenge, verdict)}

The response binds the request's number, the challenge and the request itself, so a response seen
in the store can be neither replayed for another request nor attached to an altered one. The
verdict's MAC lets the agent check that it was admitted by a holder of the token, and lets a
restarted coordinator rebuild the membership from the store without trusting it. Every wait is
bounded.

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
delete keys, forge heartbeats): serve it on a private network, as with torchrun's store.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phoenixft.controlplane import keys
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import read_int
from phoenixft.errors import RunAborted, UserError

__all__ = ["TOKEN_ENV", "MIN_TOKEN_CHARS", "MIN_TOKEN_BITS", "resolve_token", "token_source", "read_token_file",
           "write_token_file", "generate_token", "token_bits", "check_token", "mac",
           "sign_topology", "verified_topology", "token_matches_job", "request_admission",
           "Application", "AdmissionDesk", "NAME_RE"]

TOKEN_ENV = "PHOENIXFT_TOKEN"
MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 128
MIN_DISTINCT = 8
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_VERSION = b"phoenixft-auth-v1"
_PENDING_TTL_S = 300.0  # a request whose agent went away is forgotten after this long


def resolve_token(flag: str | None, token_file: str | None = None) -> str | None:
    """The token from `--token`, else from `--token-file` (checked: `read_token_file`), else from the
    environment (PHOENIXFT_TOKEN), else None."""
    if flag:
        return flag
    if token_file:
        return read_token_file(token_file)
    return os.environ.get(TOKEN_ENV, "") or None


def token_source(flag: str | None, token_file: str | None = None) -> str:
    """What `resolve_token` took the token from, as an error message names it."""
    return "--token" if flag else f"--token-file={token_file}" if token_file else f"${TOKEN_ENV}"


def read_token_file(path: str, flag: str = "--token-file") -> str:
    """The token in the first line of `path`; UserError (one line) unless the file is this user's and
    readable by no one else (mode 0600 or stricter)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise UserError(f"{flag}={path}: cannot open it ({e.strerror})") from None
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
        st = os.fstat(f.fileno())
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid():
            raise UserError(f"{flag}={path}: the file belongs to uid {st.st_uid}, not to this user (uid "
                            f"{os.getuid()}); use a token file of your own with mode 0600")
        if mode & 0o077:
            raise UserError(f"{flag}={path}: mode {mode:04o} lets other users read the job token; run "
                            f"`chmod 600 {path}` (a token file must be readable by its owner only)")
        return f.readline().strip()


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to a new file at `path` readable by this user only (0600, created so: never wider)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def generate_token() -> str:
    return secrets.token_urlsafe(32)  # 256 bits


def token_bits(token: str) -> float:
    """The token's entropy as estimated from its character classes: length x log2(the size of the
    alphabet that the classes it uses span: lower 26, upper 26, digits 10, anything else 32)."""
    alphabet = sum(size for test, size in ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
                   if any(test(c) and c.isascii() for c in token))
    alphabet += 32 if any(not (c.isascii() and c.isalnum()) for c in token) else 0
    return len(token) * math.log2(alphabet) if alphabet > 1 else 0.0


def check_token(token: str, source: str) -> str:
    """Raise UserError unless `token` is usable; `source` names where it came from (a flag or the env).

    The rule: at least MIN_TOKEN_CHARS characters, no whitespace, at least MIN_TOKEN_BITS bits by
    `token_bits`, at least MIN_DISTINCT distinct characters, and not one string repeated."""
    how = "make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
    if len(token) < MIN_TOKEN_CHARS or token != token.strip() or any(c.isspace() for c in token):
        raise UserError(f"{source} is invalid: a job token needs at least {MIN_TOKEN_CHARS} characters and no "
                        f"whitespace (got {len(token)} characters); {how}")
    bits, distinct = token_bits(token), len(set(token))
    weak = (f"{bits:.0f} bits" if bits < MIN_TOKEN_BITS else f"{distinct} distinct characters"
            if distinct < MIN_DISTINCT else "one string repeated" if token in (token + token)[1:-1] else "")
    if weak:
        raise UserError(f"{source} is too weak ({weak}): a job token needs {MIN_TOKEN_BITS} bits of entropy, "
                        f"estimated as length x log2(the alphabet its character classes span), at least "
                        f"{MIN_DISTINCT} distinct characters and no repeated pattern; {how}")
    return token


def mac(token: str, purpose: str, *parts: str | bytes | int) -> str:
    """HMAC-SHA256 (hex) of the parts, with the protocol version and a purpose for domain separation."""
    msg = [_VERSION, purpose.encode()]
    for p in parts:
        msg.append(p if isinstance(p, bytes) else str(p).encode())
    return hmac.new(token.encode(), b"\0".join(msg), hashlib.sha256).hexdigest()


def _same(a: str | bytes, b: str) -> bool:
    a_s = a.decode(errors="replace") if isinstance(a, bytes) else a
    return hmac.compare_digest(a_s.encode(), b.encode())


# ---------------------------------------------------------------------------------------- topologies
def sign_topology(token: str, epoch: int, raw: str | bytes) -> str:
    return mac(token, "topology", epoch, raw if isinstance(raw, bytes) else raw.encode())


def verified_topology(store: Store, epoch: int, raw: bytes, timeout_s: float = 30.0) -> Any:
    """The `Topology` of `raw` (just read from `topo/<epoch>`) once its signature verifies with the
    job token; a wrong one is re-read (the coordinator may be overwriting a forgery) until
    `timeout_s`, then RunAborted: a worker never acts on an unsigned plan."""
    from phoenixft.dist.topology import Topology

    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise RunAborted(f"no job token in this worker's environment ({TOKEN_ENV}): it cannot verify the "
                         f"coordinator's plans, so it acts on none")
    deadline = time.monotonic() + timeout_s
    while True:
        sig = store.get(keys.topo_sig(epoch)) if store.check([keys.topo_sig(epoch)]) else b""
        if sig and _same(sig, sign_topology(token, epoch, raw)):
            return Topology.from_json(raw)
        if time.monotonic() > deadline:
            raise RunAborted(f"the topology of epoch {epoch} in the store is not signed with this job's token: "
                             "refusing to act on it (something other than the coordinator wrote it)")
        time.sleep(0.05)
        raw = store.get(keys.topo(epoch))


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
class RunEnded(Exception):
    """The run ended (its final state is in the store) while this agent waited to be admitted."""


def _wait_key(store: Store, key: str, deadline: float, what: str) -> bytes:
    """Poll (every 20 ms; no server-side wait, whose timeouts c10d logs as warnings) until `key`
    exists; TimeoutError at the deadline, RunEnded as soon as the run has a final state (an agent
    started just before the run was stopped must not wait out its join timeout). A failing store
    call is retried until then."""
    polls = 0
    while True:
        try:
            if store.check([key]):
                return bytes(store.get(key))
            if polls % 10 == 0 and store.check([keys.RUN_STATE]):
                raise RunEnded(store.get(keys.RUN_STATE).decode())
        except RunEnded:
            raise
        except Exception:  # noqa: BLE001 - a call that failed or timed out: retry until the deadline
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        polls += 1
        time.sleep(0.02)


def request_admission(store: Store, request: dict[str, Any], token: str | None, timeout_s: float,
                      where: str) -> dict[str, Any]:
    """Ask the coordinator behind `store` to admit this agent; return its verdict ({node, run_id, note}).

    UserError (one line) if it refuses, if its answer is not signed with our token, or if it does not
    answer within `timeout_s`."""
    raw_req = json.dumps(request, sort_keys=True)
    seq = int(store.add(keys.ADMIT_SEQ, 1))
    store.set(keys.admit_req(seq), raw_req)
    store.add(keys.ADMIT_POSTED, 1)
    deadline = time.monotonic() + timeout_s
    late = (f"the coordinator at {where} did not answer the join request of {request['name']!r} within "
            f"{timeout_s:g}s (see --join-timeout; is a phoenixft coordinator serving that address?)")
    try:
        challenge = _wait_key(store, keys.admit_challenge(seq), deadline, late)
        resp = mac(token, "join", seq, challenge, raw_req) if token else ""
        store.set(keys.admit_resp(seq), resp)
        store.add(keys.ADMIT_POSTED, 1)
        raw_verdict = _wait_key(store, keys.admit_verdict(seq), deadline, late)
    except TimeoutError:
        raise UserError(late) from None
    except RunEnded as e:
        raise UserError(f"the run at {where} ended ({e}) before {request['name']!r} was admitted") from None
    try:
        verdict = json.loads(raw_verdict)
        if not isinstance(verdict, dict):
            raise ValueError("not an object")
    except ValueError:
        raise UserError(f"the answer to the join request at {where} is unreadable: not a phoenixft coordinator") \
            from None
    if not verdict.get("ok"):
        raise UserError(f"the coordinator at {where} refused to admit {request['name']!r} (from "
                        f"{request.get('host') or '?'}): {verdict.get('reason', 'no reason given')}")
    body = {k: v for k, v in verdict.items() if k != "mac"}
    if not token or not _same(str(verdict.get("mac", "")), mac(token, "verdict", seq, challenge,
                                                               json.dumps(body, sort_keys=True))):
        raise UserError(f"the answer to the join request at {where} is not signed with this agent's token: "
                        "not this job's coordinator")
    return body


@dataclass
class Application:
    """A join request whose response has arrived, verified (`proof` is "ok", "none" or "wrong")."""

    seq: int
    request: dict[str, Any]
    proof: str
    challenge: str


@dataclass
class _Pending:
    t: float
    challenge: str = ""
    raw_req: str = ""


@dataclass
class AdmissionDesk:
    """The coordinator's side of admission: issues challenges, checks responses, signs verdicts.

    `poll()` does nothing but read one counter unless an agent wrote something since the last call.
    The coordinator decides who is admitted (`answer`)."""

    store: Store
    token: str
    _posted_seen: int = -1
    _next_seq: int = 1
    _pending: dict[int, _Pending] = field(default_factory=dict)

    def poll(self, force: bool = False) -> list[Application]:
        posted = read_int(self.store, keys.ADMIT_POSTED)  # (`get`: an `add` on a garbage value cuts the connection)
        if posted == self._posted_seen and not force:
            return []
        self._posted_seen = posted
        top = read_int(self.store, keys.ADMIT_SEQ)
        now = time.monotonic()
        for seq in range(self._next_seq, top + 1):
            self._pending[seq] = _Pending(t=now)
        self._next_seq = max(self._next_seq, top + 1)
        out: list[Application] = []
        for seq, p in list(self._pending.items()):
            if not p.challenge:
                if self.store.check([keys.admit_verdict(seq)]):  # answered before a coordinator restart
                    del self._pending[seq]
                    continue
                if not self.store.check([keys.admit_req(seq)]):
                    if now - p.t > _PENDING_TTL_S:
                        del self._pending[seq]
                    continue
                p.raw_req = self.store.get(keys.admit_req(seq)).decode(errors="replace")
                if self.store.check([keys.admit_challenge(seq)]):  # issued by a coordinator before a restart
                    p.challenge = self.store.get(keys.admit_challenge(seq)).decode(errors="replace")
                else:
                    p.challenge = secrets.token_hex(32)
                    self.store.set(keys.admit_challenge(seq), p.challenge)
            if not self.store.check([keys.admit_resp(seq)]):
                if now - p.t > _PENDING_TTL_S:
                    del self._pending[seq]
                continue
            resp = self.store.get(keys.admit_resp(seq)).decode(errors="replace")
            del self._pending[seq]
            try:
                req = json.loads(p.raw_req)
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError:
                req = {"name": "?", "unreadable": True}
            proof = "none" if not resp else (
                "ok" if _same(resp, mac(self.token, "join", seq, p.challenge, p.raw_req)) else "wrong")
            out.append(Application(seq=seq, request=req, proof=proof, challenge=p.challenge))
        return out

    def answer(self, app: Application, node: str | None, run_id: str, reason: str = "", note: str = "") -> None:
        """Admit `app` as `node` (signed verdict), or refuse it with `reason` (node None)."""
        if node is None:
            self.store.set(keys.admit_verdict(app.seq), json.dumps({"ok": False, "reason": reason}))
            return
        body = {"ok": True, "node": node, "run_id": run_id, "note": note}
        sig = mac(self.token, "verdict", app.seq, app.challenge, json.dumps(body, sort_keys=True))
        self.store.set(keys.admit_verdict(app.seq), json.dumps({**body, "mac": sig}))

    def admitted(self) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
        """(seq, request, verdict) of every admission in the store whose verdict verifies with the
        token, in order: what a restarted coordinator rebuilds its membership from."""
        out = []
        top = read_int(self.store, keys.ADMIT_SEQ)
        for seq in range(1, top + 1):
            names = [keys.admit_req(seq), keys.admit_challenge(seq), keys.admit_verdict(seq)]
            if not self.store.check(names):
                continue
            raw_req, challenge, raw_verdict = (bytes(x).decode(errors="replace") for x in self.store.multi_get(names))
            try:
                verdict, req = json.loads(raw_verdict), json.loads(raw_req)
            except ValueError:
                continue
            if not isinstance(verdict, dict) or not isinstance(req, dict) or not verdict.get("ok"):
                continue
            body = {k: v for k, v in verdict.items() if k != "mac"}
            if _same(str(verdict.get("mac", "")), mac(self.token, "verdict", seq, challenge,
                                                      json.dumps(body, sort_keys=True))):
                out.append((seq, req, body))
        return out
