"""Recovery transfers (recovery/transfer.py): the chunk and stripe schedule against generated plans
(pure logic), the streaming checksum, and the schedule carried out by real gloo groups between
processes - several sources striping one receiver, a source serving two receivers - with the bytes
landing in place, bit for bit."""

from __future__ import annotations

import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import run_ranks

from phoenixft.distributed.comm import XFER_LANES, gloo_group
from phoenixft.distributed.topology import Topology
from phoenixft.protect.snapshot import StreamChecksum, checksum
from phoenixft.recovery.transfer import Piece, post, schedule, wait_all


def _check(need: dict[int, list[int]], numel: int, chunk: int, rounds: list[list[Piece]]) -> None:
    got: dict[int, list[tuple[int, int]]] = {d: [] for d in need}
    for pieces in rounds:
        assert pieces, "an empty round"
        senders = [p.src for p in pieces]
        assert len(senders) == len(set(senders)), f"a rank sends twice in one round: {pieces}"
        for d in {p.dst for p in pieces}:
            mine = sorted((p for p in pieces if p.dst == d), key=lambda p: p.src)
            for a, b in zip(mine, mine[1:], strict=False):
                assert a.hi == b.lo, f"receiver {d}'s pieces are not contiguous in source order: {mine}"
        for p in pieces:
            assert p.src in need[p.dst] and p.src != p.dst
            assert 0 <= p.lo < p.hi <= numel and p.hi - p.lo <= chunk
            got[p.dst].append((p.lo, p.hi))
    for d, spans in got.items():
        # every element exactly once, in increasing order over the rounds (what the streaming checksum needs)
        pos = 0
        for lo, hi in spans:
            assert lo == pos, f"receiver {d}: gap or overlap at {pos}"
            pos = hi
        assert pos == numel, f"receiver {d} got {pos} of {numel}"


def test_schedule_against_generated_plans() -> None:
    rng = random.Random(14)
    for _ in range(3000):
        world = rng.randint(2, 9)
        ranks = list(range(world))
        dsts = rng.sample(ranks, rng.randint(1, world - 1))
        srcs_all = [r for r in ranks if r not in dsts]
        need = {d: rng.sample(srcs_all, rng.randint(1, len(srcs_all))) for d in dsts}
        numel, chunk = rng.randint(0, 5000), rng.randint(1, 700)
        rounds = schedule(need, numel, chunk)
        _check(need, numel, chunk, rounds)
        if numel:  # K sources, one receiver: ceil(numel / (K chunk)) rounds - the stripes run in parallel
            d = dsts[0]
            one = schedule({d: need[d]}, numel, chunk)
            assert len(one) == -(-numel // (len(set(need[d])) * chunk))
        else:
            assert rounds == []
        assert schedule(need, numel, chunk) == rounds  # the same on every rank


def test_schedule_refuses_bad_plans() -> None:
    with pytest.raises(ValueError):
        schedule({0: [0]}, 10, 4)
    with pytest.raises(ValueError):
        schedule({0: []}, 10, 4)
    with pytest.raises(ValueError):
        schedule({0: [1]}, 10, 0)


def test_stream_checksum_equals_one_shot() -> None:
    rng = random.Random(5)
    for _ in range(50):
        t = torch.randn(rng.randint(1, 20000))
        h = StreamChecksum(t)
        pos = 0
        while pos < t.numel():
            nxt = min(t.numel(), pos + rng.randint(1, 3000))
            h.update(pos, nxt)
            assert (h.value(t.numel()) is None) == (nxt < t.numel())
            pos = nxt
        assert h.value(t.numel()) == checksum(t)
    with pytest.raises(ValueError):
        StreamChecksum(torch.zeros(10)).update(3, 5)


NUMEL = 1_000_003
PLANS = [
    {2: [0, 1]},  # two sources stripe one receiver (a spare, two data-parallel survivors)
    {1: [0], 2: [0]},  # one source serves two receivers in turn
    {0: [2, 3], 1: [3]},  # a shared source and a stripe at once
]


def _data(src: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)  # every source holds the same tensor (parameters at r)
    return torch.randn(NUMEL, generator=g) + 0 * src


def _worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
        one = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, world, timedelta(seconds=30))
        # what a recovery uses: the transfer group's XFER_LANES connections per pair, rounds taking them in turn
        lanes = gloo_group(dist.PrefixStore("x", store), rank, world, timedelta(seconds=30), lanes=XFER_LANES,
                           threads=2 * XFER_LANES)

        def wait(work: object, what: str) -> None:
            deadline = time.monotonic() + 30
            while not work.is_completed():  # type: ignore[attr-defined]
                if time.monotonic() > deadline:
                    raise TimeoutError(what)
                time.sleep(0.0005)
            work.wait()  # type: ignore[attr-defined]

        out = []
        for pg, need in [(g, n) for g in (one, lanes) for n in PLANS]:
            rounds = schedule(need, NUMEL, 100_000)
            srcs = {s for v in need.values() for s in v}
            send = {d: _data(rank) for d in need} if rank in srcs else {}
            recv = torch.full((NUMEL,), float("nan")) if rank in need else None
            h = StreamChecksum(recv) if recv is not None else None
            wait_all(post(pg, world, rank, rounds, send, recv), wait, "test", h.update if h else None)
            if recv is not None and h is not None:
                out.append((torch.equal(recv, _data(-1)), h.value(NUMEL) == checksum(_data(-1))))
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_transfers_between_processes_land_in_place_bit_for_bit() -> None:
    res = run_ranks(_worker, 4)
    for r, out in res.items():
        assert isinstance(out, list), f"rank {r}: {out}"
        assert all(a and b for a, b in out), f"rank {r}: {out}"
    assert sum(len(v) for v in res.values()) == 2 * sum(len(p) for p in PLANS)


def test_transfer_members_are_every_sender_and_receiver() -> None:
    """Property: the ranks a plan's transfer group is built on are exactly those that send or receive
    in its parameter or optimizer rounds (a rank missing would hang the group; an extra one costs
    connections), over generated plans."""
    rng = random.Random(6)
    for _ in range(2000):
        world = rng.randint(2, 12)
        topo = Topology(epoch=1, nodes=[f"n{i}" for i in range(world)], workers_per_node=1, replicas=1,
                        resume_step=3)
        for dst in rng.sample(range(world), rng.randint(0, world - 1)):
            others = [r for r in range(world) if r != dst]
            psrcs = rng.sample(others, rng.randint(1, min(4, len(others)))) if rng.random() < 0.7 else []
            topo.transfers.append({"dst": dst, "shard": dst, "param_src": psrcs[0] if psrcs else -1,
                                   "param_srcs": sorted(psrcs), "opt_src": rng.choice([-1, *others]), "crc": 0})
        used = set()
        for need in (topo.param_need(), topo.opt_need()):
            for rd in schedule(need, 1000, 300):
                used.update(r for p in rd for r in (p.src, p.dst))
        assert set(topo.transfer_ranks()) == used
        assert topo.transfer_ranks() == sorted(used)


def test_verified_memo_is_dropped_when_the_half_changes() -> None:
    """A recovery's sender skips re-hashing a holding only while it is exactly what `verify` saw."""
    from phoenixft.protect.snapshot import H_CRC, H_VALID, Holding

    h = Holding(1000, rows=2)
    h.begin_write(0)
    h.payload(0).normal_()
    h.commit(0, 5, checksum(h.payload(0)), (1, 2))
    assert not h.verified(0)  # never verified
    assert h.verify(0) and h.verified(0)
    h.header[0, H_CRC] = 123  # another step's checksum in the header: not the half that was verified
    assert not h.verified(0)
    h.header[0, H_CRC] = checksum(h.payload(0))
    assert h.verify(0) and h.verified(0)
    h.header[0, H_VALID] = 0
    assert not h.verified(0)
    h.header[0, H_VALID] = 1
    h.begin_write(0)  # rewritten: verified again only after a new verify
    h.commit(0, 5, checksum(h.payload(0)), (1, 2))
    assert not h.verified(0)
    h.payload(0)[0, 0] += 1.0  # corrupted at rest: verify fails and sets no memo
    assert not h.verify(0) and not h.verified(0)

