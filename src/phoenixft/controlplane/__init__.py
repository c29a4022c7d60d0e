"""The control-plane seam: where the coordinator, agents and workers share state.

Every process is handed a `Store` (store.py: one typed protocol) opened by `connect(addr)`. Two
backends, chosen by `--control-plane`:

- `tcpstore` (default): torch's `TCPStore`, served by the launcher's process (zero set-up; the
  job depends on that process and its host), reached through `TcpStore`;
- `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`: an etcd cluster (`EtcdStore`): no single process or
  host whose loss ends the job; `etcd` alone starts a local 3-member cluster for the run.

Callers never test which backend they hold: they ask the store (`replicated`, `has_leases`,
`costly_reads`, `poll_s`, `abort_check_s`, `wait_slice_s`, `independent()`, `clear_job()`) or this
package (`describe(addr)`, `validate_spec`, `provision_cluster`). What only a cluster with leases
has is reached through the helpers here, which fall back to plain store calls elsewhere:
`Heartbeat` (a key that expires with its writer), `Election` (lease-based leader election, for
standby coordinators), `guarded_set` (writes that succeed only while the writer still leads),
`LogReader` (an incremental read of an appended key), `exists_many`, `get_nowait`.

Store clients per process (`clients_opened()` counts them). A TCPStore client is one connection whose
calls the torch client serializes: a blocking `wait` on one thread holds every other thread's call on
it. So, on a TCPStore:

- a worker opens 4 (3 before it first builds process groups, 3 without protection): its own (the
  training thread's polls and writes, and the rendezvous of its process groups), the failure
  watcher's (one blocking `wait` on the epoch's failure flag, for ever), a side client (the
  epoch-flag polls while the rendezvous blocks its own; after an abort it becomes the worker's own,
  the blocked one staying with the abandoned build, so it cannot be shared with a thread that must
  never block) and one shared by its replication and persistent-tier threads (short non-blocking
  calls only: `check`, `append`);
- an agent opens 1 (a new one after a failed call; the workers it forks open their own); the
  coordinator 2 (its loop's, and the blocking watch of the failure flags); the launcher 1;
  `phoenixft status` 1.

An `EtcdStore` serves every thread of its process on that thread's own connection (a blocking wait
opens a watch connection of its own), so `independent()` is the client itself and every process
opens 1 (the launcher 2: a bounded probe of the cluster before the run starts).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phoenixft.controlplane import keys
from phoenixft.controlplane.store import Store, StoreError, StoreUnavailable, TcpStore, count_opened

if TYPE_CHECKING:
    from phoenixft.controlplane.address import (
        ProvisionedCluster,
        StoreAddress,
        connect,
        describe,
        provision_cluster,
        remote_spec_problem,
        validate_spec,
    )
    from phoenixft.controlplane.etcd_store import EtcdError, EtcdStore, EtcdUnavailable

# The store clients import torch (TCPStore; `EtcdStore` is a c10d store too): loaded on first use, so that a
# command refused for its flags or its token (`phoenixft.controlplane.auth` is a submodule) answers at once.
_LAZY = {"ProvisionedCluster": "address", "StoreAddress": "address", "connect": "address", "describe": "address",
         "provision_cluster": "address", "remote_spec_problem": "address", "validate_spec": "address",
         "EtcdError": "etcd_store", "EtcdStore": "etcd_store", "EtcdUnavailable": "etcd_store"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def _etcd() -> Any:
    """The etcd client module (imports torch: only once a store is in hand, which did already)."""
    from phoenixft.controlplane import etcd_store

    return etcd_store

__all__ = ["Store", "StoreError", "StoreUnavailable", "TcpStore", "connect", "describe", "StoreAddress",
           "validate_spec", "remote_spec_problem", "provision_cluster", "ProvisionedCluster", "Heartbeat",
           "Election", "guarded_set", "LogReader", "exists_many", "get_nowait", "multi_get_nowait", "EtcdStore",
           "EtcdError", "EtcdUnavailable", "LEADER_KEY", "poll_interval", "clients_opened"]

LEADER_KEY = keys.LEADER


def clients_opened() -> int:
    """How many store clients this process has opened (`connect`, `Store.independent`)."""
    return count_opened(0)


def poll_interval(store: Store, base_s: float) -> float:
    """How often a loop that would look every `base_s` should poll `store`."""
    return max(base_s, store.poll_s)


def exists_many(store: Store, names: Sequence[str]) -> list[bool]:
    """Whether each key exists (a poll: one serializable request on a cluster)."""
    return store.exists_many(names, serializable=True)


def get_nowait(store: Store, key: str) -> bytes | None:
    return store.get_nowait(key)


def multi_get_nowait(store: Store, names: Sequence[str]) -> list[bytes | None]:
    """Values of keys that may have gone (an expired lease): None for those (see `Store`)."""
    return store.multi_get_nowait(names)


class LogReader:
    """Read what was added to the log `key` since the last read (`Store.log_take`: the events)."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key
        self._cursor = 0

    def read_bytes(self) -> bytes:
        raw, self._cursor = self.store.log_take(self.key, self._cursor)
        return bytes(raw)

    def read(self) -> str:
        return self.read_bytes().decode(errors="replace")  # (anyone can append bytes that are not UTF-8)


class Heartbeat:
    """`beat(value)` writes the key; on a store with leases the key is bound to a lease of `ttl_s`
    that each beat refreshes, so the store deletes it once its writer has been silent for the TTL (a
    dead host's heartbeat disappears without anyone judging clocks)."""

    def __init__(self, store: Store, key: str, ttl_s: float) -> None:
        self.store, self.key = store, key
        self.ttl = max(2, math.ceil(ttl_s))
        self._lease = 0

    def beat(self, value: str | bytes) -> None:
        if not isinstance(self.store, _etcd().EtcdStore):
            self.store.set(self.key, value)
            return
        if self._lease and self.store.lease_keepalive(self._lease, timeout_s=self.ttl) > 0:
            self.store.put_leased(self.key, value, self._lease)
            return
        self._lease = self.store.lease_grant(self.ttl)
        self.store.put_leased(self.key, value, self._lease)


def guarded_set(store: Store, guard: Election | None, names: Sequence[str], values: Sequence[str | bytes]) -> bool:
    """Write `names` atomically if `guard` (an `Election` or None) still leads; False if not."""
    if guard is None or not isinstance(store, _etcd().EtcdStore):
        store.multi_set(list(names), list(values))
        return True
    ops = [{"request_put": {"key": k, "value": v}} for k, v in zip(names, values, strict=True)]
    r = store.txn([{"key": guard.key, "target": "VALUE", "result": "EQUAL", "value": guard.ident}], ops)
    return bool(r.get("succeeded"))


class Election:
    """Leader election on a store's leases (`Store.has_leases`): the leader holds `key` bound to its lease and keeps the
    lease alive from a thread; a standby waits for the key to go (its leader's lease expired:
    killed, stopped or cut off for `ttl_s`) and takes it in one transaction. `on_lost` runs if this
    leader's lease expires under it (it must stop acting at once: another may lead already)."""

    def __init__(self, store: Store, ident: str = "", ttl_s: int = 2, key: str = LEADER_KEY,
                 on_lost: Callable[[], None] | None = None) -> None:
        if not isinstance(store, _etcd().EtcdStore):
            raise ValueError("leader election needs the etcd control plane (--control-plane etcd://...)")
        self.store: EtcdStore = store
        self.key = key
        self.ttl = max(1, int(ttl_s))
        self.ident = ident or f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.on_lost = on_lost
        self.lease = 0
        self.leading = False
        self.last_contact = time.monotonic()  # when etcd last answered a campaign
        self._stop = threading.Event()

    def leader(self) -> str | None:
        v = self.store.get_nowait(self.key)
        return v.decode() if v is not None else None

    def campaign(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Block until this process leads (True) or `timeout_s` passes / `should_stop()` (False).

        A cluster that does not answer in time (a member killed, a raft election under way, even its
        quorum lost for a while) is looked at again until then, never an error: standing by outlives
        what etcd outlives. `last_contact` says when etcd last answered (monotonic clock), for a
        caller that gives up on a cluster gone for good."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not should_stop():
            per_call = max(0.5, deadline - time.monotonic())
            try:
                if not self.lease or self.store.lease_keepalive(self.lease, timeout_s=per_call) <= 0:
                    self.lease = self.store.lease_grant(self.ttl, timeout_s=per_call)
                r = self.store.txn([{"key": self.key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                                   [{"request_put": {"key": self.key, "value": self.ident, "lease": str(self.lease)}}],
                                   [{"request_range": {"key": self.key}}], timeout_s=per_call)
            except (_etcd().EtcdUnavailable, OSError):
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            except _etcd().EtcdError as e:
                if "lease not found" not in str(e):
                    raise
                self.lease = 0  # it expired between its keep-alive and the transaction: take a new one
                continue
            self.last_contact = time.monotonic()
            if r.get("succeeded") or self._holder(r) == self.ident:  # (a retried transaction that went through)
                self.leading = True
                threading.Thread(target=self._keep, name="phoenixft-election", daemon=True).start()
                return True
            # someone leads: look again after a fraction of the TTL (its lease ends at most ttl after its death)
            time.sleep(min(0.2, self.ttl / 8))
        return False

    @staticmethod
    def _holder(r: dict[str, Any]) -> str | None:
        """Who holds the key, from a failed campaign transaction's range answer."""
        import base64

        try:
            kvs = r["responses"][0]["response_range"].get("kvs") or []
            return base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None
        except (KeyError, IndexError, TypeError, ValueError):
            return None

    def _keep(self) -> None:
        period = self.ttl / 4
        last_ok = time.monotonic()
        while not self._stop.wait(period):
            try:
                left = self.store.lease_keepalive(self.lease, timeout_s=period)
            except (_etcd().EtcdError, _etcd().EtcdUnavailable, OSError):
                left = -1
            now = time.monotonic()
            if left > 0:
                last_ok = now
            if left == 0 or now - last_ok >= self.ttl * 0.75:  # expired, or may expire before we hear back
                self.leading = False
                if self.on_lost is not None:
                    self.on_lost()
                return

    def resign(self) -> None:
        self._stop.set()
        if self.lease:
            try:
                self.store.lease_revoke(self.lease)
            except (_etcd().EtcdError, _etcd().EtcdUnavailable):
                pass
        self.leading = False
