"""Values signed with the run's key in a key of their own: the run state, the final state and the config.

Anyone who reaches a `TCPStore` can write `run/state` and `final`; a forged "done" with a made-up
hash must not end the run or be reported. So the process that writes one of these keys first writes
`<key>/sig` = HMAC-SHA256(run key, key name, value), with the run key = HMAC-SHA256(job token,
"phoenixft-run-key-v1" 0 run id); readers act on the value only once that verifies (constant-time
comparison). A value that does not verify is ignored and logged (`values.note_bad`): the run goes on.
These keys are written once each (the config by the launcher, which puts it back if it is overwritten),
or, for the run's end, read while the run still goes on, so a signature beside its value costs nothing in
readability (`phoenixft status` shows them as they are). Every other value the job acts on carries its
MAC inside it (`controlplane.sealed`, with the same run key).

A successful end has one writer: the node that holds rank 0 in the signed topology of the epoch the
run finished in. Rank 0 writes the final-state record (`final`: the final hash, its step, its epoch and its
own node id), then `run/state` = "done". A reader believes a "done" only together with a signed final-state
record that names, as its writer, the node the signed topology `topo/<epoch>` of its epoch puts at rank 0
(`end_problem`): a member that is not rank 0, or a node of an epoch that never was, ends no run as "done".
Every holder of the job token can compute these MACs, so this checks the writer a record names, not who
wrote it; docs/security.md says what a process that holds the token can still do. Other ends ("failed",
"aborted") come from whichever process of the job stops the run (a worker, the coordinator, the launcher).

The job token reaches every process of the job in its environment (`auth.TOKEN_ENV`), never on a
command line and never in the store."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from typing import Any

from phoenixft.controlplane import keys
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import clean, note_bad, parse_json

__all__ = ["CONFIG_WAIT_S", "DONE", "run_key", "sig_key", "sign", "set_signed", "verified", "wait_verified",
           "run_ended", "end_record", "end_problem", "final_record", "env_token", "TOPOLOGY_WAIT_S", "mac", "same",
           "sign_topology", "read_topology"]

DONE = "done"  # the run state of a run that completed (written by rank 0 only, after its final-state record)

_TOKEN_ENV = "PHOENIXFT_TOKEN"  # (auth.TOKEN_ENV; not imported: auth imports this package's readers)


def env_token() -> str:
    return os.environ.get(_TOKEN_ENV, "")


def run_key(token: str, run_id: str) -> bytes:
    """The per-run key: every MAC of a value binds the run, so one run's signed value is no other's. Keyed
    with the token stretched by scrypt (`tokens.stretched`): a MAC read from the store tests a guessed token
    at the price of one scrypt."""
    from phoenixft.controlplane.tokens import stretched

    return hmac.new(stretched(token), b"phoenixft-run-key-v1\0" + run_id.encode(), hashlib.sha256).digest()


def sig_key(name: str) -> str:
    return f"{name}/sig"


def sign(token: str, run_id: str, name: str, value: str | bytes) -> str:
    v = value.encode() if isinstance(value, str) else value
    return hmac.new(run_key(token, run_id), name.encode() + b"\0" + v, hashlib.sha256).hexdigest()


def set_signed(store: Store, token: str, run_id: str, name: str, value: str | bytes) -> None:
    """Write `value` at `name`, its signature first (a reader that sees the value finds the signature)."""
    store.set(sig_key(name), sign(token, run_id, name, value))
    store.set(name, value)


def verified(store: Store, token: str, run_id: str, name: str, note: bool = True) -> bytes | None:
    """The value at `name` if its signature verifies with the run key; None (logged if `note`) otherwise."""
    if not store.check([name]):
        return None
    value = bytes(store.get(name))
    sig = bytes(store.get(sig_key(name))) if store.check([sig_key(name)]) else b""
    if token and hmac.compare_digest(sig, sign(token, run_id, name, value).encode()):
        return value
    if note:
        note_bad(name, "not signed with this run's key" if token else "no job token here to verify it", value)
    return None


CONFIG_WAIT_S = 10.0  # a config that does not verify: how long to wait for the launcher to put it back


def wait_verified(store: Store, token: str, run_id: str, name: str, timeout_s: float) -> bytes | None:
    """`verified(...)` once it is not None (a value its writer puts back after something else overwrote it),
    polled for at most `timeout_s`; None then."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = verified(store, token, run_id, name)
        if v is not None or time.monotonic() > deadline:
            return v
        time.sleep(0.1)


_VERSION = b"phoenixft-auth-v1"


def mac(token: str, purpose: str, *parts: str | bytes | int) -> str:
    """HMAC-SHA256 (hex) of the parts, with the protocol version and a purpose for domain separation (the
    admission's MACs and the topologies'; re-exported by `controlplane.auth`)."""
    from phoenixft.controlplane.tokens import stretched

    msg = [_VERSION, purpose.encode()]
    for p in parts:
        msg.append(p if isinstance(p, bytes) else str(p).encode("utf-8", errors="surrogatepass"))
    return hmac.new(stretched(token), b"\0".join(msg), hashlib.sha256).hexdigest()  # (scrypt: tokens.stretched)


def same(a: str | bytes, b: str) -> bool:
    """`a` equals the MAC `b` (constant-time comparison)."""
    a_b = bytes(a) if isinstance(a, (bytes, bytearray)) else a.encode("utf-8", errors="replace")
    return hmac.compare_digest(a_b, b.encode())


def sign_topology(token: str, epoch: int, raw: str | bytes) -> str:
    return mac(token, "topology", epoch, raw if isinstance(raw, bytes) else raw.encode())


def read_topology(store: Store, epoch: int, token: str | None) -> Any:
    """The `Topology` of epoch `epoch` if it is in the store and its signature verifies with `token` (with no
    token: unchecked, for a process that only shows it); None otherwise (logged). Never blocks, never raises
    on what the store holds."""
    from phoenixft.distributed.topology import Topology

    name = keys.topo(epoch)
    raw = store.get_nowait(name)
    if raw is None:
        return None
    if token:
        sig = store.get_nowait(keys.topo_sig(epoch))
        if sig is None or not same(bytes(sig), sign_topology(token, epoch, bytes(raw))):
            note_bad(name, "not signed with this job's token", bytes(raw))
            return None
    return Topology.parse(bytes(raw), name)


TOPOLOGY_WAIT_S = 10.0  # rank 0 at the end: how long to wait for a copy of its epoch's topology that verifies


def end_record(final: str, node: str, store: Store, timeout_s: float = TOPOLOGY_WAIT_S) -> str:
    """Rank 0's final-state record: `final` (JSON, with the epoch it finished in) with its writer's node id and
    the signed topology of that epoch as the store holds it (its bytes and their signature), so that a reader
    checks the writer against the record alone, whatever the topology keys hold by then (`end_problem`).
    Without a copy that verifies within `timeout_s`, the record carries none (readers then read the store's)."""
    rec = json.loads(final)
    rec["node"] = node
    e, token = rec.get("epoch"), env_token()
    deadline = time.monotonic() + timeout_s
    while token and isinstance(e, int):
        raw, sig = store.get_nowait(keys.topo(e)), store.get_nowait(keys.topo_sig(e))
        if raw is not None and sig is not None and \
                same(bytes(sig), sign_topology(token, e, bytes(raw))):
            try:
                rec["topology"] = {"raw": bytes(raw).decode(), "sig": bytes(sig).decode()}
                break
            except UnicodeDecodeError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return json.dumps(rec)


def _carried(token: str, e: int, rec: dict[str, Any]) -> tuple[str, Any]:
    """The signed topology a final-state record carries: ("", the Topology) when it verifies for epoch `e` with
    the job token, (why not, None) when it does not, ("", None) when the record carries none."""
    from phoenixft.distributed.topology import Topology

    t = rec.get("topology")
    if t is None:
        return "", None
    raw, sig = (t.get("raw"), t.get("sig")) if isinstance(t, dict) else (None, None)
    if not isinstance(raw, str) or not isinstance(sig, str) or not token or \
            not same(sig, sign_topology(token, e, raw.encode())):
        return f"the topology it carries is not one of epoch {e} signed with the job token", None
    topo = Topology.parse(raw.encode(), keys.topo(e))
    return ("", topo) if topo is not None else ("the topology it carries does not parse", None)


def end_problem(store: Store, token: str, rec: object) -> str:
    """Why the final-state record `rec` is not the one rank 0 writes ("" when it is): it must name its writer
    (`node`) and the epoch it finished in (`epoch`), and that node must hold rank 0 in the topology of that
    epoch signed with the job token: the one the record carries (`end_record`), else the store's."""
    if not isinstance(rec, dict):
        return "not a final-state record"
    e, node = rec.get("epoch"), rec.get("node")
    if not isinstance(e, int) or isinstance(e, bool) or e < 0 or not isinstance(node, str):
        return "it names no writer node and epoch"
    why, topo = _carried(token, e, rec)
    if why:
        return why
    if topo is None:
        topo = read_topology(store, e, token) if token else None
    if topo is None:
        return f"the store holds no topology of epoch {e} signed with the job token"
    rank0 = topo.node_of_rank(0)
    if node != rank0:
        return f"its writer {clean(node, 40)!r} does not hold rank 0 in epoch {e} ({rank0} does)"
    return ""


def final_record(store: Store, token: str, run_id: str) -> dict[str, object] | None:
    """The final-state record once one signed with the run key and written by rank 0's node (`end_problem`) is
    in the store; None otherwise (one that is not, logged)."""
    raw = verified(store, token, run_id, keys.FINAL)
    rec = parse_json(raw, keys.FINAL)
    if rec is None:
        return None
    why = end_problem(store, token, rec)
    if why:
        note_bad(keys.FINAL, f"not the run's end: {why}", raw or b"")
        return None
    return rec


def run_ended(store: Store, run_id: str, token: str | None = None) -> str | None:
    """The run's final state ("done", "failed", ...) once one signed with the run key is in the store, a
    "done" only with rank 0's final-state record beside it (`final_record`); None while there is none (a
    forged one is ignored). Call it when `run/state` was seen to exist."""
    tok = env_token() if token is None else token
    v = verified(store, tok, run_id, keys.RUN_STATE)
    if v is None:
        return None
    state = clean(v, 200)
    if state == DONE and final_record(store, tok, run_id) is None:
        note_bad(keys.RUN_STATE, "a 'done' without a final-state record of rank 0's node beside it", v)
        return None
    return state
