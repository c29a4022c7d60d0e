"""The store a process group's rendezvous runs through, its values sealed with the run key.

Every epoch's groups meet through the job's store (gloo: each rank publishes the addresses of its
pairs under `e{epoch}/{group}/0/{rank}`; NCCL: rank 0 publishes its unique id). Whoever can write the
store could otherwise point a rank's connections at an address of its choosing, or hand it another
communicator. `RendezvousStore` wraps the group's `PrefixStore`: what a rank publishes is sealed
(controlplane/sealed.py, the key's full name bound into the MAC, so a value of another epoch or group
does not verify here either), and what it reads must verify. A value that does not verify fails the
group's build with a clear error, logged once; the recovery that follows builds the next epoch on a
fresh prefix. So a stranger can make a rendezvous fail, never redirect it.

Torch calls back into this class from C++ (gloo's rendezvous uses `set`, `wait` and `get`); the other
methods pass through unchanged. Without a bound run key (a unit test of the groups alone) nothing is
wrapped: `rendezvous_store` returns the prefix store itself.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from phoenixft.controlplane import sealed

__all__ = ["RendezvousStore", "rendezvous_store"]


def rendezvous_store(store: dist.Store, prefix: str) -> dist.Store:
    """`PrefixStore(prefix, store)`, sealed when this process has a run key bound."""
    inner = dist.PrefixStore(prefix, store)
    return RendezvousStore(inner, prefix) if sealed.bound() else inner


class RendezvousStore(dist.Store):
    """`inner` (a group's prefix store) with sealed values; `prefix` names the group in every MAC."""

    def __init__(self, inner: dist.Store, prefix: str) -> None:
        super().__init__()
        self.inner: Any = inner  # (torch's stubs type values as str; bytes are what it passes and takes)
        self.prefix = prefix
        self.set_timeout(cast(Any, inner).timeout)  # (torch's default otherwise: 300 s)

    def _name(self, key: str) -> str:
        return f"rendezvous/{self.prefix}/{key}"  # (the name its MAC binds: group and key)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, sealed.seal(self._name(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        value = sealed.unseal(self._name(key), raw)
        if value is None:
            raise RuntimeError(f"the rendezvous value {self.prefix}/{key} is not sealed with this run's key "
                               f"(something other than the job wrote it): this group is not built")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
