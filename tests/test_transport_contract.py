"""One contract for every replica transport backend (protect/transport/): shared memory and TCP.

Each backend, seen through `ReplicaTransport`, must deliver bitwise the owner's committed half of the
step, count the bytes it fetched outside the group's collectives (`protect_shm_bytes`), and never read
the owner's other half. The suite checks this in-process against each backend, then between real ranks:
three ranks replicate in a ring (k=1) for a few steps with their shards in shared files, as in a run,
under every way the handshake can route the pairs: all through shared memory (`--replica-transport
auto`, one host: no payload collectives at all), mixed (one rank on "another host": the pairs that
touch it go over TCP, the others read shared memory, in the same collectives), and all over TCP. The
owner fills the half it does not commit with garbage before each job, so a holder that read it fails.
"""

from __future__ import annotations

import functools
import random
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import run_ranks

from phoenixft.protect.snapshot import ShardState
from phoenixft.protect.transport import (
    PeerShard,
    ReplicaTransport,
    Routes,
    ShmTransport,
    TcpTransport,
    TransportMode,
    host_key,
    shard_hello,
)
from phoenixft.protect.transport.shm import PATH_CHARS, Hello

NUMEL = 2500  # with 1000-element chunks: three payload chunks per row pair, the last one short
CHUNK = 1000
STEPS = 4
POISON = -7.0  # what the owner's uncommitted half holds while its holders copy the committed one
# (mode, the host key offset of each rank: ranks with different keys are on different hosts)
MODES = {"shm": ("auto", (0, 0, 0)), "mixed": ("auto", (0, 0, 1)), "tcp": ("tcp", (0, 0, 0))}
BACKEND = {"shm": ShmTransport, "tcp": TcpTransport}


def _payload(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, NUMEL, generator=torch.Generator().manual_seed(1000 * rank + step))


def _commit_poisoned(state: ShardState, rank: int, step: int) -> None:
    """Commit step `step` into the staging half, then poison the other half (a holder must not read it)."""
    half = state.staging()
    state.begin_write(half)
    state.data[half, 0] = float(step)  # the master row: never replicated
    state.data[half, 1:] = _payload(rank, step)
    state.commit(half, step, 0, (rank, 3))
    state.data[1 - half, 1:] = POISON


# ---------------------------------------------------------------------------------------------- in process
def _owner_end(name: str) -> ReplicaTransport:
    return ShmTransport() if name == "shm" else TcpTransport()


def _holder_end(name: str, owner: ShardState) -> ReplicaTransport:
    return ShmTransport(PeerShard(shard_hello(owner))) if name == "shm" else TcpTransport()


@pytest.mark.parametrize("name", sorted(BACKEND))
def test_a_backend_delivers_the_committed_half_and_counts_what_it_fetched(name: str, tmp_path: Path) -> None:
    """The group's collective simulated in-process: what the owner's end sends must be what the holder's
    end takes, chunk by chunk; then `complete` fetches the rest from the half the header names."""
    owner = ShardState(NUMEL, str(tmp_path / "owner"), rows=3, payload_from=1)
    for step in (1, 2, 3):
        _commit_poisoned(owner, 0, step)
        mine = owner.half_with(step)
        assert mine is not None
        payload = owner.payload(mine).reshape(-1)
        out, inn = _owner_end(name), _holder_end(name, owner)
        assert isinstance(out, BACKEND[name]) and out.over_group == inn.over_group
        buf = torch.full((payload.numel(),), float("nan"))
        for off in range(0, payload.numel(), CHUNK):
            m = min(CHUNK, payload.numel() - off)
            sent = out.send(1, payload[off : off + m])
            recv, into = inn.receive(0, buf[off : off + m])
            assert set(sent) == ({1} if out.over_group else set()) and set(recv) == ({0} if inn.over_group else set())
            if recv:
                assert recv[0] == sent[1].numel() == m and into is not None
                into.copy_(sent[1])
        fetched = 0 if inn.over_group else inn.complete(buf, mine)
        inn.close()
        assert fetched == (0 if inn.over_group else payload.numel() * 4)
        assert torch.equal(buf.view(torch.int32), payload.view(torch.int32))
        assert not (buf == POISON).any()


def test_the_transport_flag_parses_once_into_a_mode() -> None:
    assert TransportMode.parse("auto") is TransportMode.AUTO and TransportMode.parse("tcp") is TransportMode.TCP
    assert TransportMode.parse(TransportMode.TCP) is TransportMode.TCP
    with pytest.raises(ValueError, match=r"--replica-transport='shm' is invalid: expected one of auto, tcp"):
        TransportMode.parse("shm")


# ---------------------------------------------------------------------------------------------- real ranks
def _ring_rank(tmp: str, rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Every mode in turn on one process group: {mode: [(bitwise, crc, shm bytes, inbound, outbound)]}."""
    try:
        from phoenixft.protect.replication import ReplicaPlan, Replicator
        from phoenixft.protect.snapshot import Holding, checksum
        from phoenixft.protect.transport import shm

        key = shm.host_key()
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        src, dst = (rank - 1) % world, (rank + 1) % world
        res: dict[str, list[Any]] = {}
        for mode, (flag, hosts) in MODES.items():
            shm.host_key = lambda h=hosts[rank]: key ^ h  # type: ignore[misc]
            state = ShardState(NUMEL, f"{tmp}/{mode}-r{rank}-state", rows=3, payload_from=1)
            repl = Replicator(state, lambda s, m=mode: Holding(NUMEL, f"{tmp}/{m}-r{rank}-hold{s}", rows=2), CHUNK,
                              lambda: None, timeout_s=60.0, transport=flag)
            repl.configure(SimpleNamespace(repl=pg, world=world),  # type: ignore[arg-type]
                           ReplicaPlan(shard=rank, send_to=[dst], recv_from=[(src, src)]))
            out: list[Any] = []
            for step in range(1, STEPS + 1):
                _commit_poisoned(state, rank, step)
                repl.start(step)
                repl.wait(step)
                # the collective every rank enters after its wait (a run's next reduce-scatter): no owner
                # rewrites (poisons) a half before every holder finished copying it
                pg.allreduce([torch.zeros(1)]).wait()
                h = repl.holdings[src]
                got = h.half_with(step)
                want = _payload(src, step)
                routes = repl._routes
                assert routes is not None
                out.append((got is not None and torch.equal(h.payload(got).view(torch.int32), want.view(torch.int32)),
                            got is not None and h.crc_of(got) == checksum(want) and h.verify(got),
                            repl.stats.last_shm_bytes, routes.from_(src).name, routes.to(dst).name))
            repl.close()
            res[mode] = out
        q.put((rank, res))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


@pytest.fixture(scope="module")
def ring() -> Iterator[dict[int, Any]]:
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="phoenixft-test-"))
    try:
        res = run_ranks(functools.partial(_ring_rank, str(shm)), 3)  # (spawn pickles the target)
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()
    for r in range(3):
        assert isinstance(res[r], dict), res[r]
    yield res


# which backend carries each pair r-1 -> r (the holder r's view), per mode: rank 2 is elsewhere in `mixed`
PAIRS = {"shm": ("shm", "shm", "shm"), "mixed": ("tcp", "shm", "tcp"), "tcp": ("tcp", "tcp", "tcp")}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_replicas_between_ranks_are_bitwise_the_committed_half(mode: str, ring: dict[int, Any]) -> None:
    for r in range(3):
        assert [(bitwise, crc) for bitwise, crc, *_ in ring[r][mode]] == [(True, True)] * STEPS, (r, ring[r][mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_handshake_picks_each_pairs_backend_at_both_ends(mode: str, ring: dict[int, Any]) -> None:
    for r in range(3):
        inbound = {i for *_, i, _ in ring[r][mode]}
        outbound = {o for *_, o in ring[r][mode]}
        assert inbound == {PAIRS[mode][r]} and outbound == {PAIRS[mode][(r + 1) % 3]}, (r, ring[r][mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_bytes_read_through_shared_memory_are_counted(mode: str, ring: dict[int, Any]) -> None:
    for r in range(3):
        want = 8 * NUMEL if PAIRS[mode][r] == "shm" else 0  # two float32 rows of the shard per step
        assert {b for _, _, b, _, _ in ring[r][mode]} == {want}, (r, ring[r][mode])


# ---------------------------------------------------------------------------------------------- shm backend
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
    from phoenixft.distributed import comm
    from phoenixft.errors import PeerFailure

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
        Routes.handshake(None, 2, TransportMode.AUTO, mine, [1], [1], wait)
    assert len(calls) == 2
    assert _fds_on(theirs.path) == 0


def test_a_replicator_closed_during_a_job_closes_its_routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`close()` while the replication thread is in a job: the thread drops the epoch's routes when it
    stops, so the owners' files it reads are not held open for the rest of the process."""
    import threading

    from phoenixft.protect.replication import Replicator

    owner = ShardState(1000, str(tmp_path / "owner"), rows=3, payload_from=1)
    hello = shard_hello(owner)
    entered, release = threading.Event(), threading.Event()

    def job(self: Replicator, step: int) -> None:
        self._routes = Routes(inbound={1: ShmTransport(PeerShard(hello))})
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
