"""The process group a user's script trains on: one object for the whole run, a new backend every epoch.

`DistributedDataParallel`, FSDP2's `DeviceMesh` and a script's own `dist.all_reduce(...)` all hold (or
look up) one `ProcessGroup`. phoenixft rebuilds its groups for every epoch (a hot-swap, a shrink, an
in-place restart), inside the running processes. `ResilientGroup` is that one object: a Python
subclass of `torch.distributed.ProcessGroup`, registered as the `phoenixft` backend and installed as
the default group by `phoenixft.init()` (`init_process_group(backend="phoenixft")`), whose every
collective goes to the current epoch's real backend (gloo here, NCCL on GPUs: `Device.new_group`).
`rank()` and `size()` are the current epoch's. Torch calls these methods from Python (`dist.*`) and
from C++ (DDP's reducer) alike.

A failed epoch's backend is retired (its connections severed: distributed/comm.py) as soon as the
epoch's failure flag is seen, so a collective blocked on a dead or stopped peer raises at once
instead of waiting out the backend's timeout; the error reaches the script's `with job.step(...)`,
which recovers.

torch 2.13 names the single-tensor collectives `all_gather_single`, `reduce_scatter_single`,
`all_to_all_single`; older releases `_allgather_base`, `_reduce_scatter_base`, `alltoall_base`.
Both sets are here, on the backend's own methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_c10d: Any = torch._C._distributed_c10d  # (the option classes; torch's stubs lack some of them)

__all__ = ["ResilientGroup", "BACKEND", "register_backend", "NotMember"]

BACKEND = "phoenixft"


class NotMember(RuntimeError):
    """A collective on the group while this process holds no backend (before it joined, after it left)."""


def _all_of(works: list[Any]) -> Any:
    """One work that completes when every work in `works` has (a coalesced call on a backend without
    coalescing): waits for each in turn on a future's callback chain."""
    if len(works) == 1:
        return works[0]
    fut: torch.futures.Future[Any] = torch.futures.Future()

    def chain(i: int) -> None:
        if i == len(works):
            fut.set_result(None)
            return

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                f.value()
            except Exception as e:  # noqa: BLE001 - handed to whoever waits for the combined work
                fut.set_exception(e)
                return
            chain(i + 1)

        works[i].get_future().add_done_callback(done)

    chain(0)
    return dist.distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


class ResilientGroup(dist.ProcessGroup):
    """The run's one process group; `bind(backend, rank, size)` at every epoch."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._inner: Any = None
        self._group_name = ""
        self.on_collective: Callable[[], None] | None = None  # (fault phases, interruption) before each call

    # ---------------------------------------------------------------- the epoch's backend
    def bind(self, inner: Any, rank: int, size: int) -> None:
        """Route every collective to `inner` (this epoch's backend) as rank `rank` of `size`."""
        self._inner, self._rank, self._size = inner, rank, size

    def unbind(self) -> None:
        self._inner = None

    @property
    def inner(self) -> Any:
        if self._inner is None:
            raise NotMember("phoenixft: a collective outside the job's epochs (before phoenixft.init() joined, "
                            "or after a recovery retired the group)")
        if self.on_collective is not None:
            self.on_collective()
        return self._inner

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)  # type: ignore[arg-type]

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def pg_name(self) -> str:
        return self._group_name

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self.inner.allreduce(tensors, opts if opts is not None else _c10d.AllreduceOptions())

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.inner.allreduce_coalesced(tensors, opts if opts is not None else _c10d.AllreduceCoalescedOptions())

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self.inner.broadcast(tensors, opts if opts is not None else _c10d.BroadcastOptions())

    def reduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self.inner.reduce(tensors, opts if opts is not None else _c10d.ReduceOptions())

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self.inner.allgather(outputs, inputs, opts if opts is not None else _c10d.AllgatherOptions())

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        return self.inner.allgather_coalesced(outputs, inputs, opts if opts is not None else _c10d.AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.inner._allgather_base(output, input, opts if opts is not None else _c10d.AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> Any:
        return _all_of([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:  # type: ignore[override]
        return self.inner.reduce_scatter(outputs, inputs, opts if opts is not None else _c10d.ReduceScatterOptions())

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.inner._reduce_scatter_base(output, input,
                                               opts if opts is not None else _c10d.ReduceScatterOptions())

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> Any:
        return _all_of([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return self.inner.alltoall_base(output, input, list(output_split_sizes or []), list(input_split_sizes or []),
                                        opts if opts is not None else _c10d.AllToAllOptions())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any,  # noqa: A002
                          input_split_sizes: Any, opts: Any = None) -> Any:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.inner.alltoall(outputs, inputs, opts if opts is not None else _c10d.AllToAllOptions())

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self.inner.gather(outputs, inputs, opts if opts is not None else _c10d.GatherOptions())

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:  # type: ignore[override]
        return self.inner.scatter(outputs, inputs, opts if opts is not None else _c10d.ScatterOptions())

    def barrier(self, opts: Any = None) -> Any:
        return self.inner.barrier(opts if opts is not None else _c10d.BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self.inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return self.inner.recv_anysource(tensors, tag)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> Any:  # noqa: ARG002
        return self.barrier()

    def __repr__(self) -> str:
        return f"ResilientGroup(rank={self._rank}, size={self._size}, bound={self._inner is not None})"


_CREATED: list[ResilientGroup] = []


def _create(store: Any, rank: int, size: int, timeout: Any) -> ResilientGroup:  # noqa: ARG001 - torch's factory
    """The backend factory torch calls in `init_process_group(backend="phoenixft")` (and for any subgroup
    a library creates with it): a group the job binds to its epochs' backends."""
    g = ResilientGroup(rank, size)
    _CREATED.append(g)
    return g


def register_backend() -> None:
    """Make `phoenixft` a torch.distributed backend (once per process)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def created() -> list[ResilientGroup]:
    """The groups torch created with this backend in this process (the world group first)."""
    return list(_CREATED)
