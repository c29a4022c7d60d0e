"""Ping-pong snapshot buffers in host shared memory.

`PingPong` holds two halves of a fixed-size float32 payload plus a header per half
(step, checksum, valid). At any moment one half is *committed* (a complete, verified recovery
point) and the other is *staging*: a failure in the middle of writing the staging half can never
damage the committed one.

- `ShardState` is a worker's own optimizer shard: rows [master, optimizer state...]. The
  optimizer works on `dev`, the shard's working copy (device.py): on CPU that is the host halves
  themselves, so the optimizer step reads the committed half and writes its result straight into
  the staging half and the local snapshot costs no copy at all; on CUDA it is a pair of halves on
  the GPU, and the updated half is copied into the (pinned) host half on a copy stream. Either
  way the step's half is committed only once that copy completed (`commit_when`): a header is
  never read before the copy it describes has settled.
- `Holding` is a replica of a peer's shard that this worker keeps: the shard's payload rows
  (with fp32 parameters only the optimizer state: the parameters are already redundant across
  data-parallel peers; with bf16 parameters the fp32 master weights too).

With `path` set the buffers are files under /dev/shm mapped MAP_SHARED, so they outlive the
worker process (the node agent can restart a crashed worker in place from them).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import xxhash

from phoenixft.distributed.device import Device, Pending, alloc

__all__ = ["PingPong", "ShardState", "Holding", "checksum", "StreamChecksum", "alloc", "INVALID"]

INVALID = -1
_MASK63 = (1 << 63) - 1


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 of a contiguous tensor's bytes, as a non-negative int64 (it lives in int64 headers).

    Chosen by measured speed on this CPU over 43 MB (DESIGN.md: zlib.crc32 4.2 GB/s, CRC32C 13-15
    GB/s, xxh3 27 GB/s); a 63-bit hash detects flipped bits and torn copies at least as well as CRC32."""
    arr: Any = t.contiguous().view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(memoryview(arr)) & _MASK63


class StreamChecksum:
    """`checksum` of a tensor fed in consecutive ranges (e.g. as a transfer's chunks arrive): the same
    value as `checksum(whole)`, with no second pass over the bytes once the last range is in."""

    def __init__(self, whole: torch.Tensor) -> None:
        self._bytes: Any = whole.view(-1).view(torch.uint8).numpy()
        self._per = whole.element_size()
        self._h = xxhash.xxh3_64()
        self._next = 0

    def update(self, lo: int, hi: int) -> None:
        """Feed elements [lo, hi): they must follow the ones fed before."""
        if lo != self._next:
            raise ValueError(f"ranges must be consecutive: expected {self._next}, got {lo}")
        self._h.update(memoryview(self._bytes[lo * self._per : hi * self._per]))
        self._next = hi

    def value(self, numel: int) -> int | None:
        """The checksum, or None if fewer than `numel` elements were fed."""
        return self._h.intdigest() & _MASK63 if self._next == numel else None


H_STEP, H_CRC, H_VALID, H_SHARD, H_SHARDS = range(5)


class PingPong:
    """Two halves of `rows x numel` float32 plus a header per half: step, checksum, valid, and the
    logical shard the half holds (index, count), so that what a half holds is data, not inference."""

    def __init__(self, rows: int, numel: int, path: str | None = None) -> None:
        self.rows, self.numel = rows, numel
        self.path = path  # the shared files are `path`.data and `path`.hdr (None: private memory)
        self.data = alloc(2 * rows * numel, torch.float32, path and path + ".data").view(2, rows, numel)
        self.header = alloc(2 * 5, torch.int64, path and path + ".hdr").view(2, 5)
        self._verified: dict[int, tuple[int, int]] = {}  # half -> (step, crc) it was last verified at
        if path is None or int(self.header[:, H_VALID].sum()) == 0 and int(self.header[:, H_STEP].sum()) == 0:
            self.header[:, H_STEP] = INVALID
            self.header[:, H_CRC] = 0
            self.header[:, H_VALID] = 0
            self.header[:, H_SHARD] = INVALID
            self.header[:, H_SHARDS] = 0

    def _settle(self) -> None:
        """Complete what must be complete before a header is read or written (ShardState: a copy)."""

    # -- header helpers
    def step_of(self, half: int) -> int:
        self._settle()
        return int(self.header[half, 0]) if int(self.header[half, 2]) else INVALID

    def steps(self) -> list[int]:
        """Steps held by valid halves, newest first."""
        return sorted((s for s in (self.step_of(0), self.step_of(1)) if s != INVALID), reverse=True)

    def half_with(self, step: int) -> int | None:
        for h in (0, 1):
            if self.step_of(h) == step:
                return h
        return None

    def newest(self) -> int | None:
        s = self.steps()
        return self.half_with(s[0]) if s else None

    def staging(self) -> int:
        """The half to write next: never the newest valid one."""
        n = self.newest()
        return 0 if n is None else 1 - n

    def begin_write(self, half: int) -> None:
        self._settle()
        self._verified.pop(half, None)
        self.header[half, 2] = 0  # torn until commit

    def commit(self, half: int, step: int, crc: int, shard: tuple[int, int] | None = None) -> None:
        """Mark `half` complete for `step` (crc 0 = not computed yet); `shard` = (index, count)."""
        self._settle()
        self._commit(half, step, crc, shard)

    def _commit(self, half: int, step: int, crc: int, shard: tuple[int, int] | None) -> None:
        self.header[half, H_STEP] = step
        self.header[half, H_CRC] = crc
        if shard is not None:
            self.header[half, H_SHARD], self.header[half, H_SHARDS] = shard
        self.header[half, H_VALID] = 1

    def shard_of(self, half: int) -> tuple[int, int]:
        """(index, count) of the logical shard this half holds; (-1, 0) if unknown."""
        return int(self.header[half, H_SHARD]), int(self.header[half, H_SHARDS])

    def known_crc(self, half: int) -> int:
        """The committed checksum of `half`, computed now (and recorded) if it was not yet."""
        self._settle()
        crc = int(self.header[half, H_CRC])
        if crc == 0:
            crc = checksum(self.payload(half))
            self.header[half, H_CRC] = crc
        return crc

    def invalidate_after(self, step: int) -> None:
        for h in (0, 1):
            if self.step_of(h) > step:
                self.header[h, 2] = 0

    def verify(self, half: int) -> bool:
        self._settle()
        ok = bool(int(self.header[half, 2])) and checksum(self.payload(half)) == int(self.header[half, 1])
        if ok:
            self._verified[half] = (int(self.header[half, H_STEP]), int(self.header[half, H_CRC]))
        else:  # (bytes that changed at rest since an earlier verification are not "verified" any more)
            self._verified.pop(half, None)
        return ok

    def verified(self, half: int) -> bool:
        """`half` passed `verify` and was not rewritten since (its header still says the same step and
        checksum): a recovery's sender need not hash it again right after its descriptor did (the
        receiver checks every byte it gets against the committed checksum anyway)."""
        return bool(int(self.header[half, H_VALID])) and \
            self._verified.get(half) == (int(self.header[half, H_STEP]), int(self.header[half, H_CRC]))

    def verified_half(self, step: int) -> int | None:
        """A half that holds `step` and matches its committed checksum, or None. Both halves can hold the same
        step (a replication repeated after a recovery, or at the start): one of them damaged must not hide the
        other, which the descriptor offered (it verifies every half)."""
        for h in (0, 1):
            if self.step_of(h) == step and (self.verified(h) or self.verify(h)):
                return h
        return None

    def payload(self, half: int) -> torch.Tensor:
        """What the checksum covers (and what is replicated)."""
        return self.data[half]

    def crc_of(self, half: int) -> int:
        self._settle()
        return int(self.header[half, 1])


class ShardState(PingPong):
    """Own optimizer shard: rows [fp32 master weights, optimizer state...] (AdamW: exp_avg, exp_avg_sq).

    The replicated payload is the optimizer state, rows `payload_from`.. : from row 1 when the
    parameters are fp32 (every data-parallel peer already holds the master weights), from row 0
    with bf16 parameters (the fp32 master weights exist only in the shard, so they are protected).

    `dev` is the working copy the optimizer reads and writes, half for half like `data`: the host
    halves themselves on CPU, a pair of device halves on CUDA (`device.working_copy`). A step
    writes `dev[dst]`, starts its copy into `data[dst]` (`device.d2h`) and, once the step is
    complete, registers the commit with `commit_when`; the header of `dst` is written only when
    the copy completed, and any read of a header first settles it (waiting at most
    `SETTLE_TIMEOUT_S`; a copy that never completes leaves the half uncommitted). At most one copy
    is in flight, so a device half is never rewritten while it is still being copied out.
    After a restore, `load_device(step)` copies the host half holding `step` back (H2D)."""

    SETTLE_TIMEOUT_S = 60.0
    _pending: tuple[int, int, tuple[int, int] | None, Pending] | None = None

    def __init__(self, numel: int, path: str | None = None, rows: int = 3, payload_from: int = 1,
                 device: Device | None = None, pin: bool | None = None) -> None:
        self.device = device or Device("cpu")
        super().__init__(rows, numel, path)
        if self.device.is_cuda and (path is not None if pin is None else pin):
            # only halves that protection copies out and replicates from (a shared-memory `path`) are
            # page-locked: pinning memory nothing is copied into costs locked RAM for nothing
            self.data = self.device.pin(self.data)
        self.payload_from = payload_from
        self.dev = self.device.working_copy(self.data)
        self._lock = threading.RLock()
        self._pending: tuple[int, int, tuple[int, int] | None, Pending] | None = None

    def payload(self, half: int) -> torch.Tensor:
        return self.data[half, self.payload_from :]

    # -- the working copy and its copy into the host halves
    def copy_out(self, half: int) -> Pending:
        """Start copying the working copy's `half` into the host's `half` (a no-op on CPU)."""
        return self.device.d2h(self.data[half], self.dev[half])

    def commit_when(self, half: int, step: int, shard: tuple[int, int] | None, copy: Pending) -> None:
        """Commit `half` for `step` once `copy` (its D2H copy) completed: now if it has."""
        with self._lock:
            self._settle()
            if copy.done():
                self._commit(half, step, 0, shard)
            else:
                self._pending = (half, step, shard, copy)

    def abandon(self, copy: Pending) -> None:
        """A step failed after its copy started: let the copy finish (it writes the staging half,
        which must not be written by anyone else meanwhile) and commit nothing."""
        with self._lock:
            if not copy.wait(self.SETTLE_TIMEOUT_S):
                print(f"phoenixft: a snapshot copy did not complete in {self.SETTLE_TIMEOUT_S:.0f}s", file=sys.stderr)

    def _settle(self) -> None:
        if self._pending is None:  # the common case, and always on CPU: no lock taken
            return
        with self._lock:
            p = self._pending
            if p is None:
                return
            half, step, shard, copy = p
            self._pending = None
            if copy.wait(self.SETTLE_TIMEOUT_S):
                self._commit(half, step, 0, shard)
            else:
                print(f"phoenixft: the snapshot copy of step {step} did not complete in "
                      f"{self.SETTLE_TIMEOUT_S:.0f}s; it stays uncommitted", file=sys.stderr)

    def load_device(self, step: int) -> bool:
        """After a restore wrote the host halves: the working copy's half of `step` from its host
        half (H2D on CUDA; nothing to do on CPU, where they are the same memory). False if no
        committed half holds `step` (the invariant check after the restore reports it)."""
        half = self.half_with(step)
        if half is None:
            return False
        self.device.h2d(self.dev[half], self.data[half])
        return True


class Holding(PingPong):
    """A replica of a peer's shard: its payload rows (e.g. [exp_avg, exp_avg_sq])."""

    def __init__(self, numel: int, path: str | None = None, rows: int = 2) -> None:
        super().__init__(rows, numel, path)
