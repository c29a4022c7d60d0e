"""The shared-memory backend: a holder on its owner's host reads the replica from the owner's shard file.

A worker's own optimizer shard lives in a host shared-memory file (`ShardState`, snapshot.py). When a
holder runs on the same host as the shard's owner (same boot, same network and mount namespaces, the
same /dev/shm), it does not need the bytes sent over a socket: it reads them straight from the owner's
committed half into its own staging half, one copy in all (loopback TCP costs a copy into the kernel
and one out of it, plus the stack's work, on the same cores that train). This is the same-host path
NCCL takes with its SHM transport; across hosts (or network namespaces, which is how the multi-host
tests model hosts) the pair goes over TCP (tcp.py).

Why reading the owner's half needs no lock: the owner rewrites the half that holds step s only in the
optimizer of step s+2. Every rank waits for its replication of step s (`Replicator.wait`) before it
enters the gradient reduce-scatter of step s+1, a collective, so a holder has finished its copy of
step s before any rank can reach step s+1's optimizer, let alone s+2's. A recovery aborts the jobs
first and starts a new link handshake. The copy is committed with the owner's checksum and, like
every replica, verified against it before a recovery offers or uses it.

What an owner tells its holders at the start of an epoch (`Hello`: host key, file, byte offsets of
both halves) is exchanged by the link handshake (routes.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from phoenixft.protect.transport.base import ReplicaTransport

__all__ = ["host_key", "Hello", "PeerShard", "ShmTransport", "shard_hello"]

PATH_CHARS = 512  # the longest shard file path a hello carries (longer: that pair goes over TCP)
_HEAD = 6  # host key, shm ok, offset of half 0, offset of half 1, numel, path length
_MASK63 = (1 << 63) - 1
_MAX_READ = 1 << 30  # bytes per pread call (Linux returns at most ~2 GiB per call)


@functools.lru_cache(maxsize=1)
def host_key() -> int:
    """An int63 naming this host's shared memory as this process sees it: the boot, the network and
    mount namespaces and /dev/shm itself. Two processes with the same key read the same files there."""
    parts: list[str] = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(os.uname().nodename)
    for p in ("/proc/self/ns/net", "/proc/self/ns/mnt", "/dev/shm"):
        try:
            st = os.stat(p)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("-")
    return int.from_bytes(hashlib.sha256("|".join(parts).encode()).digest()[:8], "little") & _MASK63


@dataclass(frozen=True)
class Hello:
    """What an owner tells each holder of its shard at the start of an epoch."""

    host: int
    path: str  # the file holding both halves ("" if the shard is not in a shared file)
    offsets: tuple[int, int]  # byte offset of each half's payload in that file
    numel: int

    def encode(self) -> torch.Tensor:
        raw = self.path.encode()
        ok = bool(self.path) and len(raw) <= PATH_CHARS
        t = torch.zeros(_HEAD + PATH_CHARS, dtype=torch.int64)
        t[:_HEAD] = torch.tensor([self.host, int(ok), self.offsets[0], self.offsets[1], self.numel,
                                  len(raw) if ok else 0])
        if ok:
            t[_HEAD : _HEAD + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        return t

    @classmethod
    def decode(cls, t: torch.Tensor) -> Hello:
        host, ok, off0, off1, numel, n = (int(x) for x in t[:_HEAD].tolist())
        path = bytes(int(x) for x in t[_HEAD : _HEAD + n].tolist()).decode(errors="replace") if ok else ""
        return cls(host=host, path=path, offsets=(off0, off1), numel=numel)

    @staticmethod
    def numel_of() -> int:
        return _HEAD + PATH_CHARS


def shard_hello(state: Any) -> Hello:
    """The hello of a `ShardState`: its file (if it is a shared file) and its payload's byte offsets."""
    path = getattr(state, "path", None)
    base = state.data
    offsets = []
    ok = path is not None and base.is_contiguous()
    for h in (0, 1):
        p = state.payload(h)
        ok = ok and p.is_contiguous()
        offsets.append((p.data_ptr() - base.data_ptr()) if ok else 0)
    numel = state.payload(0).numel()
    return Hello(host=host_key(), path=f"{path}.data" if ok else "", offsets=(offsets[0], offsets[1]), numel=numel)


class PeerShard:
    """An owner's shard file, opened read-only by a holder on the same host, for one epoch."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.fd = os.open(hello.path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(self.fd).st_size
        need = max(hello.offsets) + hello.numel * 4
        if size < need:
            os.close(self.fd)
            raise OSError(f"{hello.path}: {size} bytes, the shard needs {need}")

    def read_into(self, dst: torch.Tensor, half: int) -> None:
        """Copy the owner's payload of `half` into `dst` (float32, contiguous, numel of the shard)."""
        if half not in (0, 1) or dst.numel() != self.hello.numel or not dst.is_contiguous():
            raise ValueError(f"replica read: half {half}, {dst.numel()} elements, shard {self.hello.numel}")
        arr: Any = dst.view(-1).view(torch.uint8).numpy()
        mv = memoryview(arr)
        off, done, total = self.hello.offsets[half], 0, len(mv)
        while done < total:
            n = os.preadv(self.fd, [mv[done : min(total, done + _MAX_READ)]], off + done)
            if n <= 0:
                raise OSError(f"{self.hello.path}: ended after {done} of {total} bytes")
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmTransport(ReplicaTransport):
    """A pair whose holder reads the owner's committed half itself: nothing travels in the collectives.

    The holder's end holds the owner's file (`reader`); the owner's end holds nothing (`reader` None)."""

    name: ClassVar[str] = "shm"
    over_group: ClassVar[bool] = False

    def __init__(self, reader: PeerShard | None = None) -> None:
        self.reader = reader

    def send(self, dst: int, part: torch.Tensor) -> dict[int, torch.Tensor]:
        return {}

    def receive(self, src: int, part: torch.Tensor) -> tuple[dict[int, int], torch.Tensor | None]:
        return {}, None

    def complete(self, dst: torch.Tensor, half: int) -> int:
        if self.reader is None:
            raise ValueError("replica read: the owner's end of a shared-memory pair reads nothing")
        self.reader.read_into(dst, half)
        return dst.numel() * dst.element_size()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
