"""Store values sealed with the run key: the value and its MAC in one key.

Whoever reaches the store (a stranger on a run without TLS, another user of the head's host through
its loopback address) can write any key. So what a process of the job acts on is written sealed:

    b"pf1:" + hex(HMAC-SHA256(run key, b"phoenixft-sealed-v1" 0 name 0 value)) + b":" + value

with the run key of `signed.run_key` (the job token and the run id: a value of one run is no other
run's, and of one key no other key's). Value and MAC travel in one key, so a reader never sees one
without the other; a reader acts on a value only once its MAC verifies (constant-time comparison), and
a value that does not (forged, truncated, of another run or another key, not sealed at all) is ignored
and logged (`values.note_bad`), as if absent. An appended log (events) seals each line on its own, and
its readers drop a line seen twice (a stranger can copy a sealed line, not make one).

Each process binds the run key once it knows the run id (`bind`); what it writes and reads from then on
is sealed and checked with it. A process that only shows what the store holds and has no token
(`phoenixft status` without one) reads the values unchecked instead (`read_unchecked`), and writes none.
What sealing does not stop: a stranger can still delete or overwrite a value (the readers then see it
as absent) and replay an older sealed value of the same key.

Counters: `TCPStore.add` on a value that is not a number makes the server drop the caller's connection,
and a counter's value is not sealed. So the job never `add`s to a key a stranger could poison: a key that
only says "look again" is a hint (`hint`: a `set` of a fresh value; its readers look at the sealed
per-item keys whenever it changes, and at some interval anyway), and a key that decides who does
something once is a claim (`claim`: a `compare_set` of a sealed value, a forged holder replaced).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from phoenixft.controlplane import keys
from phoenixft.controlplane.store import Store
from phoenixft.controlplane.values import note_bad, parse_json

__all__ = ["PREFIX", "bind", "unbind", "bound", "bound_token", "read_unchecked", "seal", "unseal", "peel", "put",
           "put_many", "get", "get_json", "wait_json", "get_many", "present", "has", "all_present", "append", "lines",
           "records", "beat_value", "beat_count", "claim", "hint", "Hint"]

PREFIX = b"pf1:"
_MAC_HEX = 64
_HEAD = len(PREFIX) + _MAC_HEX + 1
_DOMAIN = b"phoenixft-sealed-v1\0"
_key: list[Any] = [None]  # the bound run key's HMAC, ready to copy (None: nothing bound; _UNCHECKED)
_token: list[str] = [""]  # the job token bound with it (topologies are signed with the token itself)
_UNCHECKED = "unchecked"


def bind(token: str, run_id: str) -> None:
    """Seal and check with the run key of `token` and `run_id` from now on (nothing without a token)."""
    from phoenixft.controlplane.signed import run_key

    _key[0] = hmac.new(run_key(token, run_id), _DOMAIN, hashlib.sha256) if token and run_id else None
    _token[0] = token if token and run_id else ""


def unbind() -> None:
    """Forget the bound run key (a test process that plays several runs' parts in turn)."""
    _key[0] = None
    _token[0] = ""


def bound_token() -> str:
    """The job token bound with the run key ("" if none: a process that reads unchecked, or none bound)."""
    return _token[0]


def bound() -> bool:
    """A run key is bound (or this process reads unchecked: `read_unchecked`)."""
    return _key[0] is not None


def read_unchecked() -> None:
    """Read sealed values WITHOUT checking them, and write none: for a process that only shows the store
    (`phoenixft status` without the job's token), never for one that acts on what it reads."""
    _key[0] = _UNCHECKED


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _mac(name: str, value: bytes) -> bytes:
    h = _key[0]
    if h is None or h is _UNCHECKED:
        raise RuntimeError("no run key bound in this process (sealed.bind): it cannot seal a store value")
    m = h.copy()
    m.update(name.encode() + b"\0" + value)
    return m.hexdigest().encode()


def seal(name: str, value: str | bytes) -> bytes:
    """`value` sealed for key `name`."""
    v = _b(value)
    return PREFIX + _mac(name, v) + b":" + v


def unseal(name: str, raw: bytes | bytearray | None, note: bool = True) -> bytes | None:
    """The value sealed in `raw` for key `name`, None if `raw` is None or does not verify (logged if `note`)."""
    if raw is None:
        return None
    raw = bytes(raw)
    if _key[0] is _UNCHECKED:
        return peel(raw)
    ok = len(raw) >= _HEAD and raw.startswith(PREFIX) and raw[_HEAD - 1:_HEAD] == b":" and _key[0] is not None
    value = raw[_HEAD:]
    if ok and hmac.compare_digest(raw[len(PREFIX):_HEAD - 1], _mac(name, value)):
        return value
    if note:
        note_bad(name, "not sealed with this run's key" if _key[0] is not None else
                 "no run key here to check it", raw)
    return None


def peel(raw: bytes | None) -> bytes | None:
    """The value in `raw` WITHOUT checking it (for display by a process that holds no token)."""
    if raw is None:
        return None
    raw = bytes(raw)
    return raw[_HEAD:] if raw.startswith(PREFIX) and raw[_HEAD - 1:_HEAD] == b":" else raw


# ---------------------------------------------------------------------------------------- keys
def put(store: Store, name: str, value: str | bytes) -> None:
    store.set(name, seal(name, value))


def put_many(store: Store, names: Sequence[str], values: Sequence[str | bytes]) -> None:
    store.multi_set(list(names), [seal(n, v) for n, v in zip(names, values, strict=True)])


def get(store: Store, name: str) -> bytes | None:
    """The value of `name` if it is there and verifies; None otherwise (a forged one logged)."""
    return unseal(name, store.get_nowait(name))


def get_json(store: Store, name: str, default: Any = None, kind: type | tuple[type, ...] = dict) -> Any:
    return parse_json(get(store, name), name, default, kind)


def wait_json(store: Store, name: str, timeout_s: float, kind: type | tuple[type, ...] = dict) -> Any:
    """`get_json` once it is not None, looked for every 20 ms for at most `timeout_s` (a value its writer put
    there before the reader could need it, which something else may have overwritten: its writer puts it back);
    None then."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = get_json(store, name, None, kind)
        if v is not None or time.monotonic() > deadline:
            return v
        time.sleep(0.02)


def get_many(store: Store, names: Sequence[str], there: Sequence[bool] | None = None) -> list[bytes | None]:
    """The verified values of `names` (None: absent or forged); `there`: which exist, if known."""
    there = store.exists_many(names, serializable=True) if there is None else there
    have = [n for n, t in zip(names, there, strict=True) if t]
    got = dict(zip(have, store.multi_get_nowait(have), strict=True)) if have else {}
    return [unseal(n, got.get(n)) for n in names]


def present(store: Store, names: Sequence[str], there: Sequence[bool] | None = None) -> list[bool]:
    """Whether each of `names` holds a value that verifies. Costs a read of a value only where the key
    exists: a poll of flags that are not set stays one existence check."""
    return [v is not None for v in get_many(store, names, there)]


def has(store: Store, name: str) -> bool:
    return get(store, name) is not None if store.check([name]) else False


def all_present(store: Store, names: Sequence[str]) -> bool:
    """Every one of `names` holds a value that verifies (one existence check while any is missing)."""
    if not names or not store.check(list(names)):
        return not names
    return all(unseal(n, v) is not None for n, v in zip(names, store.multi_get(list(names)), strict=True))


# ---------------------------------------------------------------------------------------- appended logs
_PUSHED = {keys.EVENTS}  # logs one process reads as they grow (Store.log_push / log_take: the launcher's events)


def append(store: Store, name: str, rec: dict[str, Any]) -> None:
    """Append `rec` (a JSON object) to the log `name`, sealed as one line."""
    line = seal(name, json.dumps(rec)) + b"\n"
    if name in _PUSHED:
        store.log_push(name, line)
    else:
        store.append(name, line)


def lines(name: str, raw: bytes | str | None, seen: set[bytes] | None = None) -> list[tuple[bytes, dict[str, Any]]]:
    """(line, JSON object) of each sealed line of log `name` in `raw`, in order: a line that does not verify or
    parse is skipped (logged), and one whose MAC is in `seen` (a copy; `seen` is updated) too."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw or b"")
    seen = set() if seen is None else seen
    out = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        value = unseal(name, line)
        if value is None:
            continue
        mac = line[len(PREFIX):_HEAD - 1]
        if mac in seen:
            note_bad(name, "a line seen before (a copy)", line)
            continue
        seen.add(mac)
        rec = parse_json(value, name)
        if rec is not None:
            out.append((line, rec))
    return out


def records(name: str, raw: bytes | str | None, seen: set[bytes] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of the sealed lines of log `name` in `raw` (`lines`)."""
    return [rec for _, rec in lines(name, raw, seen)]


# ---------------------------------------------------------------------------------------- heartbeats
def beat_value(name: str) -> bytes:
    """A heartbeat for key `name`: this host's wall time (for display) and its monotonic clock, sealed."""
    return seal(name, f"{time.time():.6f} {time.monotonic_ns()}")


def beat_count(name: str, raw: bytes | None) -> int | None:
    """The writer's monotonic clock in heartbeat `raw`, None if it is not a sealed heartbeat (logged). A beat
    counts only when this grows: an older sealed beat written back (a replay) moves nothing."""
    v = unseal(name, raw)
    try:
        return int(v.split()[1]) if v is not None else None
    except (IndexError, ValueError):
        note_bad(name, "not a heartbeat", v or b"")
        return None


# ---------------------------------------------------------------------------------------- hints and claims
def hint(store: Store, name: str) -> None:
    """Say "look again" at `name` (a fresh value each time; never an `add`)."""
    store.set(name, f"{time.time_ns()}-{secrets.token_hex(4)}")


class Hint:
    """Whether hint `name` moved since the last look; True every `every_s` anyway (a stranger who keeps
    writing one value over it delays what it signals, no more)."""

    def __init__(self, name: str, every_s: float = 1.0) -> None:
        self.name, self.every_s = name, every_s
        self._seen: bytes | None = None
        self._at = -float("inf")

    def moved(self, store: Store) -> bool:
        raw = store.get_nowait(self.name)
        now = time.monotonic()
        if raw != self._seen or now - self._at >= self.every_s:
            self._seen, self._at = raw, now
            return True
        return False


def claim(store: Store, name: str, tries: int = 20) -> bool:
    """Whether this caller is the first of the job's processes to claim `name` (each claim is a fresh sealed
    value, set only where the key is absent; a holder that does not verify, a stranger's, is replaced).
    After `tries` forged holders in a row: True (the work a claim guards is done twice rather than never)."""
    mine = seal(name, f"{time.time_ns()}-{secrets.token_hex(8)}")
    expected = b""
    for _ in range(tries):
        cur = bytes(store.compare_set(name, expected, mine))
        if cur == mine:
            return True
        if unseal(name, cur) is not None:
            return False
        expected = b"" if cur == expected else cur  # a forged holder: replace exactly it (gone: claim afresh)
    return True
