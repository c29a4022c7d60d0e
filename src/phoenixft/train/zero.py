"""ZeRO-1 flat model: parameters (and buffers) in flat ping-pong buffers, gradients in a flat buffer.

Parameters live as views into one flat buffer (fp32, or bf16 with `--precision bf16`); gradients
as views into one flat grad buffer of the same dtype, so gradient accumulation over microbatches
lands in place (with bf16 each microbatch's gradients are added into an fp32 accumulator, as
Megatron's main_grad does). Each step the summed gradient's own slice feeds the shard optimizer
(fp32 master weights and state in the shard: `phoenixft.optim`), and the updated master slices
are all-gathered (cast to the parameter dtype) into the *other* flat buffer.

Two flat buffers alternate (ping-pong): the all-gather writes into the one that is not live and
the parameter views are re-pointed only after it completed, so a failure during the all-gather
leaves the live parameters untouched. Each buffer is tagged with the step it holds.

Model buffers (running statistics, counters: the entries of `state_dict` that are not parameters,
then the non-persistent buffers) are state too. The model keeps its own buffer tensors; at each flip their bytes are
copied into the tail of the new live flat buffer, so every flat buffer is a complete recovery
point: a rollback or an installed peer copy restores them with the parameters.

On CUDA every buffer lives on the worker's GPU (the parameters must be where the model computes),
so nothing of it outlives the process: a worker restarted in place gets its parameters from a
data-parallel peer, like a spare. On CPU they are shared-memory files the restarted worker adopts.
"""

from __future__ import annotations

import math
import os

import torch

from phoenixft.parallel.layout import shard_numel_of
from phoenixft.protect.snapshot import INVALID, alloc

__all__ = ["FlatModel", "DTYPES"]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FlatModel:
    """A module whose parameters and gradients are views into flat buffers."""

    def __init__(self, model: torch.nn.Module, shards: int, path: str | None = None, step: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        """With `path` (CPU only), both parameter buffers and their step tags live in shared memory;
        if they already exist (a worker restarted in place) they are adopted instead of overwritten."""
        self.model = model
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        if self.device.type != "cpu":
            path = None  # device memory dies with the process: nothing to retain
        self.params = [p for p in model.parameters() if p.requires_grad]
        if dtype != torch.float32:  # as model.to(dtype) would: frozen parameters follow the trained ones (left in
            for p in model.parameters():  # fp32 they met bf16 activations: "mat1 and mat2 must have the same dtype")
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)
        self.numel = sum(p.numel() for p in self.params)
        self.shards = shards
        self.shard_numel = shard_numel_of(self.numel, shards)
        self.padded = self.shard_numel * shards
        pnames = {id(p) for p in model.parameters()}
        sd = model.state_dict(keep_vars=True)
        self.buffers = [(k, t) for k, t in sd.items() if id(t) not in pnames]
        # then the non-persistent buffers (not in state_dict): a forward may change them too (a counter, a
        # cache), and DistributedDataParallel broadcasts them as well; left out, a spare or a restarted worker
        # computed with them as built and a recovered run ended with another final state than the failure-free
        # one. After the state_dict entries, so that the export (which reads those, in order) is unchanged.
        seen = {id(t) for _, t in self.buffers}
        self.buffers += [(k, t) for k, t in model.named_buffers() if id(t) not in seen and id(t) not in pnames]
        for _, t in self.buffers:
            if dtype != torch.float32 and t.is_floating_point():  # as model.to(dtype): they follow the parameters
                t.data = t.data.to(dtype)
            if not t.is_contiguous():  # (a transposed or expanded tensor): its bytes go in and out as one flat view
                t.data = t.data.contiguous()
        self.buffer_bytes = sum(t.numel() * t.element_size() for _, t in self.buffers)
        esize = torch.empty((), dtype=dtype).element_size()
        self.total = self.padded + math.ceil(self.buffer_bytes / esize)
        retained = path is not None and os.path.exists(path + ".tags")
        if self.device.type == "cpu":
            self.bufs = [alloc(self.total, dtype, path and f"{path}.{i}") for i in (0, 1)]
        else:
            self.bufs = [torch.zeros(self.total, dtype=dtype, device=self.device) for _ in (0, 1)]
        self.tags = alloc(3, torch.int64, path and path + ".tags")  # step of buffer 0, 1; live index
        # the fp32 values the model was built with: the master weights of step 0 (and of a fresh spare), in
        # host memory (never on the GPU) and only until the run has stepped past them (`release_init_master`)
        self.init_master = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params]) \
            if self.params else torch.empty(0)
        if retained:
            self.live = int(self.tags[2])
        else:
            self.tags[0], self.tags[1], self.tags[2] = step, INVALID, 0
            self.live = 0
            self.bufs[0][: self.numel].copy_(self.init_master)
            self._save_buffers(0)
        self.grad = torch.zeros(self.padded, dtype=dtype, device=self.device)
        self.grad32 = torch.zeros(self.padded, device=self.device) if dtype != torch.float32 else self.grad
        self._bind(self.live)
        if retained:
            self._load_buffers(self.live)
        off = 0
        for p in self.params:
            p.grad = self.grad[off : off + p.numel()].view_as(p)
            off += p.numel()

    def release_init_master(self) -> None:
        """Free the fp32 copy of the model as built (4 bytes per parameter): once this rank has stepped past
        step 1, no plan starts the run afresh from step 0 (the coordinator does that only while no step
        beyond 0 is held anywhere)."""
        self.init_master = torch.empty(0)

    @property
    def buf_step(self) -> list[int]:
        return [int(self.tags[0]), int(self.tags[1])]

    def _tag(self, which: int, step: int) -> None:
        self.tags[which] = step

    def _bind(self, which: int) -> None:
        self.tags[2] = which
        off = 0
        buf = self.bufs[which]
        for p in self.params:
            p.data = buf[off : off + p.numel()].view_as(p)
            off += p.numel()
        self.live = which

    # -- buffers: bytes in the tail of a flat buffer
    def _tail(self, which: int) -> torch.Tensor:
        return self.bufs[which][self.padded :].view(torch.uint8)[: self.buffer_bytes]

    def _save_buffers(self, which: int) -> None:
        if not self.buffers:
            return
        tail, off = self._tail(which), 0
        for _, t in self.buffers:
            n = t.numel() * t.element_size()
            tail[off : off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            off += n

    def _load_buffers(self, which: int) -> None:
        if not self.buffers:
            return
        tail, off = self._tail(which), 0
        for _, t in self.buffers:
            n = t.numel() * t.element_size()
            t.data.view(-1).view(torch.uint8).copy_(tail[off : off + n])
            off += n

    def buffers_at(self, step: int) -> torch.Tensor | None:
        """The buffers' bytes as committed with `step` (a host copy), or None if no flat buffer holds it."""
        for b in (0, 1):
            if self.buf_step[b] == step:
                return self._tail(b).to("cpu", copy=True)
        return None

    def buffer_bytes_now(self, on_device: bool = False) -> torch.Tensor:
        """The model's buffers as one uint8 tensor (a copy), e.g. to hash (in host memory) or, with
        `on_device`, to broadcast over the data-parallel group (where the parameters live)."""
        out = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device if on_device else "cpu")
        off = 0
        for _, t in self.buffers:
            n = t.numel() * t.element_size()
            out[off : off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            off += n
        return out

    def set_buffers(self, raw: torch.Tensor, save: bool = False) -> None:
        """Load the model's buffers from bytes; with `save`, also into the live flat buffer's tail."""
        off = 0
        for _, t in self.buffers:
            n = t.numel() * t.element_size()
            if off + n > raw.numel():  # a checkpoint written before non-persistent buffers were state: as built
                break
            t.data.view(-1).view(torch.uint8).copy_(raw[off : off + n])
            off += n
        if save:
            self._save_buffers(self.live)

    # -- views
    def shard_slice(self, shard: int) -> slice:
        return slice(shard * self.shard_numel, (shard + 1) * self.shard_numel)

    @property
    def flat(self) -> torch.Tensor:
        """The live parameters (padded; without the buffer tail)."""
        return self.bufs[self.live][: self.padded]

    @property
    def whole(self) -> torch.Tensor:
        """The live flat buffer with its buffer tail: what a peer needs to install this step."""
        return self.bufs[self.live]

    @property
    def packed_numel(self) -> int:
        return self.numel + (self.total - self.padded)

    def packed(self) -> torch.Tensor:
        """Parameters and buffer tail without the partition's padding: the same on any world size."""
        return torch.cat([self.bufs[self.live][: self.numel], self.bufs[self.live][self.padded :]])

    def install_packed(self, packed: torch.Tensor, step: int) -> None:
        whole = torch.zeros(self.total, dtype=self.dtype)
        whole[: self.numel] = packed[: self.numel]
        whole[self.padded :] = packed[self.numel :]
        self.install(whole, step)

    @property
    def step(self) -> int:
        return self.buf_step[self.live]

    def begin_gather(self) -> torch.Tensor:
        """The non-live buffer's parameter part, untagged: it is about to be overwritten by the all-gather."""
        self._tag(1 - self.live, INVALID)
        return self.bufs[1 - self.live][: self.padded]

    def flip(self, step: int) -> None:
        """Make the non-live buffer (just filled by the all-gather) live for `step`, with the model's
        buffers as they are now."""
        self._save_buffers(1 - self.live)
        self._tag(1 - self.live, step)
        self._bind(1 - self.live)

    def select(self, step: int) -> bool:
        """Roll back (or stay) so the live buffer holds `step`; False if neither does."""
        for b in (self.live, 1 - self.live):
            if self.buf_step[b] == step:
                self._bind(b)
                self._load_buffers(b)
                if self.buf_step[1 - b] > step:  # a newer, interrupted step is discarded; an older committed
                    self._tag(1 - b, INVALID)  # one stays a recovery point (a cascade may need it)
                return True
        return False

    def install(self, whole: torch.Tensor, step: int) -> None:
        """Adopt full parameters (and buffers, when `whole` has the tail) received from a peer."""
        self._tag(1 - self.live, INVALID)
        self.bufs[1 - self.live][: whole.numel()].copy_(whole)
        if whole.numel() < self.total:  # parameters only: keep our own buffers
            self._save_buffers(1 - self.live)
        self._tag(1 - self.live, step)
        self._bind(1 - self.live)
        self._load_buffers(self.live)
        self._tag(1 - self.live, INVALID)

    def size_at(self, step: int) -> int:  # noqa: ARG002 - every step's buffer has this size
        """Elements a peer sends of the buffer of a step (parameters and buffer tail)."""
        return self.total

    def params_view(self, which: int | None = None) -> torch.Tensor:
        """The parameters (without padding and buffer tail) of flat buffer `which` (the live one by default)."""
        return self.bufs[self.live if which is None else which][: self.numel]

    def receive_buffer(self, numel: int | None = None) -> torch.Tensor:  # noqa: ARG002 - always `total`
        """The non-live flat buffer, untagged, for a peer's copy to be received into in place (what
        `install` would copy it into); `adopt_received` makes it live."""
        self._tag(1 - self.live, INVALID)
        return self.bufs[1 - self.live]

    def adopt_received(self, step: int, numel: int | None = None) -> None:  # noqa: ARG002 - always `total`
        """The buffer of `receive_buffer` holds a peer's whole buffer (parameters and buffer tail) of
        `step`: make it live, as `install` does after its copy."""
        self._tag(1 - self.live, step)
        self._bind(1 - self.live)
        self._load_buffers(self.live)
        self._tag(1 - self.live, INVALID)

    def zero_grad(self) -> None:
        self.grad.zero_()
        if self.grad32 is not self.grad:
            self.grad32.zero_()
