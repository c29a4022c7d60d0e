"""What a script's job protects: its live objects, as two nests of state dicts, and back.

Every step's snapshot has two sides, as the built-in trainer's has (parameters whole on every
data-parallel peer; each rank's own optimizer shard):

- the *replicated* side, identical on every data-parallel rank: each model's parameters, each
  optimizer's state and hyperparameters, each LR scheduler, the data cursor, the step, and what the
  script registers as shared (`job.register_state(name, obj)`). A rank that lacks it (a promoted
  spare) gets it from any peer;
- the *private* side, this rank's own: each model's buffers (a forward updates running statistics
  with this rank's batch), a sharded model's (FSDP2) local parameter and optimizer shards, a stateful
  loader's position over its own stream, and what the script registers with `per_rank=True`. It is
  replicated to peers on other nodes by the redundancy scheme, as an optimizer shard is.

`replicated()` / `private()` give the nests (tensors by reference: the snapshot copies them);
`load(replicated, private)` puts a snapshot's nests back into the live objects (tensors copied in
place, optimizer state cloned: a snapshot half is never aliased by the live state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Tracked", "is_sharded"]


def is_sharded(t: Any) -> bool:
    """A DTensor whose placements shard it (its local part is this rank's own)."""
    placements = getattr(t, "placements", None)
    return placements is not None and any(getattr(p, "is_shard", lambda: False)() for p in placements)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    local = dst.to_local() if hasattr(dst, "to_local") and hasattr(dst, "placements") else dst
    with torch.no_grad():
        local.copy_(src)


@dataclass
class _Entry:
    name: str
    obj: Any
    per_rank: bool = False


@dataclass
class Tracked:
    """The live objects of one rank's job, in the order they were registered."""

    models: list[_Entry] = field(default_factory=list)
    optimizers: list[_Entry] = field(default_factory=list)
    schedulers: list[_Entry] = field(default_factory=list)
    loaders: list[_Entry] = field(default_factory=list)
    extra: list[_Entry] = field(default_factory=list)
    cursor: Callable[[], Any] = lambda: None  # the data cursor (shared): `StepLoader`s' positions
    set_cursor: Callable[[Any], None] = lambda _c: None

    def names(self) -> set[str]:
        return {e.name for group in (self.models, self.optimizers, self.schedulers, self.loaders, self.extra)
                for e in group}

    def add(self, kind: str, name: str, obj: Any, per_rank: bool = False) -> None:
        if name in self.names():
            raise ValueError(f"phoenixft: a state named {name!r} is registered already")
        getattr(self, kind).append(_Entry(name, obj, per_rank))

    # ---------------------------------------------------------------- to nests
    def replicated(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {"step": step, "cursor": self.cursor()}
        out["models"] = {e.name: {n: p for n, p in e.obj.named_parameters() if not is_sharded(p)}
                         for e in self.models}
        out["optimizers"] = {e.name: e.obj.state_dict() for e in self.optimizers if not _sharded_optimizer(e.obj)}
        out["schedulers"] = {e.name: e.obj.state_dict() for e in self.schedulers}
        out["loaders"] = {e.name: e.obj.state_dict() for e in self.loaders if not e.per_rank}
        out["extra"] = {e.name: _state_of(e.obj) for e in self.extra if not e.per_rank}
        return out

    def late_tensors(self, rep: dict[str, Any]) -> int:
        """How many of `rep`'s tensors (the first ones, in packing order: `step`, `cursor`, then `models` and
        `optimizers`) change only in an optimizer's `step()`: their copy may run while the next step computes."""
        from phoenixft.api.packing import flatten

        return len(flatten({k: rep[k] for k in ("step", "cursor", "models", "optimizers")})[1])

    def private(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["buffers"] = {e.name: dict(e.obj.named_buffers()) for e in self.models}
        out["shards"] = {e.name: {n: p for n, p in e.obj.named_parameters() if is_sharded(p)} for e in self.models}
        out["optimizers"] = {e.name: e.obj.state_dict() for e in self.optimizers if _sharded_optimizer(e.obj)}
        out["loaders"] = {e.name: e.obj.state_dict() for e in self.loaders if e.per_rank}
        out["extra"] = {e.name: _state_of(e.obj) for e in self.extra if e.per_rank}
        return out

    # ---------------------------------------------------------------- back into the live objects
    def load(self, rep: dict[str, Any], priv: dict[str, Any]) -> int:
        """Put a snapshot's two nests back into the live objects; returns the snapshot's step."""
        for e in self.models:
            params = dict(e.obj.named_parameters())
            for n, t in {**rep["models"].get(e.name, {}), **priv["shards"].get(e.name, {})}.items():
                _copy_into(params[n], t)
            bufs = dict(e.obj.named_buffers())
            for n, t in priv["buffers"].get(e.name, {}).items():
                if n in bufs:
                    _copy_into(bufs[n], t)
        for e in self.optimizers:
            sd = rep["optimizers"].get(e.name, priv["optimizers"].get(e.name))
            if sd is not None:
                e.obj.load_state_dict(_owned(sd, _dtensor_of(e.obj)))
        for e in self.schedulers:
            if e.name in rep["schedulers"]:
                e.obj.load_state_dict(rep["schedulers"][e.name])
        for e in self.loaders:
            src = priv["loaders"] if e.per_rank else rep["loaders"]
            if e.name in src:
                e.obj.load_state_dict(_owned(src[e.name]))
        for e in self.extra:
            src = priv["extra"] if e.per_rank else rep["extra"]
            if e.name in src:
                _load_state(e.obj, src[e.name])
        self.set_cursor(rep.get("cursor"))
        return int(rep["step"])


def _sharded_optimizer(opt: Any) -> bool:
    return any(is_sharded(p) for g in opt.param_groups for p in g["params"])


def _state_of(obj: Any) -> Any:
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, (torch.Tensor, dict, list, tuple)):
        return obj
    raise TypeError(f"phoenixft cannot snapshot a {type(obj).__name__}: register an object with state_dict() and "
                    "load_state_dict(), a tensor, or a dict/list of them")


def _load_state(obj: Any, state: Any) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(_owned(state))
    elif isinstance(obj, torch.Tensor):
        _copy_into(obj, state)
    elif isinstance(obj, dict):
        for k, v in state.items():
            if isinstance(obj.get(k), torch.Tensor):
                _copy_into(obj[k], v)
            else:
                obj[k] = _owned(v)
    elif isinstance(obj, list):
        for i, v in enumerate(state):
            if isinstance(obj[i], torch.Tensor):
                _copy_into(obj[i], v)
            else:
                obj[i] = _owned(v)


def _owned(x: Any, dtensor: Callable[[Any, torch.Tensor], Any] | None = None) -> Any:
    """`x` with every tensor cloned (a live object must never alias a snapshot half); a DTensor's local shard
    made a DTensor again by `dtensor(path, local)`."""
    def walk(v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            return dtensor(path, v.clone()) if dtensor is not None else v.clone()
        if isinstance(v, dict):
            return {k: walk(w, (*path, k)) for k, w in v.items()}
        if isinstance(v, list):
            return [walk(w, (*path, i)) for i, w in enumerate(v)]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(walk(w, (*path, i)) for i, w in enumerate(v))
        return v

    return walk(x, ())


def _dtensor_of(opt: Any) -> Callable[[Any, torch.Tensor], Any] | None:
    """For a sharded optimizer: a state tensor's local shard back into a DTensor laid out as its parameter
    (state path ("state", index, name)); None for an optimizer over plain tensors."""
    if not _sharded_optimizer(opt):
        return None
    params = [p for g in opt.param_groups for p in g["params"]]

    def build(path: Any, local: torch.Tensor) -> Any:
        if len(path) == 3 and path[0] == "state":
            p = params[int(path[1])]
            if is_sharded(p) and tuple(local.shape) == tuple(p.to_local().shape):
                from torch.distributed.tensor import DTensor

                return DTensor.from_local(local.to(p.device), p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
        return local

    return build

