"""A nest of state dicts in one byte buffer, and back: how a script's state enters a snapshot half.

`pack(obj, buf)` writes any nest of dicts, lists and tuples whose leaves are tensors or picklable
values (a model's, an optimizer's, an LR scheduler's, a data loader's `state_dict()`) into the uint8
tensor `buf`:

    [header: magic, version, skeleton bytes, data bytes][skeleton (pickle)][tensor bytes, 64-aligned]

The skeleton is the nest with every tensor replaced by a `TensorRef` (its dtype, shape and offset);
the tensors' bytes follow it. A packer keeps the views of one buffer's tensor region for as long as the
nest's tensors keep their dtypes and shapes, so a step copies its tensors with one `_foreach_copy_`
and pickles only the skeleton (the Python values: learning rates, counters, cursors).

`unpack(buf)` returns the nest with every tensor a view into `buf` (no copy): the caller copies what it
keeps (`load_state_dict` copies into live tensors; an optimizer's state must be cloned, or it would
alias the snapshot). A sharded tensor (`DTensor`) is packed as its local shard with its placements;
`unpack` gives it back through `dtensor(ref, local)`, which the caller builds from the live parameter
it belongs to.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorRef", "pack", "unpack", "packed_size", "Packer", "HEADER", "ALIGN", "flatten", "used_bytes",
           "check_restorable"]

MAGIC = 0x50464E58  # "PFNX"
VERSION = 1
HEADER = 64
ALIGN = 64
_HDR = struct.Struct("<IIQQ")


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor's bytes are in the buffer, and what it was."""

    index: int
    offset: int  # bytes from the start of the buffer
    dtype: str  # e.g. "torch.float32"
    shape: tuple[int, ...]
    dtensor: tuple[str, ...] | None = None  # the placements of a DTensor (its local shard is what is packed)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _dtype(self.dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a snapshot")
    return d


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _map(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """`x` rebuilt with `leaf(v)` for every value that is not a dict, list or plain tuple (namedtuples are leaves)."""
    if isinstance(x, dict):
        items = ((k, _map(v, leaf)) for k, v in x.items())
        return dict(items) if type(x) is dict else type(x)(items)
    if isinstance(x, list):
        return [_map(v, leaf) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map(v, leaf) for v in x)
    return leaf(x)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[str, ...] | None]:
    """The tensor whose bytes are packed, and a DTensor's placements."""
    to_local = getattr(t, "to_local", None)
    placements = getattr(t, "placements", None)
    if to_local is not None and placements is not None:
        return to_local(), tuple(str(p) for p in placements)
    return t, None


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor], list[tuple[str, tuple[int, ...], tuple[str, ...] | None]]]:
    """The nest with tensors replaced by their index, the tensors (local shards), and their (dtype, shape,
    placements)."""
    tensors: list[torch.Tensor] = []
    specs: list[tuple[str, tuple[int, ...], tuple[str, ...] | None]] = []

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_sparse or x.layout != torch.strided:
            raise TypeError(f"phoenixft cannot snapshot a {x.layout} tensor (only dense tensors)")
        loc, pl = _local(x)
        tensors.append(loc.detach())
        specs.append((str(loc.dtype), tuple(loc.shape), pl))
        return _Slot(len(tensors) - 1)

    return _map(obj, leaf), tensors, specs


@dataclass(frozen=True)
class _Slot:
    i: int


def _refs(specs: list[tuple[str, tuple[int, ...], tuple[str, ...] | None]], start: int) -> list[TensorRef]:
    out, off = [], _align(start)
    for i, (dt, shape, pl) in enumerate(specs):
        r = TensorRef(i, off, dt, shape, pl)
        out.append(r)
        off = _align(off + r.nbytes)
    return out


def _with_refs(skel: Any, refs: list[TensorRef]) -> Any:
    return _map(skel, lambda x: refs[x.i] if isinstance(x, _Slot) else x)


def _skeleton_bytes(skel: Any, refs: list[TensorRef]) -> bytes:
    """The skeleton pickled without its memo: equal nests give equal bytes, whichever objects they share (a
    state loaded from a snapshot shares fewer than the one that wrote it)."""
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.fast = True  # (no memo: nests of state dicts are trees)
    p.dump(_with_refs(skel, refs))
    return f.getvalue()


# what a snapshot's skeleton may name: plain containers and numbers, and our tensor references (a snapshot
# comes from a peer: unpickling must not run anything else)
_SAFE = {("builtins", n) for n in ("set", "frozenset", "complex", "bytearray", "slice", "range")} | {
    ("collections", "OrderedDict"), ("collections", "deque"), ("collections", "defaultdict"),
    ("phoenixft.api.packing", "TensorRef"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _SAFE:
            raise pickle.UnpicklingError(f"a snapshot names {module}.{name}, which phoenixft does not restore (a "
                                         "state holds tensors, numbers, strings and containers of them)")
        return super().find_class(module, name)


def _loads(b: bytes) -> Any:
    return _Unpickler(io.BytesIO(b)).load()


def check_restorable(obj: Any) -> None:
    """TypeError naming the first value of `obj`'s nest that a snapshot could not restore (checked once, when a
    state is first packed: a snapshot that cannot be read back would only fail in a recovery)."""
    skel, _t, specs = flatten(obj)
    try:
        raw = _skeleton_bytes(skel, _refs(specs, HEADER))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"phoenixft cannot protect this state: a value of it cannot be written ({e})") from None
    try:
        _loads(raw)
    except pickle.UnpicklingError as e:
        raise TypeError(f"phoenixft cannot protect this state: {e}") from None


def packed_size(obj: Any) -> int:
    """The bytes `pack(obj, ...)` writes."""
    return Packer().size(obj)


def used_bytes(buf: torch.Tensor) -> int:
    """How many bytes of `buf` a packed nest uses (0: nothing packed there)."""
    head = bytes(buf[:HEADER].numpy().tobytes()) if buf.numel() >= HEADER else b""
    if len(head) < _HDR.size:
        return 0
    magic, version, skel_n, data_n = _HDR.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        return 0
    return int(data_n)


class Packer:
    """Packs nests into buffers, reusing one buffer's tensor views while the nest's tensors keep their shapes."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # id(buf) -> (spec key, views)

    def size(self, obj: Any) -> int:
        skel, _tensors, specs = flatten(obj)
        return self._layout(skel, specs)[2]

    @staticmethod
    def _layout(skel: Any, specs: list[Any]) -> tuple[list[TensorRef], bytes, int]:
        # the skeleton's size depends on the offsets it records, which depend on its size: two passes
        # settle it (the offsets are aligned, so a few bytes more or less rarely move them)
        refs = _refs(specs, HEADER)
        for _ in range(4):
            sk = _skeleton_bytes(skel, refs)
            new = _refs(specs, HEADER + len(sk))
            if new == refs:
                break
            refs = new
        else:
            sk = _skeleton_bytes(skel, refs)
        end = refs[-1].offset + refs[-1].nbytes if refs else HEADER + len(sk)
        return refs, sk, end

    def pack(self, obj: Any, buf: torch.Tensor,
             copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None) -> int:
        """Write `obj` into `buf` (uint8, contiguous); returns the bytes used. ValueError if it does not fit.
        `copy(dst_views, src_tensors)` copies the tensors (default: `torch._foreach_copy_`)."""
        skel, tensors, specs = flatten(obj)
        refs, sk, end = self._layout(skel, specs)
        if end > buf.numel():
            raise ValueError(f"state of {end} bytes does not fit a buffer of {buf.numel()}")
        key = (buf.data_ptr(), buf.numel(), tuple(specs), tuple(r.offset for r in refs))
        cached = self._views.get(id(buf))
        if cached is not None and cached[0] == key:
            views = cached[1]
        else:  # a new layout in this buffer: its gaps zeroed once (the bytes of a step depend on nothing else)
            buf[:end].zero_()
            views = [buf[r.offset : r.offset + r.nbytes].view(_dtype(r.dtype)).view(r.shape) for r in refs]
            self._views[id(buf)] = (key, views)
        if tensors:
            if copy is not None:
                copy(views, tensors)
            else:
                _copy_all(views, tensors)
        head = _HDR.pack(MAGIC, VERSION, len(sk), end)
        raw = torch.frombuffer(bytearray(head + sk), dtype=torch.uint8)
        buf[: len(head)].copy_(raw[: len(head)])
        buf[HEADER : HEADER + len(sk)].copy_(raw[len(head) :])
        buf[HEADER + len(sk) : refs[0].offset if refs else end].zero_()  # (a longer skeleton's tail, before)
        return end


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, grouped by device (one foreach call per group)."""
    same = [i for i in range(len(src)) if src[i].device == dst[i].device]
    if len(same) == len(src):
        torch._foreach_copy_(dst, src)
        return
    if same:
        torch._foreach_copy_([dst[i] for i in same], [src[i] for i in same])
    for i in range(len(src)):
        if src[i].device != dst[i].device:
            dst[i].copy_(src[i], non_blocking=True)


def pack(obj: Any, buf: torch.Tensor) -> int:
    """`Packer().pack(obj, buf)`: the bytes used."""
    return Packer().pack(obj, buf)


def unpack(buf: torch.Tensor, dtensor: Callable[[TensorRef, torch.Tensor], Any] | None = None) -> Any:
    """The nest packed in `buf`, its tensors views into `buf`; a DTensor's local shard is handed to
    `dtensor(ref, local)` (default: the local shard itself)."""
    head = bytes(buf[:HEADER].numpy().tobytes())
    magic, version, skel_n, data_n = _HDR.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise ValueError("not a phoenixft snapshot (bad magic or version)")
    if data_n > buf.numel() or HEADER + skel_n > buf.numel():
        raise ValueError(f"a snapshot of {data_n} bytes in a buffer of {buf.numel()}")
    skel = _loads(bytes(buf[HEADER : HEADER + skel_n].numpy().tobytes()))

    def leaf(x: Any) -> Any:
        if not isinstance(x, TensorRef):
            return x
        t = buf[x.offset : x.offset + x.nbytes].view(_dtype(x.dtype)).view(x.shape)
        return dtensor(x, t) if (x.dtensor is not None and dtensor is not None) else t

    return _map(skel, leaf)
