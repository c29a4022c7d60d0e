"""torch's TCPStore protocol, client to server, as far as the store's front needs it (standard library only).

Every connection to the job's TCPStore passes through its front (`controlplane/tlsproxy.py`: the loopback guard,
the TLS gateway). The front frames each request the client sends (`Framer`), refuses a malformed one, one of an
operation it does not know, or one past the store's limits (`Limits`, `Ledger`), and closes that connection: the
store's server never reads a frame that would make it log a stack trace, and never holds more than the limits
allow. The server's answers are relayed unread.

A request is one operation byte and its arguments, little-endian, as torch 2.11 to 2.13 send them: a key is a
u64 length and its bytes (the client prefixes each with '/'), a value a u64 length and its bytes, a key list a u64
count and its keys:

    0 VALIDATE u32 magic   1 SET key value        2 COMPARE_SET key value value   3 GET key
    4 ADD key i64          5 CHECK keys           6 WAIT keys                     7 GETNUMKEYS
    8 DELETE_KEY key       9 APPEND key value    10 MULTI_GET keys               11 MULTI_SET count (key value)*
   12 CANCEL_WAIT         13 PING u32            14 QUEUE_PUSH key value         15 QUEUE_POP key
   16 QUEUE_LEN key       17 LIST_KEYS

The ledger follows what the requests write: the size of each key's value (a compare-and-set counted as if it
succeeded: an upper bound), the items of each queue, the number of keys. It is an estimate of the store from what
passed through the front, which every write does.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

__all__ = ["OPS", "ANSWERED", "Malformed", "Refused", "Request", "Framer", "Limits", "Ledger"]

OPS = {0: "validate", 1: "set", 2: "compare_set", 3: "get", 4: "add", 5: "check", 6: "wait", 7: "getnumkeys",
       8: "delete_key", 9: "append", 10: "multi_get", 11: "multi_set", 12: "cancel_wait", 13: "ping",
       14: "queue_push", 15: "queue_pop", 16: "queue_len", 17: "list_keys"}
ANSWERED = {2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 15, 16, 17}  # the operations the server answers (the rest: none)
TORCH_MAX_KEY = 8 * 1024  # what torch's server itself accepts at most (it closes the connection past them)
TORCH_MAX_VALUE = 8 * 1024 * 1024
TORCH_MAX_KEY_COUNT = 128 * 1024
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class Malformed(ValueError):
    """Bytes that are not a request of the protocol (or of an operation this front does not know)."""


class Refused(ValueError):
    """A well-formed request past the store's limits."""


@dataclass(frozen=True)
class Limits:
    """What the store accepts: the longest key and value, and in all the bytes of its values and queued items and
    the number of its keys."""

    max_key: int = 1024
    max_value: int = TORCH_MAX_VALUE
    max_bytes: int = 1 << 30
    max_keys: int = 1 << 20
    max_key_count: int = TORCH_MAX_KEY_COUNT  # keys of one request

    def __post_init__(self) -> None:
        if not (0 < self.max_key <= TORCH_MAX_KEY and 0 < self.max_value <= TORCH_MAX_VALUE
                and self.max_bytes > 0 and self.max_keys > 0 and 0 < self.max_key_count <= TORCH_MAX_KEY_COUNT):
            raise ValueError(f"store limits out of range: {self}")


@dataclass
class Request:
    """One framed request: its operation, its bytes (to relay as they are), and what it writes."""

    op: int
    raw: bytes
    keys: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)  # (set, append, queue_push: one; multi_set: one per key)
    expected: bytes = b""  # (compare_set)

    @property
    def name(self) -> str:
        return OPS[self.op]

    @property
    def answered(self) -> bool:
        return self.op in ANSWERED


class Framer:
    """Client bytes in (`feed`), requests out, in order. A request is returned once all its bytes are there; a
    length past the limits is refused as soon as it is read (nothing of the rest is buffered)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._need = 1  # bytes the next request needs at least (a large value is not re-parsed byte by byte)

    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[Request]:
        self._buf += data
        out: list[Request] = []
        while len(self._buf) >= self._need:
            got = self._parse()
            if isinstance(got, int):
                self._need = got
                break
            out.append(got)
            del self._buf[: len(got.raw)]
            self._need = 1
        return out

    # ------------------------------------------------------------------ parsing
    def _parse(self) -> Request | int:
        """The request at the start of the buffer, or how many bytes it needs at least."""
        b, lim = self._buf, self.limits
        op = b[0]
        if op not in OPS:
            raise Malformed(f"operation {op} is not one of torch's TCPStore (or not one this front knows)")
        p = _Cursor(b, 1, lim)
        req = Request(op, b"")
        if op in (0, 13):
            if not p.fixed(4):
                return p.need
        elif op == 4:
            if not (p.key(req) and p.fixed(8)):
                return p.need
        elif op in (1, 9, 14):
            if not (p.key(req) and p.value(req)):
                return p.need
        elif op == 2:
            if not (p.key(req) and p.value(req, expected=True) and p.value(req)):
                return p.need
        elif op in (3, 8, 15, 16):
            if not p.key(req):
                return p.need
        elif op in (5, 6, 10):
            n = p.count()
            if n is None:
                return p.need
            for _ in range(n):
                if not p.key(req):
                    return p.need
        elif op == 11:
            n = p.count()
            if n is None:
                return p.need
            for _ in range(n):
                if not (p.key(req) and p.value(req)):
                    return p.need
        req.raw = bytes(b[: p.at])
        return req


class _Cursor:
    """Reads the fields of one request from `buf` at `at`; each read is False (and `need` says how many bytes
    would do) when the buffer ends first."""

    def __init__(self, buf: bytearray, at: int, limits: Limits) -> None:
        self.buf, self.at, self.limits = buf, at, limits
        self.need = 0

    def _room(self, n: int) -> bool:
        if len(self.buf) < self.at + n:
            self.need = self.at + n
            return False
        return True

    def fixed(self, n: int) -> bool:
        if not self._room(n):
            return False
        self.at += n
        return True

    def _length(self, limit: int, what: str) -> int | None:
        if not self._room(8):
            return None
        n = _U64.unpack_from(self.buf, self.at)[0]
        if n > limit:
            raise (Refused if n <= (TORCH_MAX_VALUE if what == "value" else TORCH_MAX_KEY) else Malformed)(
                f"a {what} of {n:,} bytes (at most {limit:,})")
        return n

    def key(self, req: Request) -> bool:
        n = self._length(self.limits.max_key, "key")
        if n is None or not self._room(8 + n):
            return False
        req.keys.append(bytes(self.buf[self.at + 8: self.at + 8 + n]))
        self.at += 8 + n
        return True

    def value(self, req: Request, expected: bool = False) -> bool:
        n = self._length(self.limits.max_value, "value")
        if n is None or not self._room(8 + n):
            return False
        v = bytes(self.buf[self.at + 8: self.at + 8 + n])
        if expected:
            req.expected = v
        else:
            req.values.append(v)
        self.at += 8 + n
        return True

    def count(self) -> int | None:
        if not self._room(8):
            return None
        n = _U64.unpack_from(self.buf, self.at)[0]
        if n > self.limits.max_key_count:
            raise Malformed(f"{n:,} keys in one request (at most {self.limits.max_key_count:,})")
        self.at += 8
        return int(n)


class Ledger:
    """What the store holds, as the requests that passed say: each key's value size, each queue's item sizes.
    `admit(request)` raises Refused where the request would take the store past its limits, else records it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.sizes: dict[bytes, int] = {}
        self.queues: dict[bytes, deque[int]] = {}
        self.bytes = 0
        self.keys = 0  # keys and queues

    def _grow(self, key: bytes, size: int) -> tuple[int, int]:
        """(bytes, keys) the store would hold with `key`'s value of `size`."""
        old = self.sizes.get(key)
        return self.bytes - (old or 0) + size, self.keys + (old is None)

    def _check(self, total: int, nkeys: int, req: Request) -> None:
        if total > self.limits.max_bytes:
            raise Refused(f"{req.name} would take the store past {self.limits.max_bytes:,} bytes")
        if nkeys > self.limits.max_keys:
            raise Refused(f"{req.name} would take the store past {self.limits.max_keys:,} keys")

    def admit(self, req: Request) -> None:
        op = req.op
        if op in (1, 11):  # set, multi_set (a key set twice in one request: its last value)
            total, nkeys, new = self.bytes, self.keys, dict(zip(req.keys, map(len, req.values), strict=True))
            for k, size in new.items():
                old = self.sizes.get(k)
                total += size - (old or 0)
                nkeys += old is None
            self._check(total, nkeys, req)
            self.sizes.update(new)
            self.bytes, self.keys = total, nkeys
        elif op == 2:  # compare_set: as if it succeeded, never below what the key held (an upper bound)
            k, size = req.keys[0], max(len(req.values[0]), self.sizes.get(req.keys[0], 0))
            self._set(k, size, req)
        elif op == 9:  # append
            k = req.keys[0]
            self._set(k, self.sizes.get(k, 0) + len(req.values[0]), req)
        elif op == 4:  # add: a counter
            self._set(req.keys[0], max(20, self.sizes.get(req.keys[0], 0)), req)
        elif op == 8:  # delete_key
            old = self.sizes.pop(req.keys[0], None)
            if old is not None:
                self.bytes -= old
                self.keys -= 1
        elif op == 14:  # queue_push
            q = self.queues.get(req.keys[0])
            total, nkeys = self.bytes + len(req.values[0]), self.keys + (q is None)
            self._check(total, nkeys, req)
            self.queues.setdefault(req.keys[0], deque()).append(len(req.values[0]))
            self.bytes, self.keys = total, nkeys
        elif op == 15:  # queue_pop: its oldest item (a pop of an empty queue takes nothing)
            q = self.queues.get(req.keys[0])
            if q:
                self.bytes -= q.popleft()
                if not q:
                    del self.queues[req.keys[0]]
                    self.keys -= 1

    def _set(self, key: bytes, size: int, req: Request) -> None:
        total, nkeys = self._grow(key, size)
        self._check(total, nkeys, req)
        self.keys += key not in self.sizes
        self.bytes = total
        self.sizes[key] = size
