"""The rendezvous of an epoch's process groups runs through the job's store with sealed values: two ranks
meet and reduce, what they publish is sealed, and a value the job did not write (garbage, or a genuine
value copied from another rank's key) fails the build with a clear error instead of being used."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phoenixft.controlplane import sealed
from phoenixft.distributed.comm import EpochComm
from phoenixft.distributed.rendezvous import RendezvousStore, rendezvous_store

TOKEN = "Aq3-Zt9_pL0wYv2s" * 2
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def master() -> Iterator[dist.TCPStore]:
    sealed.bind(TOKEN, "run-rdv")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield store
    sealed.unbind()


def _client(master: dist.TCPStore, timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, timeout=timeout)


def _ranks(master: dist.TCPStore, world: int, epoch: int = 0) -> dict[int, Any]:
    """Each rank, on a thread with a store client of its own, builds the epoch's groups and sums its rank + 1."""
    got: dict[int, Any] = {}
    # every rank has its sum before any retires its groups: a gloo all-reduce can complete on one rank while its
    # last send to a peer is still in flight, and retiring then closes that peer's connection under it
    done = threading.Barrier(world, timeout=60)

    def rank(r: int) -> None:
        try:
            # (generous timeouts: the ranks are threads of one process, on a loaded machine gloo's sends took >10 s)
            comm = EpochComm(_client(master, datetime.timedelta(seconds=60)), epoch, r, world, 60.0)
            t = torch.full((3,), float(r + 1))
            comm.train.allreduce([t]).wait()
            got[r] = t.tolist()
            done.wait()
            comm.retire()
        except Exception as e:  # noqa: BLE001 - reported to the test
            got[r] = e
            done.abort()  # (the others stop waiting for this rank)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return got


def test_ranks_meet_through_sealed_values(master: dist.TCPStore) -> None:
    got = _ranks(master, 3)
    assert got == {r: [6.0] * 3 for r in range(3)}, got
    for r in range(3):  # what gloo published for each rank is sealed for its own key
        raw = bytes(master.get(f"e0/train/0/{r}"))
        assert raw.startswith(sealed.PREFIX) and sealed.unseal(f"rendezvous/e0/train/0/{r}", raw) is not None
        assert sealed.unseal(f"rendezvous/e1/train/0/{r}", raw, note=False) is None  # (not another epoch's)


def test_no_run_key_no_wrapper() -> None:
    sealed.unbind()
    assert not isinstance(rendezvous_store(dist.HashStore(), "e0/train"), RendezvousStore)


@pytest.mark.parametrize("forgery", ["garbage", "another rank's genuine value"])
def test_a_value_the_job_did_not_write_fails_the_build(master: dist.TCPStore, forgery: str) -> None:
    """Rank 0 of two builds alone; what it reads as rank 1's addresses was written by a stranger."""
    if forgery == "garbage":
        value = b"\x02\x00\x00\x00 an address of the stranger's choosing"
    else:  # a genuine sealed value of rank 0's key, under rank 1's: the MAC binds the key's name
        RendezvousStore(dist.PrefixStore("e0/train", _client(master)), "e0/train").set("0/9", b"genuine")
        value = bytes(master.get("e0/train/0/9"))
    master.set("e0/train/0/1", value)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        EpochComm(_client(master), 0, 0, 2, 10.0)
    assert "not sealed with this run's key" in str(err.value), str(err.value)
    assert time.monotonic() - t0 < 10.0
