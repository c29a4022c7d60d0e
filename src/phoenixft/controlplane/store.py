"""The control-plane store protocol, and its TCPStore backend.

`Store` is what the coordinator, the launcher, agents and workers are given: torch's c10d key-value
operations (with TCPStore's semantics: `get` and `wait` block until the key exists or the timeout
passes), the non-blocking reads that pollers use, and what a caller needs to know about the backend
to poll it well (`poll_s`, `abort_check_s`, `costly_reads`, `wait_slice_s`), whether its keys can
expire with their writer (`has_leases`: heartbeats, leader election), whether it is a replicated
service that rides out the loss of a member (`replicated`) and, for process groups' rendezvous, the
c10d store itself (`c10d`). Two backends satisfy it: `TcpStore` here (a client of torch's
`TCPStore`) and `EtcdStore` (etcd_store.py).

`TcpStore` forwards each operation to the torch client (one Python call more than the bare client,
~0.2 us against a ~50-100 us round trip), and hands the bare client to process groups (`c10d`), so
a rendezvous runs in C++ throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Store", "StoreError", "StoreUnavailable", "TcpStore", "tcp_client", "count_opened", "LOG_TAKE_MAX"]

LOG_TAKE_MAX = 4096  # items one `log_take` pops at most (a log pushed to as fast as it is read still returns)

_opened = [0]


def count_opened(n: int = 1) -> int:
    """Count `n` more store clients opened by this process; how many so far."""
    _opened[0] += n
    return _opened[0]


class StoreError(RuntimeError):
    """The store answered with an error that retrying does not fix."""


class StoreUnavailable(RuntimeError):
    """No server of a replicated store answered before the call's deadline."""


class Store(Protocol):
    """A client of the job's control-plane store (see the module docstring).

    Keys are str; values are written as str or bytes and read back as bytes."""

    # ------------------------------------------------------------------ c10d key-value operations
    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The value; blocks until the key exists (TimeoutError-like after the client's timeout)."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Add to a counter (created at 0) atomically; its new value. `add(key, 0)` reads it."""
        ...

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (never blocks)."""
        ...

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; raise (a message with "timeout") after `timeout`."""
        ...

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set `desired` if the value is `expected` ("" : the key does not exist); the value after."""
        ...

    def delete_key(self, key: str) -> bool: ...

    def num_keys(self) -> int: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None: ...

    def append(self, key: str, value: str | bytes) -> None: ...

    # ------------------------------------------------------------------ polls (never block)
    def exists_many(self, keys: Sequence[str], serializable: bool = False) -> list[bool]:
        """Whether each key exists (`serializable`: a replicated store may answer from the member
        it talks to, a few milliseconds stale, without a quorum round)."""
        ...

    def get_nowait(self, key: str, serializable: bool = True) -> bytes | None:
        """The value, or None if the key does not exist (`serializable`: as `exists_many`; False for a read
        that must see every write acknowledged before it, such as who leads before removing a job)."""
        ...

    def multi_get_nowait(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of keys that may have gone (an expired lease): None for those. A backend whose keys
        never expire reads keys known to exist (a missing one blocks, as `multi_get`)."""
        ...

    def read_appended(self, key: str, cursor: int) -> tuple[bytes, int]:
        """What was appended to `key` since `cursor` (0 at first), and the cursor for the next read."""
        ...

    def log_push(self, key: str, value: str | bytes) -> None:
        """Add `value` to the log `key` that one process reads as it grows (`log_take`): the events."""
        ...

    def log_take(self, key: str, cursor: int) -> tuple[bytes, int]:
        """What was added to the log `key` since `cursor` (0 at first), and the cursor for the next call; where
        `consumes_logs`, what it returns is taken out (its one reader keeps it), so each call costs what was
        added since the last, never the whole log."""
        ...

    @property
    def consumes_logs(self) -> bool:
        """`log_take` takes what it returns out of the store (a TCPStore queue): the log's reader keeps it."""
        ...

    # ------------------------------------------------------------------ the client and the backend
    @property
    def address(self) -> str:
        """What `controlplane.connect` takes to open another client of the same store."""
        ...

    @property
    def timeout_s(self) -> float:
        """The deadline of one blocking call."""
        ...

    @timeout_s.setter
    def timeout_s(self, value: float) -> None: ...

    @property
    def c10d(self) -> dist.Store:
        """This store as torch's c10d `Store`, for a process group's rendezvous."""
        ...

    def independent(self) -> Store:
        """A client whose blocking calls (`wait`, `get`) do not hold up this one's callers on other
        threads, nor theirs it: this client itself where the backend serves every thread on its own
        connection, a new connection otherwise."""
        ...

    def clear_job(self) -> int:
        """Remove every key of the job where they outlive it (how many); 0 where they end with the
        store's server."""
        ...

    @property
    def replicated(self) -> bool:
        """A replicated service: a call that finds no member answering is retried until its deadline
        (then StoreUnavailable), and the job outlives any one of its hosts."""
        ...

    @property
    def has_leases(self) -> bool:
        """Keys can be bound to a lease that expires with their silent writer (heartbeats, leader
        election, writes fenced on leadership); keys can therefore vanish."""
        ...

    @property
    def costly_reads(self) -> bool:
        """Each read costs the service's leader CPU: steady-state loops look less often and rely on
        blocking waits to notice changes."""
        ...

    @property
    def poll_s(self) -> float:
        """The least interval between two looks of one steady-state polling loop."""
        ...

    @property
    def abort_check_s(self) -> float:
        """How often a worker waiting on a collective asks the store whether to give up (0: at every
        look; the failure watcher's blocking wait sees the flag first in any case)."""
        ...

    @property
    def wait_slice_s(self) -> float:
        """How long one blocking `wait` of a long watch should be asked to last before it is renewed."""
        ...


class TcpStore:
    """A client of torch's `TCPStore` at `host:port`, as a `Store`.

    One client is one connection, and the torch client serializes its calls: a blocking `wait` or
    `get` on one thread holds every other thread's call on the same client until it returns. So a
    thread that blocks takes its own client (`independent()` opens one)."""

    replicated = False
    has_leases = False
    costly_reads = False
    poll_s = 0.0
    abort_check_s = 0.0
    wait_slice_s = 600.0  # a timed-out wait logs a c10d warning: wait long (a flag ends the wait anyway)

    def __init__(self, raw: dist.Store, host: str, port: int, timeout_s: float) -> None:
        self._raw = raw
        self.host, self.port = host, port
        self._timeout_s = float(timeout_s)

    # c10d operations
    def set(self, key: str, value: str | bytes) -> None:
        self._raw.set(key, value)  # type: ignore[arg-type]  # pybind takes bytes too

    def get(self, key: str) -> bytes:
        return self._raw.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._raw.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._raw.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._raw.wait(keys)
        else:
            self._raw.wait(keys, timeout)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._raw.compare_set(key, expected, desired)  # type: ignore[arg-type]

    def delete_key(self, key: str) -> bool:
        return self._raw.delete_key(key)

    def num_keys(self) -> int:
        return self._raw.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._raw.multi_get(keys)

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        self._raw.multi_set(keys, list(values))  # type: ignore[attr-defined]

    def append(self, key: str, value: str | bytes) -> None:
        self._raw.append(key, value)  # type: ignore[attr-defined]

    # polls: a TCPStore answers one key per round trip; its keys never expire
    def exists_many(self, keys: Sequence[str], serializable: bool = False) -> list[bool]:
        return [bool(self._raw.check([k])) for k in keys]

    def get_nowait(self, key: str, serializable: bool = True) -> bytes | None:  # (one server: always current)
        return bytes(self._raw.get(key)) if self._raw.check([key]) else None

    def multi_get_nowait(self, keys: Sequence[str]) -> list[bytes | None]:
        return [bytes(b) for b in self._raw.multi_get(list(keys))]

    def read_appended(self, key: str, cursor: int) -> tuple[bytes, int]:
        if not self._raw.check([key]):
            return b"", cursor
        raw = bytes(self._raw.get(key))
        return raw[cursor:], len(raw)

    # logs: a queue per log (torch's TCPStore keeps queues apart from its keys), read by popping: each look
    # costs what was added since the last, however long the log grew (an appended key is read whole every time)
    @property
    def consumes_logs(self) -> bool:
        return hasattr(self._raw, "queue_push")

    def log_push(self, key: str, value: str | bytes) -> None:
        if self.consumes_logs:
            self._raw.queue_push(f"{key}/queue", value)
        else:
            self._raw.append(key, value)  # type: ignore[attr-defined]

    def log_take(self, key: str, cursor: int) -> tuple[bytes, int]:
        if not self.consumes_logs:
            return self.read_appended(key, cursor)
        q, out = f"{key}/queue", []
        for _ in range(min(int(self._raw.queue_len(q)), LOG_TAKE_MAX)):
            try:
                out.append(bytes(self._raw.queue_pop(q, False)))
            except Exception:  # noqa: BLE001 - (emptied meanwhile: someone else popped)
                break
        return b"".join(out), cursor

    # the client
    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = float(value)
        self._raw.set_timeout(timedelta(seconds=value))

    @property
    def c10d(self) -> dist.Store:
        return self._raw

    def independent(self) -> TcpStore:
        return tcp_client(self.host, self.port, self._timeout_s)

    def clear_job(self) -> int:
        return 0  # the keys end with the store's server (the launcher's process)

    def __repr__(self) -> str:
        return f"TcpStore({self.address})"


def tcp_client(host: str, port: int, timeout_s: float = 30.0) -> TcpStore:
    """A new client of the TCPStore served at host:port."""
    import torch.distributed as dist

    raw = dist.TCPStore(host.strip("[]"), port, is_master=False, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    count_opened()
    return TcpStore(raw, host.strip("[]"), port, timeout_s)
