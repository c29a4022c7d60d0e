"""A script's rank state as protection and recovery see it: the role the built-in `Trainer` plays.

The core (core/member.py, protect/, recovery/) reads a rank's state through a few attributes: `flat`, the
side every data-parallel peer holds alike (its steps, a rollback, what a peer installs: here
`ByteHalves` of the packed replicated nest), and `state`, the rank's own shard (a `ShardState` ping-pong
of one row whose payload is the packed private nest, replicated to peers by the redundancy scheme).
`ScriptState` keeps both in host shared memory (they outlive a crashed worker: its restart in place
adopts them) and moves the live objects (api/tracked.py) in and out of them:

- `snapshot(step)`: both nests packed into the halves that are not current, then committed;
- `load(step)`: the halves of `step` back into the live objects (after a recovery chose it);
- `private_bytes` is the shard's capacity in bytes: the same on every rank of an epoch (the scheme's
  copies have one size), agreed when the job starts and raised by a recovery when a step outgrows it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phoenixft.api.copier import Copier
from phoenixft.api.packing import Packer, _copy_all, unpack, used_bytes
from phoenixft.api.tracked import Tracked
from phoenixft.distributed.device import Device
from phoenixft.protect.halves import ByteHalves
from phoenixft.protect.snapshot import H_VALID, INVALID, ShardState, checksum

__all__ = ["ScriptState", "ScriptParams", "Outgrown", "DEFAULT_PRIVATE_BYTES", "capacity_for"]

DEFAULT_PRIVATE_BYTES = 1 << 16  # (every step replicates the whole capacity: kept small where the own side is)
_ALIGN = 1 << 16


def capacity_for(nbytes: int) -> int:
    """The shard capacity that holds `nbytes` with room to grow (twice, at least 64 KiB, in 64 KiB steps)."""
    cap = max(DEFAULT_PRIVATE_BYTES, 2 * nbytes)
    return (cap + _ALIGN - 1) // _ALIGN * _ALIGN


class Outgrown(Exception):  # noqa: N818 - a condition, not an error of the user's
    """A step's private state does not fit the epoch's shard capacity: the ranks agree on a larger one in a
    recovery (every rank's shard and its copies must have one size)."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"this rank's own state grew to {needed} bytes")
        self.needed = needed


class ScriptParams(ByteHalves):
    """The replicated side, with the two attributes of a flat model the scheme sizes its copies by."""

    shard_numel = 0  # float32 elements of the private shard (the scheme's copies)
    shards = 1  # the data-parallel width of the partition


class ScriptState:
    """One rank's snapshot halves for a user's script, and its live objects."""

    payload_rows = 1
    payload_from = 0
    rows = 1
    segs: list[Any] = []
    full_numel = 0

    def __init__(self, device: Device, private_bytes: int = DEFAULT_PRIVATE_BYTES) -> None:
        self.device = device
        self.tracked = Tracked()
        self.private_bytes = private_bytes
        self.flat: ScriptParams = ScriptParams()
        self.state: ShardState = ShardState(private_bytes // 4, rows=1, payload_from=0)
        self._base: str | None = None
        self._rep_packer, self._priv_packer = Packer(), Packer()
        self._copier = Copier()
        self.async_copy = True  # the parameters' and optimizer state's copy off the training thread
        self.loaded: int | None = None  # the step the live objects hold (None: as the script built them)

    # ---------------------------------------------------------------- memory
    def partition(self, world: int, shm: str | None, step: int = 0) -> None:  # noqa: ARG002 - the trainer's signature
        """The halves of a `world`-way data-parallel partition, under `shm` (adopted where they exist)."""
        if shm != self._base or self.flat.path is None and shm is not None:
            old = self.flat
            self.flat = ScriptParams(path=shm and shm + "-rep")
            if self.flat.step == INVALID and old.step != INVALID:  # (a new generation keeps what the old one held)
                for st in sorted(old.steps_held()):
                    h = old.half_with(st)
                    assert h is not None
                    self.flat.install(old.data(h), st, old.crc(h))
            self._base = shm
        self.flat.shards = world
        self._shard(self.private_bytes)

    def _shard(self, nbytes: int) -> None:
        """The private shard's halves with a capacity of `nbytes`; committed halves of a smaller shard kept."""
        old = self.state
        numel = nbytes // 4
        if old.numel == numel and (old.path is not None) == (self._base is not None) and \
                (self._base is None or old.path == f"{self._base}-priv{nbytes}"):
            self.flat.shard_numel = numel
            return
        new = ShardState(numel, self._base and f"{self._base}-priv{nbytes}", rows=1, payload_from=0)
        if not any(int(new.header[h, H_VALID]) for h in (0, 1)):
            for h in (0, 1):
                st = old.step_of(h)
                if st == INVALID or old.numel > numel:
                    continue
                new.begin_write(h)
                new.data[h, 0, : old.numel].copy_(old.data[h, 0])
                new.commit(h, st, checksum(new.payload(h)), old.shard_of(h))
        if old.path is not None and old.path != new.path:
            for suffix in (".data", ".hdr"):
                Path(old.path + suffix).unlink(missing_ok=True)
        self.state, self.private_bytes = new, nbytes
        self.flat.shard_numel = numel

    def resize_private(self, nbytes: int) -> None:
        self._shard(nbytes)

    def unlink(self) -> None:
        """Remove this rank's shared memory (it leaves the job for good)."""
        self.flat.unlink()
        if self.state.path is not None:
            for suffix in (".data", ".hdr"):
                Path(self.state.path + suffix).unlink(missing_ok=True)

    # ---------------------------------------------------------------- what the core asks
    def steps_held(self) -> list[int]:
        return self.flat.steps_held()

    def prefault(self) -> None:
        """Nothing to touch ahead: a spare's halves are written as its promotion receives them."""

    def resume(self, step: int) -> None:
        """After a restore: the live objects take step `step` (now, or once the script has built them)."""
        self.loaded = None
        self._pending = step

    def private_used(self, half: int) -> int:
        return used_bytes(self.state.data[half, 0].view(torch.uint8))

    # ---------------------------------------------------------------- snapshots
    def snapshot(self, step: int, rank: int, world: int, before_copy: Callable[[], None] | None = None) -> None:
        """Pack the live objects as `step` into the halves that are not current. The own side and the small
        tensors of the replicated side are copied now; the models' parameters and the optimizers' state, which
        only an optimizer's `step()` changes, are copied on the copy thread while the next step computes, and
        the replicated half commits once they are in (`settle()` waits for it: before the next update, the next
        snapshot and any recovery). Outgrown if the own side does not fit this epoch's shard. `before_copy` is
        called between the own side's commit and the start of the copy (fault injection's `phase=copy`)."""
        self.settle()
        priv = self._priv_packer.prepare(self.tracked.private())
        if priv.end > self.private_bytes:
            raise Outgrown(priv.end)
        rep_nest = self.tracked.replicated(step)
        n_late = self.tracked.late_tensors(rep_nest)
        rep = self._rep_packer.prepare(rep_nest)
        h = self.flat.staging()
        buf = self.flat.begin_write(h, rep.end)
        late: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

        def copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
            _copy_all(dst[n_late:], src[n_late:])
            late.append((dst[:n_late], src[:n_late]))

        used = self._rep_packer.write(rep, buf, copy if self.async_copy and n_late else None)
        s = self.state
        ph = s.staging()
        s.begin_write(ph)
        self._priv_packer.write(priv, s.data[ph, 0].view(torch.uint8))
        s.commit(ph, step, checksum(s.payload(ph)), (rank, world))
        self.loaded = step
        if before_copy is not None:
            before_copy()
        if not late or not late[0][0]:
            self.flat.commit(h, step, used)
            return
        self._copier.submit(late[0][0], late[0][1], lambda: self.flat.commit(h, step, used))

    def settle(self) -> None:
        """The last snapshot's copy is complete (and its replicated half committed)."""
        self._copier.wait()

    def private_size(self) -> int:
        """Bytes the live objects' own side packs into now."""
        return self._priv_packer.prepare(self.tracked.private()).end

    def commit_private(self, step: int, rank: int, world: int) -> None:
        """The live objects' own side alone, committed as `step` (a rank new to a resized world)."""
        s = self.state
        ph = s.staging()
        s.begin_write(ph)
        self._priv_packer.pack(self.tracked.private(), s.data[ph, 0].view(torch.uint8))
        s.commit(ph, step, checksum(s.payload(ph)), (rank, world))

    def load(self, step: int) -> None:
        """The live objects from the halves of `step` (a recovery's resume step)."""
        self.settle()
        h, ph = self.flat.half_with(step), self.state.half_with(step)
        if h is None or ph is None:
            raise RuntimeError(f"no snapshot of step {step} to load (replicated halves {self.flat.buf_step}, "
                               f"own shard {self.state.steps()})")
        rep = unpack(self.flat.data(h))
        priv = unpack(self.state.data[ph, 0].view(torch.uint8))
        got = self.tracked.load(rep, priv)
        if got != step:
            raise RuntimeError(f"the snapshot of step {step} says it is step {got}")
        self.loaded = step

    def pending(self) -> int | None:
        """The step the live objects must take before training goes on (None: they hold it already)."""
        p = getattr(self, "_pending", None)
        return None if p is None or p == self.loaded else p

    # ---------------------------------------------------------------- the persistent tier
    def persist_item(self, step: int, ctx: Any) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None] | None:
        """What this rank writes of `step` to the persistent tier (protect/persist.py): its own side (as the
        checkpoint's shard) and, on rank 0, the replicated side (as its `buffers`)."""
        ph, h = self.state.half_with(step), self.flat.half_with(step)
        if ph is None or h is None or ctx.topo is None:
            return None
        rep = self.flat.data(h) if ctx.rank == 0 else None
        meta: dict[str, Any] = {"rank": ctx.rank, "shards": ctx.topo.world, "numel": self.state.numel,
                                "shard_numel": self.state.numel, "epoch": ctx.epoch, "seed": ctx.cfg.seed,
                                "buffer_bytes": self.flat.size_at(step), "tp": 1, "pp": 1,
                                "config": json.loads(ctx.cfg.to_json()), "full_numel": self.state.numel,
                                "script": True}
        return self.state.data[ph], meta, rep

    # ---------------------------------------------------------------- the end
    def digest(self, step: int) -> tuple[bytes, bytes]:
        """sha256 of the replicated side of `step` and of this rank's own side (its used bytes)."""
        h, ph = self.flat.half_with(step), self.state.half_with(step)
        if h is None or ph is None:
            raise RuntimeError(f"no snapshot of step {step}")
        rep = hashlib.sha256(self.flat.data(h).numpy().tobytes()).digest()
        priv_buf = self.state.data[ph, 0].view(torch.uint8)
        priv = hashlib.sha256(priv_buf[: self.private_used(ph)].numpy().tobytes()).digest()
        return rep, priv
