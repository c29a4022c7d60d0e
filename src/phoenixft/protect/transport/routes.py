"""Which backend carries each of a rank's (owner, holder) pairs: the link handshake, once per epoch.

On the replication group, every rank of it: each owner tells its holders where its shard lives
(`shm.Hello`: host key, file, byte offsets of both halves; an all-zero hello under
`--replica-transport tcp` or for a shard not in a shared file); each holder opens the file if it is on
the owner's host and says whether it will read from there or needs the bytes sent; an all-reduce
tells every rank whether every pair of the group reads through shared memory, in which case the
per-step payload collectives are skipped altogether (otherwise a pair that reads through shared memory
takes part in them with nothing to send or receive, so that every rank still makes the same sequence
of collective calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.protect.transport.base import ReplicaTransport, TransportMode
from phoenixft.protect.transport.shm import Hello, PeerShard, ShmTransport, shard_hello
from phoenixft.protect.transport.tcp import TcpTransport

__all__ = ["Routes"]

Wait = Callable[[Any, str], None]


@dataclass
class Routes:
    """One epoch's outcome of the handshake, for one rank: the backend of each of its pairs."""

    outbound: dict[int, ReplicaTransport] = field(default_factory=dict)  # holder rank -> my shard's pair with it
    inbound: dict[int, ReplicaTransport] = field(default_factory=dict)  # owner rank -> its shard's pair with me
    over_group: bool = True  # some pair of the group moves over the group: every rank makes the payload collectives

    def to(self, dst: int) -> ReplicaTransport:
        return self.outbound.get(dst, _TCP)

    def from_(self, src: int) -> ReplicaTransport:
        return self.inbound.get(src, _TCP)

    def close(self) -> None:
        for t in self.inbound.values():
            t.close()
        self.inbound.clear()

    @classmethod
    def handshake(cls, pg: Any, world: int, mode: TransportMode, state: Any, send_to: list[int], srcs: list[int],
                  wait: Wait) -> Routes:
        """Run the epoch's handshake for the shard `state` (every rank of the group calls it)."""
        return cls.exchange(pg, world, shard_hello(state) if mode is TransportMode.AUTO else None, send_to, srcs,
                            wait)

    @classmethod
    def exchange(cls, pg: Any, world: int, mine: Hello | None, send_to: list[int], srcs: list[int],
                 wait: Wait) -> Routes:
        """The handshake with this rank's hello; `mine` None: every pair of this rank goes over TCP."""
        from phoenixft.distributed.comm import alltoallv

        n = Hello.numel_of()
        me = mine.encode() if mine is not None else torch.zeros(n, dtype=torch.int64)
        work, _, got = alltoallv(pg, world, {d: me for d in send_to}, {s: n for s in srcs}, dtype=torch.int64)
        wait(work, "replica link handshake")
        out = cls()
        try:
            for s in srcs:
                h = Hello.decode(got[s])
                if mine is None or not h.path or h.host != mine.host or h.numel != mine.numel:
                    continue
                try:
                    out.inbound[s] = ShmTransport(PeerShard(h))
                except OSError:
                    continue  # not readable here after all: that pair goes over TCP
            acks = {s: torch.tensor([1 if s in out.inbound else 0], dtype=torch.int64) for s in srcs}
            work, _, back = alltoallv(pg, world, acks, {d: 1 for d in send_to}, dtype=torch.int64)
            wait(work, "replica link handshake")
            out.outbound = {d: _SHM_OWNER for d in send_to if int(back[d][0]) == 1}
            every = torch.tensor([1 if len(out.outbound) == len(send_to) and len(out.inbound) == len(srcs) else 0],
                                 dtype=torch.int64)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # (torch's stubs: RedOpType)
            work = pg.allreduce([every], opts)
            wait(work, "replica link handshake")
            out.over_group = not bool(int(every[0]))
        except BaseException:  # a peer lost mid-handshake: the files opened so far are not kept open
            out.close()
            raise
        return out


_TCP = TcpTransport()
_SHM_OWNER = ShmTransport()  # an owner's end of a shared-memory pair holds nothing
