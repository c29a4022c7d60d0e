"""A nest of state dicts in one byte buffer, and back: how a script's state enters a snapshot half.

`pack(obj, buf)` writes any nest of dicts, lists and tuples whose leaves are tensors or plain values (a model's,
an optimizer's, an LR scheduler's, a data loader's `state_dict()`) into the uint8 tensor `buf`:

    [header: magic, version, skeleton bytes, data start, used bytes][skeleton (pickle)][tensor bytes, 64-aligned]

The skeleton is the nest with every tensor replaced by a `TensorRef` (its position among the tensors, dtype and
shape); the tensors' bytes follow, from a data start that depends only on the skeleton's length (the next power
of two, at least 4 KiB), each at an aligned offset that depends only on the tensors before it. So equal states
give equal bytes in any process (peers compare the checksums of what they hold), and a buffer's tensor views stay
the same step after step: a step pickles its skeleton once (the learning rates, counters, cursors) and copies its
tensors with one `_foreach_copy_` (or hands the copy to a thread: `Packer.prepare`, then `write` with `copy=`).
The skeleton is pickled without its memo, so a state loaded from a snapshot (which shares fewer objects than the
one that wrote it) packs into the same bytes.

`unpack(buf)` returns the nest with every tensor a view into `buf` (no copy): the caller copies what it keeps
(`load_state_dict` copies into live tensors; an optimizer's state must be cloned, or it would alias the snapshot).
A snapshot comes from a peer: unpickling it names no class beyond plain containers and `TensorRef`. A sharded
tensor (`DTensor`) is packed as its local shard with its placements; `unpack` gives it back through
`dtensor(ref, local)`, which the caller builds from the live parameter it belongs to.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorRef", "Prepared", "pack", "unpack", "packed_size", "Packer", "HEADER", "ALIGN", "flatten",
           "used_bytes", "check_restorable"]

MAGIC = 0x50464E58  # "PFNX"
VERSION = 2
HEADER = 64
ALIGN = 64
MIN_ROOM = 4096
_HDR = struct.Struct("<IIQQQ")  # magic, version, skeleton bytes, data start, used bytes

Spec = tuple[str, tuple[int, ...], tuple[str, ...] | None]  # (dtype, shape, DTensor placements)


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a packed nest: its position among the nest's tensors, and what it was."""

    index: int
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


def _room(skel_bytes: int) -> int:
    """Where the tensors start: a function of the skeleton's length alone."""
    need = HEADER + skel_bytes
    room = MIN_ROOM
    while room < need:
        room *= 2
    return room


def _offsets(start: int, specs: list[Spec]) -> list[tuple[int, int]]:
    """(offset, bytes) of every tensor, from `start`, each aligned."""
    out, off = [], start
    for dt, shape, _pl in specs:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * _dtype(dt).itemsize
        off = _align(off)
        out.append((off, nbytes))
        off += nbytes
    return out


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


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor], list[Spec]]:
    """The nest with every tensor replaced by its `TensorRef`, the tensors (local shards), and their specs."""
    tensors: list[torch.Tensor] = []
    specs: list[Spec] = []

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_sparse or x.layout != torch.strided:
            raise TypeError(f"phoenixft cannot snapshot a {x.layout} tensor (only dense tensors)")
        loc, pl = _local(x)
        tensors.append(loc.detach())
        specs.append((str(loc.dtype), tuple(loc.shape), pl))
        return TensorRef(len(tensors) - 1, specs[-1][0], specs[-1][1], pl)

    return _map(obj, leaf), tensors, specs


def _skeleton_bytes(skel: Any) -> bytes:
    """The skeleton pickled without its memo: equal nests give equal bytes, whichever objects they share (a
    state loaded from a snapshot shares fewer than the one that wrote it)."""
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.fast = True  # (no memo: nests of state dicts are trees)
    p.dump(skel)
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
    skel, _t, _s = flatten(obj)
    try:
        raw = _skeleton_bytes(skel)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"phoenixft cannot protect this state: a value of it cannot be written ({e})") from None
    try:
        _loads(raw)
    except pickle.UnpicklingError as e:
        raise TypeError(f"phoenixft cannot protect this state: {e}") from None


@dataclass
class Prepared:
    """A nest ready to be written: its skeleton's bytes, its tensors, where they go, and the bytes it takes."""

    skeleton: bytes
    tensors: list[torch.Tensor]
    specs: list[Spec]
    start: int
    offsets: list[tuple[int, int]]
    end: int


class Packer:
    """Packs nests into buffers, reusing one buffer's tensor views while the layout stays the same."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # id(buf) -> (layout key, views)
        self._layout: tuple[tuple[int, tuple[Spec, ...]], list[tuple[int, int]]] | None = None

    def prepare(self, obj: Any) -> Prepared:
        skel, tensors, specs = flatten(obj)
        sk = _skeleton_bytes(skel)
        start = _room(len(sk))
        key = (start, tuple(specs))
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, _offsets(start, specs))
        offsets = self._layout[1]
        end = offsets[-1][0] + offsets[-1][1] if offsets else start
        return Prepared(sk, tensors, specs, start, offsets, end)

    def size(self, obj: Any) -> int:
        return self.prepare(obj).end

    def views(self, p: Prepared, buf: torch.Tensor) -> list[torch.Tensor]:
        """`buf`'s views for `p`'s tensors (the buffer's gaps zeroed when its layout is new)."""
        key = (buf.data_ptr(), buf.numel(), p.start, tuple(p.specs))
        cached = self._views.get(id(buf))
        if cached is not None and cached[0] == key:
            return cached[1]
        buf[: p.end].zero_()  # (a new layout in this buffer: the bytes of a step depend on nothing else)
        views = [buf[off : off + n].view(_dtype(dt)).view(shape)
                 for (off, n), (dt, shape, _pl) in zip(p.offsets, p.specs, strict=True)]
        self._views[id(buf)] = (key, views)
        return views

    def write(self, p: Prepared, buf: torch.Tensor,
              copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None) -> int:
        """Write `p` into `buf` (uint8, contiguous); returns the bytes used. ValueError if it does not fit.
        `copy(dst_views, src_tensors)` copies the tensors (default: now, one `_foreach_copy_` per device)."""
        if p.end > buf.numel():
            raise ValueError(f"state of {p.end} bytes does not fit a buffer of {buf.numel()}")
        views = self.views(p, buf)
        if p.tensors:
            (copy or _copy_all)(views, p.tensors)
        head = _HDR.pack(MAGIC, VERSION, len(p.skeleton), p.start, p.end)
        raw = torch.frombuffer(bytearray(head + p.skeleton), dtype=torch.uint8)
        buf[: len(head)].copy_(raw[: len(head)])
        buf[HEADER : HEADER + len(p.skeleton)].copy_(raw[len(head) :])
        buf[HEADER + len(p.skeleton) : p.start].zero_()  # (a longer skeleton's tail, before)
        return p.end

    def pack(self, obj: Any, buf: torch.Tensor,
             copy: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None) -> int:
        return self.write(self.prepare(obj), buf, copy)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, grouped by device (one foreach call per group)."""
    if not src:
        return
    same = [i for i in range(len(src)) if src[i].device == dst[i].device]
    if len(same) == len(src):
        torch._foreach_copy_(dst, src)
        return
    if same:
        torch._foreach_copy_([dst[i] for i in same], [src[i] for i in same])
    for i in range(len(src)):
        if src[i].device != dst[i].device:
            dst[i].copy_(src[i], non_blocking=True)


def packed_size(obj: Any) -> int:
    """The bytes `pack(obj, ...)` writes."""
    return Packer().size(obj)


def pack(obj: Any, buf: torch.Tensor) -> int:
    """`Packer().pack(obj, buf)`: the bytes used."""
    return Packer().pack(obj, buf)


def _header(buf: torch.Tensor) -> tuple[int, int, int] | None:
    if buf.numel() < HEADER:
        return None
    magic, version, skel_n, start, end = _HDR.unpack_from(bytes(buf[:HEADER].numpy().tobytes()))
    if magic != MAGIC or version != VERSION:
        return None
    return int(skel_n), int(start), int(end)


def used_bytes(buf: torch.Tensor) -> int:
    """How many bytes of `buf` a packed nest uses (0: nothing packed there)."""
    h = _header(buf)
    return h[2] if h is not None else 0


def unpack(buf: torch.Tensor, dtensor: Callable[[TensorRef, torch.Tensor], Any] | None = None) -> Any:
    """The nest packed in `buf`, its tensors views into `buf`; a DTensor's local shard is handed to
    `dtensor(ref, local)` (default: the local shard itself)."""
    h = _header(buf)
    if h is None:
        raise ValueError("not a phoenixft snapshot (bad magic or version)")
    skel_n, start, end = h
    if end > buf.numel() or HEADER + skel_n > start:
        raise ValueError(f"a snapshot of {end} bytes (skeleton {skel_n}, data from {start}) in a buffer of "
                         f"{buf.numel()}")
    skel = _loads(bytes(buf[HEADER : HEADER + skel_n].numpy().tobytes()))
    refs: list[TensorRef] = []
    _map(skel, lambda x: refs.append(x) if isinstance(x, TensorRef) else None)
    if sorted(r.index for r in refs) != list(range(len(refs))):
        raise ValueError("a snapshot whose tensor references are not its tensors in order")
    offsets = _offsets(start, [(r.dtype, r.shape, r.dtensor) for r in sorted(refs, key=lambda r: r.index)])
    if offsets and offsets[-1][0] + offsets[-1][1] > end:
        raise ValueError("a snapshot whose tensors run past its end")

    def leaf(x: Any) -> Any:
        if not isinstance(x, TensorRef):
            return x
        off, n = offsets[x.index]
        t = buf[off : off + n].view(_dtype(x.dtype)).view(x.shape)
        return dtensor(x, t) if (x.dtensor is not None and dtensor is not None) else t

    return _map(skel, leaf)
