"""Reading store values that anyone who reaches the store may have written.

torch's `TCPStore` lets every client write every key, so a value read back is untrusted input: it
may not parse, parse to the wrong type, nest a million levels deep, be megabytes long or not be
UTF-8. These readers are total: whatever the bytes, they return the caller's default and log one line
(control characters stripped, the value cut short) to stderr, once per key, so a stranger can neither
crash a reader nor flood a log. Before `json.loads` sees a value, its size (`MAX_PARSE_BYTES`) and its
nesting (`MAX_DEPTH`, counted outside strings) are bounded, non-finite numbers (NaN, Infinity, 1e999)
are refused, and any exception of the parse is caught: a value is parsed, or ignored, never a raise.

Counters: `TCPStore.add` on a key that holds a non-number makes the server drop the caller's
connection (every later call of that client fails). So a counter that only one process writes is
kept with `set` (its writer's own count) and read with `get` (`read_int`, `read_raw`), never with
`add(key, 0)`."""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from typing import Any

from phoenixft.controlplane.store import Store

__all__ = ["MAX_PARSE_BYTES", "MAX_DEPTH", "clean", "note_bad", "noted", "parse_json", "json_problem", "read_raw",
           "read_json", "read_int", "parse_int", "parse_lines", "read_text", "parse_drain_request"]

MAX_PARSE_BYTES = 4 << 20  # the longest value a reader parses (the job's largest, a big job's evidence, is far less)
MAX_DEPTH = 32  # the deepest nesting a reader parses (the job's values nest 5 deep at most)
_NOTES_PER_KEY = 1
_NOTED_KEYS = 4096  # distinct keys noted at most (then one line says so): a stranger's key names cost no memory
_noted: Counter[str] = Counter()
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def clean(text: str | bytes, limit: int = 120) -> str:
    """`text` with control characters (escape codes, newlines) replaced by '?' and cut to `limit`: only the
    first characters are looked at, so an 8 MiB value costs what a short one does."""
    head = text[:limit * 4 + 4]
    s = head.decode("utf-8", errors="replace") if isinstance(head, (bytes, bytearray)) else str(head)
    s = "".join(c if c.isprintable() else "?" for c in s[:limit + 1])
    return s if len(s) <= limit and len(head) == len(text) else s[:limit] + "..."


def noted(key: str) -> int:
    """How many values of `key` were ignored so far in this process (logged or not)."""
    return _noted.get(key, 0)


def note_bad(key: str, why: str, raw: str | bytes = b"") -> None:
    """Log (one line, stderr) that the value of `key` was ignored because `why`: once per key (counted after)."""
    if key not in _noted and len(_noted) >= _NOTED_KEYS:
        key = "<other keys>"
    _noted[key] += 1
    if _noted[key] > _NOTES_PER_KEY:
        return
    shown = f": {clean(raw)!r}" if raw else ""
    print(f"phoenixft: ignored the store value of {clean(key, 80)!r}: {why}{shown} (further ones of this key are "
          "counted, not logged)", file=sys.stderr, flush=True)


def _depth(raw: bytes) -> int:
    """The deepest nesting of brackets outside JSON strings in `raw`, counted up to MAX_DEPTH + 1 (cheap: the
    brackets of a value are few unless it nests, and a deep one stops the count early)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0
    d = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', raw) if b'"' in raw else raw):
        d += 1 if m.group() in (b"[", b"{") else -1
        if d > deepest:
            deepest = d
            if deepest > MAX_DEPTH:
                break
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a value of the job holds")


def _finite(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError(f"{text[:20]} is not finite")
    return f


def json_problem(raw: str | bytes) -> tuple[str, Any]:
    """("", the parsed value) if `raw` is JSON within the bounds (size, nesting, finite numbers); (why not,
    None) otherwise. Never raises."""
    b = raw.encode("utf-8", errors="surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(b) > MAX_PARSE_BYTES:
        return f"too long to parse ({len(b):,} bytes; at most {MAX_PARSE_BYTES:,})", None
    if _depth(b) > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels", None
    try:
        return "", json.loads(b, parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError):
        return "not JSON", None
    except Exception as e:  # noqa: BLE001 - (RecursionError, MemoryError, ...): whatever the bytes, no raise
        return f"not JSON ({type(e).__name__})", None


def parse_json(raw: str | bytes | None, key: str, default: Any = None, kind: type | tuple[type, ...] = dict) -> Any:
    """`raw` parsed as JSON of type `kind`; `default` (logged) if it is not, or is out of bounds (size,
    nesting, a non-finite number): never a raise."""
    if raw is None:
        return default
    why, v = json_problem(raw)
    if why:
        note_bad(key, why, raw)
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
        if len(raw) > 40:
            raise ValueError("too long")
        return int(raw.strip() if isinstance(raw, (bytes, bytearray)) else str(raw).strip())
    except (ValueError, TypeError):
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
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, (bytes, bytearray)) else raw
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
