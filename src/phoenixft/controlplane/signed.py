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

The job token reaches every process of the job in its environment (`auth.TOKEN_ENV`), never on a
command line and never in the store."""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from phoenixft.controlplane import keys
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import clean, note_bad

__all__ = ["CONFIG_WAIT_S", "run_key", "sig_key", "sign", "set_signed", "verified", "wait_verified", "run_ended",
           "env_token"]

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


def run_ended(store: Store, run_id: str, token: str | None = None) -> str | None:
    """The run's final state ("done", "failed", ...) once one signed with the run key is in the store;
    None while there is none (a forged one is ignored). Call it when `run/state` was seen to exist."""
    v = verified(store, env_token() if token is None else token, run_id, keys.RUN_STATE)
    return None if v is None else clean(v, 200)
