"""Reading store values that anyone who reaches the store may have written.

torch's `TCPStore` lets every client write every key, so a value read back is untrusted input: it
may not parse, or parse to the wrong type. These readers never raise on such a value: they return
the caller's default and log one line (control characters stripped, the value cut short) to stderr,
at most a few times per key, so a stranger cannot flood a log either.

Counters: `TCPStore.add` on a key that holds a non-number makes the server drop the caller's
connection (every later call of that client fails). So a counter that only one process writes is
kept with `set` (its writer's own count) and read with `get` (`read_int`, `read_raw`), never with
`add(key, 0)`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from phoenixft.controlplane.store import Store

__all__ = ["clean", "note_bad", "parse_json", "read_raw", "read_json", "read_int", "parse_int", "parse_lines",
           "read_text", "parse_drain_request"]

_NOTES_PER_KEY = 5
_noted: Counter[str] = Counter()


def clean(text: str | bytes, limit: int = 120) -> str:
    """`text` with control characters (escape codes, newlines) replaced by '?' and cut to `limit`."""
    s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    s = "".join(c if c.isprintable() else "?" for c in s)
    return s if len(s) <= limit else s[:limit] + "..."


def note_bad(key: str, why: str, raw: str | bytes = b"") -> None:
    """Log (one line, stderr) that the value of `key` was ignored because `why`; a few times per key."""
    _noted[key] += 1
    if _noted[key] > _NOTES_PER_KEY:
        return
    shown = f": {clean(raw)!r}" if raw else ""
    more = " (further ones not logged)" if _noted[key] == _NOTES_PER_KEY else ""
    print(f"phoenixft: ignored the store value of {clean(key, 80)!r}: {why}{shown}{more}", file=sys.stderr,
          flush=True)


def parse_json(raw: str | bytes | None, key: str, default: Any = None, kind: type | tuple[type, ...] = dict) -> Any:
    """`raw` parsed as JSON of type `kind`; `default` (logged) if it is not."""
    if raw is None:
        return default
    try:
        v = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        note_bad(key, "not JSON", raw)
        return default
    if not isinstance(v, kind):
        note_bad(key, f"not a JSON {getattr(kind, '__name__', 'value')}", raw)
        return default
    return v


def parse_int(raw: str | bytes | None, key: str, default: int = 0) -> int:
    """`raw` as a decimal integer; `default` (logged) if it is not one."""
    if raw is None:
        return default
    try:
        return int(raw.strip() if isinstance(raw, bytes) else str(raw).strip())
    except ValueError:
        note_bad(key, "not an integer", raw)
        return default


def read_raw(store: Store, key: str) -> bytes | None:
    """The value of `key`, None if it is not there (no blocking `get`)."""
    return bytes(store.get(key)) if store.check([key]) else None


def read_json(store: Store, key: str, default: Any = None, kind: type | tuple[type, ...] = dict) -> Any:
    return parse_json(read_raw(store, key), key, default, kind)


def read_int(store: Store, key: str, default: int = 0) -> int:
    return parse_int(read_raw(store, key), key, default)


def read_text(store: Store, key: str, default: str = "") -> str:
    """The value of `key` as printable text (control characters replaced), `default` if absent."""
    raw = read_raw(store, key)
    return default if raw is None else clean(raw, 2000)


def parse_lines(raw: str | bytes, key: str) -> list[dict[str, Any]]:
    """The JSON objects of an appended log (one per line); a line that is not one is skipped (logged)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    out = []
    for line in text.splitlines():
        if line.strip():
            rec = parse_json(line, key, None)
            if rec is not None:
                out.append(rec)
    return out


_DRAIN_TEXT = {"reason": 200, "source": 200, "node_id": 64}


def parse_drain_request(raw: str | bytes | None, key: str) -> dict[str, Any] | None:
    """A drain request (`keys.drain_key`) checked field by field: {"reason": str, "source": str, "deadline":
    float or None, "t": float or None, "node_id": str or None}; None (logged) if it is not one: a JSON
    object whose reason and source are strings and whose deadline and t, when given, are finite numbers."""
    rec = parse_json(raw, key)
    if rec is None:
        return None
    out: dict[str, Any] = {}
    for f, limit in _DRAIN_TEXT.items():
        v = rec.get(f, None if f == "node_id" else "")
        if v is not None and not isinstance(v, str):
            note_bad(key, f"not a drain request ({f} is not a string)", raw or b"")
            return None
        out[f] = clean(v, limit) if v is not None else None
    for f in ("deadline", "t"):
        v = rec.get(f)
        ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and abs(float(v)) < 1e12)
        if not ok:
            note_bad(key, f"not a drain request ({f} is not seconds since the epoch or null)", raw or b"")
            return None
        out[f] = None if v is None else float(v)
    out["reason"] = out["reason"] or "requested"
    out["source"] = out["source"] or "unknown"
    return out
