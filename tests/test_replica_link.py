"""Replicas through host shared memory (replica_link.py) against replicas over TCP, between real processes.

Three ranks replicate in a ring (k=1) for a few steps, their shards in shared files as in a run: with
`--replica-transport auto` on one host every holder reads its owner's committed half from the owner's
file (no payload collectives at all); with one rank on "another host" the pairs that touch it go over
TCP while the others read shared memory, in the same collectives; with `tcp` everything goes over TCP.
Every holding must end bitwise the owner's payload of the step, its committed checksum that of the
bytes, in each mode. Plus the handshake's message (a property test) and the reader's bounds.
"""

from __future__ import annotations

import functools
import random
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import run_ranks

from phoenixft.protect.replica_link import PATH_CHARS, Hello, PeerShard, shard_hello

NUMEL = 2500  # with 1000-element chunks: three payload chunks per row pair, the last one short
STEPS = 4


def _payload(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, NUMEL, generator=torch.Generator().manual_seed(1000 * rank + step))


def _worker_args(mode: str, tmp: str, rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        from phoenixft.protect import replica_link
        from phoenixft.protect.replication import ReplicaPlan, Replicator
        from phoenixft.protect.snapshot import Holding, ShardState, checksum

        if mode == "mixed" and rank == 2:  # this rank's shared memory is another host's
            key = replica_link.host_key() ^ 1
            replica_link.host_key = lambda: key  # type: ignore[assignment]
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        state = ShardState(NUMEL, f"{tmp}/r{rank}-state", rows=3, payload_from=1)
        repl = Replicator(state, lambda s: Holding(NUMEL, f"{tmp}/r{rank}-hold{s}", rows=2), 1000,
                          lambda: None, timeout_s=60.0, transport="tcp" if mode == "tcp" else "auto")
        src = (rank - 1) % world
        repl.configure(SimpleNamespace(repl=pg, world=world),  # type: ignore[arg-type]
                       ReplicaPlan(shard=rank, send_to=[(rank + 1) % world], recv_from=[(src, src)]))
        out: list[Any] = []
        for step in range(1, STEPS + 1):
            half = state.staging()
            state.begin_write(half)
            state.data[half, 0] = float(step)  # the master row: never replicated
            state.data[half, 1:] = _payload(rank, step)
            state.commit(half, step, 0, (rank, world))
            repl.start(step)
            repl.wait(step)
            h = repl.holdings[src]
            got = h.half_with(step)
            want = _payload(src, step)
            out.append((got is not None and torch.equal(h.payload(got).view(torch.int32), want.view(torch.int32))
                        and h.crc_of(got) == checksum(want) and h.verify(got), repl.stats.last_shm_bytes))
        repl.close()
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


@pytest.mark.parametrize("mode,shm_bytes", [
    ("auto", {0: 8 * NUMEL, 1: 8 * NUMEL, 2: 8 * NUMEL}),  # one host: every holder reads its owner's file
    ("mixed", {0: 0, 1: 8 * NUMEL, 2: 0}),  # rank 2 elsewhere: 2 -> 0 and 1 -> 2 over TCP, 0 -> 1 shared
    ("tcp", {0: 0, 1: 0, 2: 0}),
])
def test_replicas_are_bitwise_whatever_the_transport(mode: str, shm_bytes: dict[int, int]) -> None:
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="phoenixft-test-"))
    try:
        res = run_ranks(functools.partial(_worker_args, mode, str(shm)), 3)  # (spawn pickles the target)
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()
    for r in range(3):
        assert isinstance(res[r], list), res[r]
        assert [ok for ok, _ in res[r]] == [True] * STEPS, (r, res[r])
        assert {b for _, b in res[r]} == {shm_bytes[r]}, (r, res[r])


def test_hello_round_trips() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.choice([0, 1, 5, PATH_CHARS - 1, PATH_CHARS, PATH_CHARS + 1, rng.randrange(1, 2 * PATH_CHARS)])
        path = "".join(rng.choice("/abc-_.019é") for _ in range(n))
        h = Hello(host=rng.randrange(1 << 63), path=path, offsets=(rng.randrange(1 << 40), rng.randrange(1 << 40)),
                  numel=rng.randrange(1 << 40))
        back = Hello.decode(h.encode())
        fits = bool(path) and len(path.encode()) <= PATH_CHARS
        assert back == (h if fits else Hello(host=h.host, path="", offsets=h.offsets, numel=h.numel))


def test_a_reader_reads_each_half_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    from phoenixft.protect.snapshot import ShardState

    st = ShardState(1000, str(tmp_path / "s"), rows=3, payload_from=1)
    st.data.copy_(torch.randn(st.data.shape, generator=torch.Generator().manual_seed(3)))
    hello = shard_hello(st)
    assert hello.path == str(tmp_path / "s") + ".data" and hello.numel == 2000
    rd = PeerShard(hello)
    dst = torch.empty(2000)
    for half in (0, 1):
        rd.read_into(dst, half)
        assert torch.equal(dst.view(2, 1000), st.payload(half))
    with pytest.raises(ValueError):
        rd.read_into(torch.empty(1999), 0)
    with pytest.raises(ValueError):
        rd.read_into(dst, 2)
    rd.close()
    with open(hello.path, "r+b") as f:  # the owner's file is shorter than the hello says
        f.truncate(100)
    with pytest.raises(OSError, match="the shard needs"):
        PeerShard(hello)
    assert shard_hello(ShardState(10, None)).path == ""  # private memory: nothing to read from elsewhere


def _fds_on(path: str) -> int:
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            n += fd.resolve().as_posix().startswith(path)
        except OSError:
            continue
    return n


def test_a_handshake_that_fails_closes_the_files_it_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer lost mid-handshake (after the hellos, before the acks): the owners' files opened so far are
    closed, not kept open for the rest of the process (a dead node's deleted shard pinned in memory)."""
    from phoenixft.dist import comm
    from phoenixft.errors import PeerFailure
    from phoenixft.protect.replica_link import Links, host_key
    from phoenixft.protect.snapshot import ShardState

    owner = ShardState(1000, str(tmp_path / "owner"), rows=3, payload_from=1)
    mine = ShardState(1000, str(tmp_path / "mine"), rows=3, payload_from=1)
    theirs = shard_hello(owner)
    assert theirs.host == host_key()
    monkeypatch.setattr(comm, "alltoallv", lambda pg, world, sends, recv, **kw: (
        object(), None, {s: theirs.encode() for s in recv}))
    calls: list[str] = []

    def wait(work: Any, what: str) -> None:
        calls.append(what)
        if len(calls) == 2:  # the acks: the peer is gone
            raise PeerFailure(f"{what}: peer lost")

    with pytest.raises(PeerFailure, match="peer lost"):
        Links.handshake(None, 2, shard_hello(mine), [1], [1], wait)
    assert len(calls) == 2
    assert _fds_on(theirs.path) == 0


def test_a_replicator_closed_during_a_job_closes_its_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`close()` while the replication thread is in a job: the thread drops the epoch's links when it
    stops, so the owners' files it reads are not held open for the rest of the process."""
    import threading

    from phoenixft.protect.replica_link import Links
    from phoenixft.protect.replication import Replicator
    from phoenixft.protect.snapshot import ShardState

    owner = ShardState(1000, str(tmp_path / "owner"), rows=3, payload_from=1)
    hello = shard_hello(owner)
    entered, release = threading.Event(), threading.Event()

    def job(self: Replicator, step: int) -> None:
        self._links = Links(pull_from={1: PeerShard(hello)})
        entered.set()
        release.wait(10)

    monkeypatch.setattr(Replicator, "_replicate", job)
    rep = Replicator(ShardState(10, None), lambda shard: None, 100, lambda: None, 5.0)  # type: ignore[arg-type,return-value]
    rep.start(1)
    assert entered.wait(10)
    assert _fds_on(hello.path) == 1
    rep.close()
    release.set()
    rep._thread.join(10)
    assert not rep._thread.is_alive()
    assert _fds_on(hello.path) == 0
