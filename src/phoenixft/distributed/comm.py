"""Per-epoch communicators and interruptible waits.

Every recovery opens a new *epoch*; its process groups are built directly under a fresh store
prefix (`e{epoch}/train`, `e{epoch}/repl`, ...) with `ProcessGroupGloo(PrefixStore(...))`: no
`init_process_group`, no process restart. The values of each rendezvous are sealed with the run key
(distributed/rendezvous.py): whoever writes the store can make a build fail, not redirect it. With
`--device cuda` the groups that carry device tensors (data-parallel, tensor-parallel, pipeline
edges, tied embedding) are NCCL groups built the same way on the same prefixes
(`Device.new_group`); the groups that carry host memory stay gloo: replication, and `train`
(scalars, recovery transfers of the host snapshot, invariants).

A gloo collective whose peer died raises at once only on the dead peer's neighbours; the others
wait on live peers that have given up. So no wait here is a plain `work.wait()`: `wait_work`
waits in short slices and between them checks an abort condition (the control plane's failure
flag for this epoch), and gives up after a hard timeout. A failed epoch's groups are aborted and
their connections severed on a thread of their own, within a bound (`EpochComm.retire`,
distributed/retire.py), then released.

NCCL groups come from the device seam wrapped (distributed/nccl.py): their works report a failure
through `is_completed()` and `wait()` without torch's own `WorkNCCL::wait()`, which would abort the
communicator on the training thread before the survivor posts its recovery descriptor; the abort is
`EpochComm.retire`'s, after the descriptor. `alltoallv` is a host-memory transfer: device tensors
handed to it are copied to the host first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phoenixft.distributed.device import BIND_ENV, Device, gloo_group
from phoenixft.distributed.rendezvous import rendezvous_store
from phoenixft.distributed.retire import Retirement
from phoenixft.errors import PeerFailure
from phoenixft.parallel.layout import Layout

if TYPE_CHECKING:
    from phoenixft.controlplane import Store

__all__ = ["EpochComm", "XFER_LANES", "wait_work", "connect_store", "alltoallv", "gloo_group", "sever", "BIND_ENV",
           "BACKENDS"]

POLL_S = 0.02
XFER_LANES = 2  # connections per pair of the recovery-transfer group (see gloo_group)
BACKENDS = ("gloo", "nccl")


def connect_store(addr: str, timeout_s: float = 30.0) -> Store:
    """A new client of the control-plane store at `addr` (see `controlplane.connect`)."""
    from phoenixft.controlplane import connect

    return connect(addr, timeout_s)


def wait_work(work: Any, what: str, abort: Callable[[], str | None], timeout_s: float,
              max_nap_s: float = 0.0005) -> None:
    """Wait for a c10d collective; raise PeerFailure on error, on abort, or after timeout_s.

    Gloo works cannot be waited in slices: a `work.wait(timeout)` that expires while the data
    is moving fails the collective (seen here for all-reduce and all-to-all), and `abort()` does
    not wake a blocked wait. So the work is polled with `is_completed()` (naps growing from
    50 us to `max_nap_s`: 0.5 ms on the training thread; background work, which has a step's time,
    naps longer so that its polls take less of the training thread's GIL) and every 20 ms the abort
    condition - the control plane's failure flag of this epoch - is checked.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last = start
    nap = 0.00005
    while not work.is_completed():
        time.sleep(nap)
        nap = min(2 * nap, max_nap_s)
        now = time.monotonic()
        if now - last < POLL_S:
            continue
        last = now
        why = abort()
        if why:
            raise PeerFailure(f"{what}: {why}")
        if now > deadline:
            raise PeerFailure(f"{what}: timed out after {timeout_s:.1f}s")
    try:
        work.wait()  # completed: returns at once, or raises the error the work ended with (never aborts)
    except RuntimeError as e:
        raise PeerFailure(f"{what}: {str(e).splitlines()[0][:200]}") from None


def alltoallv(
    pg: Any,
    world: int,
    sends: dict[int, torch.Tensor],
    recv_numel: dict[int, int],
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, torch.Tensor, dict[int, torch.Tensor]]:
    """Targeted transfers as one collective: rank-to-tensor `sends`, and `recv_numel` floats from
    each source. Every rank of the group must call it (with empty dicts if it takes no part).
    Returns (work, output buffer, views of the output per source)."""
    in_splits = [sends[r].numel() if r in sends else 0 for r in range(world)]
    out_splits = [recv_numel.get(r, 0) for r in range(world)]
    parts = [sends[r].reshape(-1) for r in range(world) if r in sends]
    inp = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else torch.empty(0, dtype=dtype))
    inp = inp.cpu()  # a host-memory transfer (a no-op for host tensors)
    total = sum(out_splits)
    if out is None or out.numel() != total:
        out = torch.empty(total, dtype=dtype)
    views: dict[int, torch.Tensor] = {}
    off = 0
    for r in range(world):
        if out_splits[r]:
            views[r] = out[off : off + out_splits[r]]
            off += out_splits[r]
    work = pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
    return work, out, views


class EpochComm:
    """The process groups of one epoch, built on the epoch's store prefix, never registered with torch:

    - `train`: every rank (invariants, loss and norm sums, the final gather, ec decodes, reshards);
    - `repl`: every rank (replication);
    - `xfer`: only in an epoch whose plan moves state to a member (`transfer_members`: the ranks that
      send or receive, in rank order), those ranks, over `XFER_LANES` connections per pair: the
      recovery transfers of recovery/transfer.py (None on every other rank and epoch);
    - `dp`: the data-parallel peers at this rank's (pp, tp) (gradient buckets, ZeRO all-gather,
      buffer broadcast); `train` itself when the layout is data-parallel only and on gloo;
    - `tp`: this rank's tensor-parallel group (None when tp = 1);
    - `edges`: pipeline edges, one 2-rank group per direction and stage boundary this rank touches,
      keyed ("fwd" | "bwd", boundary p between stage p and p+1): gloo's send/recv works never report
      completion to a poll, so point-to-point transfers are broadcasts in these groups;
    - `emb`: first and last stage at this (dp, tp), for the tied embedding (None unless pp > 1);
    - `user`: with `user_group`, every rank: a script's own collectives (None otherwise).

    Every rank creates its groups in one global order (type, then stage boundary), so the blocking
    rendezvous of one group never waits on a member that is busy in another.
    """

    def __init__(self, store: dist.Store, epoch: int, rank: int, world: int, timeout_s: float,
                 backend: str = "gloo", layout: Layout | None = None, device: Device | None = None,
                 transfer_members: list[int] | None = None, user_group: bool = False) -> None:
        """`backend` is that of the training groups (dp, tp, edges, emb, user): gloo, or nccl with a CUDA
        `device`; `train` and `repl` are gloo either way. `user_group`: also `user`, every rank, for a
        script's own collectives (its DDP, FSDP, `dist.*` calls through the job's `ResilientGroup`)."""
        self.epoch, self.rank, self.world = epoch, rank, world
        self.layout = layout or Layout(world)
        self.backend = backend
        self.device = device or Device("cpu")
        to = timedelta(seconds=timeout_s)
        if backend not in BACKENDS:
            raise NotImplementedError(f"backend {backend!r}")
        # NCCL's own watchdog must never time an op out before our polled wait gives up
        nccl_to = timedelta(seconds=2 * timeout_s + 60.0)
        self._groups: list[tuple[str, Any]] = []  # (kind, group), in the order they were built
        self._gloo_sockets: set[str] | None = None
        self.retired = False
        self.retirement: Retirement | None = None  # the abort of these groups, once retired
        self._retire_lock = threading.Lock()
        before = set(_socket_fds())
        try:
            self._build(store, epoch, rank, world, to, nccl_to, transfer_members, user_group)
        except BaseException:
            # a build that failed half-way (a member did not arrive, a bad device): the groups already
            # built are aborted and released, not left connected with their threads running
            self._sockets = self._local_sockets(before)
            self.retire()
            raise
        self._sockets = self._local_sockets(before)

    def _local_sockets(self, before: set[str]) -> set[str]:
        """What the groups connected (gloo connects the full mesh as it builds); of NCCL groups nothing:
        NCCL's abort closes its own connections, and a socket NCCL keeps per process must not be cut."""
        if self.backend == "nccl" and self.device.is_cuda and self._gloo_sockets is not None:
            return self._gloo_sockets
        return set(_socket_fds()) - before

    def _group(self, store: dist.Store, name: str, members: list[int], kind: str, timeout: timedelta) -> Any:
        pg = self.device.new_group(kind, rendezvous_store(store, f"e{self.epoch}/{name}"), members.index(self.rank),
                                   len(members), timeout)
        self._groups.append((kind, pg))
        return pg

    def _build(self, store: dist.Store, epoch: int, rank: int, world: int, to: timedelta, nccl_to: timedelta,
               transfer_members: list[int] | None, user_group: bool = False) -> None:
        """Every group of this rank, in the one global order (see the class docstring)."""
        backend = self.backend

        def group(name: str, members: list[int], kind: str = "gloo") -> Any:
            return self._group(store, name, members, kind, nccl_to if kind == "nccl" else to)

        before = set(_socket_fds())
        self.train: Any = group("train", list(range(world)))
        self.repl: Any = group("repl", list(range(world)))
        self.xfer_members = sorted(set(transfer_members or []))
        self.xfer: Any = None
        if rank in self.xfer_members:
            self.xfer = gloo_group(rendezvous_store(store, f"e{epoch}/xfer"), self.xfer_members.index(rank),
                                   len(self.xfer_members), to, lanes=XFER_LANES, threads=2 * XFER_LANES)
            self._groups.append(("gloo", self.xfer))
        self._gloo_sockets = set(_socket_fds()) - before
        self.user: Any = group("user", list(range(world)), backend) if user_group else None
        lay, c = self.layout, self.layout.coord(rank)
        if lay.trivial and backend == "gloo":
            self.dp: Any = self.train
        else:
            self.dp = group(f"dp/{c.name()}", lay.dp_group(rank), backend)
        self.tp: Any = group(f"tp/pp{c.pp}.dp{c.dp}", lay.tp_group(rank), backend) if lay.tp > 1 else None
        self.edges: dict[tuple[str, int], Any] = {}
        col = lay.pp_group(rank)
        for p in range(lay.pp - 1):
            if c.pp in (p, p + 1):
                for way in ("fwd", "bwd"):
                    self.edges[(way, p)] = group(f"{way}{p}/dp{c.dp}.tp{c.tp}", [col[p], col[p + 1]], backend)
        self.emb: Any = None
        if lay.pp > 1 and c.pp in (0, lay.pp - 1):
            self.emb = group(f"emb/dp{c.dp}.tp{c.tp}", lay.embedding_group(rank), backend)

    def retire(self, wait_s: float | None = None) -> bool:
        """Abort every group and sever their connections, on a thread of its own (distributed/retire.py),
        and wait for that up to `wait_s` (default `retire.ABORT_WAIT_S`): True when every abort
        returned, False when it was abandoned (the caller goes on; the old groups stay with the abort's
        thread until it returns). A stuck op inside fails now instead of completing when a lost peer
        comes back. The groups are released once the aborts returned and nothing else refers to them
        (no list keeps retired groups). Retiring again starts nothing: it waits for the first retirement."""
        with self._retire_lock:  # (an abandoned build may be retired by two threads)
            if self.retirement is None:
                groups, self._groups = self._groups, []
                sockets: set[str] = getattr(self, "_sockets", set())
                self.retirement = Retirement(f"e{self.epoch}", groups, lambda: sever(sockets))
                self.retired = True
            retirement = self.retirement
        return retirement.wait(wait_s) if retirement is not None else True


def _socket_fds() -> dict[str, int]:
    """This process's sockets: inode ('socket:[N]') -> one descriptor of it."""
    out: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.setdefault(link, int(fd))
    return out


def sever(inodes: set[str]) -> int:
    """shutdown(SHUT_RDWR) every connected socket among `inodes` (listening ones are left alone: gloo's
    listener thread aborts the process when its socket fails); returns how many were severed."""
    n = 0
    for ino, fd in _socket_fds().items():
        if ino not in inodes:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.getpeername()  # raises for a listening (unconnected) socket
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # closes the duplicate only
    return n
