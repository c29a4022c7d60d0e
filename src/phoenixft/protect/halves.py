"""Two byte halves in host shared memory, each holding one packed step of a state that every data-parallel peer
holds alike (a script's model, optimizer and scheduler under DDP): the parameters' side of a snapshot.

It answers the same questions as the built-in trainer's flat parameter buffers (`train/zero.py`), for the
recovery planner and the restore: which steps it holds (`buf_step`), which is current (`step`), roll back
to a step (`select`), what a peer that lacks the state installs (`whole`), where a received copy lands
(`receive_buffer`, `adopt_received`), and the checksum of each half (`checksums`, the evidence of I2/I4).
A half is written only while it is not current (`begin_write`, then `commit`): a failure mid-write
leaves the current half, a complete recovery point, untouched.

Sizes vary: a packed state grows when an optimizer creates its state in its first step. The halves
have a capacity (shared memory is sparse: pages never written cost nothing) and grow when a step does
not fit (new segments, the committed half copied over, the old ones removed).

With `path` the halves are files under /dev/shm that outlive the worker process: a worker restarted in
place adopts them (`tags` says which half holds which step, and the capacity's generation).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from phoenixft.distributed.device import alloc
from phoenixft.protect.snapshot import INVALID, checksum

__all__ = ["ByteHalves"]

MIN_CAPACITY = 1 << 20
_STEP, _CRC, _VALID, _USED = range(4)
_CURRENT, _GEN, _CAP = 8, 9, 10


class ByteHalves:
    """Two uint8 halves with a step, checksum and used length each; one of them is current."""

    dtype = torch.uint8
    variable_size = True  # (a recovery's transfer learns the size of a step from the members that hold it)

    def __init__(self, capacity: int = MIN_CAPACITY, path: str | None = None) -> None:
        self.path = path
        self.device = torch.device("cpu")
        self.tags = alloc(12, torch.int64, path and path + ".tags")
        retained = path is not None and int(self.tags[_CAP]) > 0 and \
            all(os.path.exists(self._file(int(self.tags[_GEN]), h)) for h in (0, 1))
        if not retained:
            self.tags.zero_()
            self.tags[_STEP] = self.tags[4 + _STEP] = INVALID
            self.tags[_CAP] = max(MIN_CAPACITY, capacity)
        self.bufs = self._alloc(int(self.tags[_GEN]), int(self.tags[_CAP]))

    # ---------------------------------------------------------------- memory
    def _file(self, gen: int, half: int) -> str:
        assert self.path is not None
        return f"{self.path}.{gen}.{half}"

    def _alloc(self, gen: int, cap: int) -> list[torch.Tensor]:
        return [alloc(cap, torch.uint8, self.path and self._file(gen, h)) for h in (0, 1)]

    @property
    def capacity(self) -> int:
        return int(self.tags[_CAP])

    def reserve(self, nbytes: int) -> None:
        """Room for `nbytes` in either half: new, larger halves with what the current one holds (the other is
        dropped: it is about to be written)."""
        if nbytes <= self.capacity:
            return
        cap = max(2 * nbytes, self.capacity * 2)
        cap = (cap + MIN_CAPACITY - 1) // MIN_CAPACITY * MIN_CAPACITY
        old_gen, cur = int(self.tags[_GEN]), self.live
        gen = old_gen + 1
        bufs = self._alloc(gen, cap)
        used = self._used(cur)
        if int(self.tags[4 * cur + _VALID]) and used:
            bufs[cur][:used].copy_(self.bufs[cur][:used])
        other = 1 - cur
        self.tags[4 * other + _VALID] = 0
        self.tags[4 * other + _STEP] = INVALID
        self.bufs = bufs
        self.tags[_GEN], self.tags[_CAP] = gen, cap
        if self.path is not None:
            for h in (0, 1):
                Path(self._file(old_gen, h)).unlink(missing_ok=True)

    def unlink(self) -> None:
        """Remove the shared-memory files (the worker is leaving for good)."""
        if self.path is None:
            return
        for h in (0, 1):
            Path(self._file(int(self.tags[_GEN]), h)).unlink(missing_ok=True)
        Path(self.path + ".tags").unlink(missing_ok=True)

    # ---------------------------------------------------------------- headers
    def _used(self, half: int) -> int:
        return int(self.tags[4 * half + _USED])

    @property
    def live(self) -> int:
        return int(self.tags[_CURRENT])

    @property
    def buf_step(self) -> list[int]:
        return [int(self.tags[4 * h + _STEP]) if int(self.tags[4 * h + _VALID]) else INVALID for h in (0, 1)]

    @property
    def step(self) -> int:
        """The step of the current half (INVALID: none)."""
        return self.buf_step[self.live]

    def steps_held(self) -> list[int]:
        return [s for s in self.buf_step if s != INVALID]

    def half_with(self, step: int) -> int | None:
        for h in (self.live, 1 - self.live):
            if self.buf_step[h] == step:
                return h
        return None

    def staging(self) -> int:
        """The half the next step is written into: never the current one."""
        return 1 - self.live if self.step != INVALID else self.live

    def begin_write(self, half: int, nbytes: int) -> torch.Tensor:
        """The bytes of `half` to write a step of `nbytes` into (it is invalid until `commit`)."""
        self.reserve(nbytes)
        self.tags[4 * half + _VALID] = 0
        return self.bufs[half]

    def commit(self, half: int, step: int, used: int, crc: int = 0) -> None:
        """`half` holds `step` in its first `used` bytes (crc 0: computed when first asked); it becomes current."""
        b = 4 * half
        self.tags[b + _STEP], self.tags[b + _CRC], self.tags[b + _USED] = step, crc, used
        self.tags[b + _VALID] = 1
        self.tags[_CURRENT] = half

    def data(self, half: int) -> torch.Tensor:
        """The used bytes of `half`."""
        return self.bufs[half][: self._used(half)]

    def crc(self, half: int) -> int:
        """The checksum of `half` (computed now, and recorded, if it was not yet)."""
        b = 4 * half
        c = int(self.tags[b + _CRC])
        if c == 0 and int(self.tags[b + _VALID]):
            c = checksum(self.data(half))
            self.tags[b + _CRC] = c
        return c

    def checksums(self) -> dict[int, int]:
        """step -> checksum of every half that holds a step."""
        return {st: self.crc(h) for h, st in enumerate(self.buf_step) if st != INVALID}

    def verify(self, half: int) -> bool:
        """`half` holds a step and its bytes match the checksum recorded when it was committed."""
        b = 4 * half
        if not int(self.tags[b + _VALID]):
            return False
        recorded = int(self.tags[b + _CRC])
        return recorded == 0 or checksum(self.data(half)) == recorded

    # ---------------------------------------------------------------- recovery
    def select(self, step: int) -> bool:
        """Make the half holding `step` current (a newer step in the other is discarded); False if none does."""
        h = self.half_with(step)
        if h is None:
            return False
        self.tags[_CURRENT] = h
        if self.buf_step[1 - h] > step:
            self.tags[4 * (1 - h) + _VALID] = 0
        return True

    @property
    def whole(self) -> torch.Tensor:
        """The current half's used bytes: what a peer that lacks the state installs."""
        return self.data(self.live)

    def size_at(self, step: int) -> int:
        """Bytes of the half holding `step` (0: none does)."""
        h = self.half_with(step)
        return self._used(h) if h is not None else 0

    def params_view(self, which: int | None = None) -> torch.Tensor:
        """The used bytes of half `which` (the current one by default): what the evidence hashes."""
        return self.data(self.live if which is None else which)

    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        """Room for a peer's copy of `nbytes` in the half that is not current (invalid until `adopt_received`)."""
        half = self.staging()
        return self.begin_write(half, nbytes)[:nbytes]

    def adopt_received(self, step: int, nbytes: int, crc: int = 0) -> None:  # (nbytes: what was received)
        """The buffer of `receive_buffer` holds a peer's copy of `step`: it becomes current, the other half
        is dropped (it held no step the plan resumes from)."""
        half = self.staging()
        self.commit(half, step, nbytes, crc)
        self.tags[4 * (1 - half) + _VALID] = 0

    def install(self, whole: torch.Tensor, step: int, crc: int = 0) -> None:
        n = whole.numel()
        self.receive_buffer(n).copy_(whole.view(torch.uint8).reshape(-1))
        self.adopt_received(step, n, crc)

    def invalidate(self) -> None:
        """Nothing held (a fresh start)."""
        for h in (0, 1):
            self.tags[4 * h + _VALID] = 0
            self.tags[4 * h + _STEP] = INVALID
