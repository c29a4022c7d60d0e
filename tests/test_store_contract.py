"""The control-plane store protocol (`controlplane.Store`): one contract suite run against both
backends, torch's TCPStore (`tcpstore`) and a real 3-member etcd cluster (`etcd`).

Each test gets a fresh, empty namespace: a TCPStore served for that test alone, or a fresh key prefix
on the module's etcd cluster. The `etcd` cases need the `etcd` binary (Debian: etcd-server); without
it they skip, except on CI (CI=true), where a missing etcd is a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from phoenixft.controlplane import (
    Heartbeat,
    LogReader,
    Store,
    clients_opened,
    connect,
    describe,
    exists_many,
    get_nowait,
    guarded_set,
    multi_get_nowait,
    poll_interval,
)
from phoenixft.controlplane.etcd_cluster import EtcdCluster, etcd_binary

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """One cluster for the module's etcd cases (started only if one runs)."""
    if etcd_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("CI: no etcd binary (apt-get install etcd-server): the etcd backend is untested")
        pytest.skip("no etcd binary (apt-get install etcd-server): the etcd backend is not tested here")
    c = EtcdCluster(3, tag="pytest-contract")
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(params=["tcpstore", "etcd"])
def addr(request: pytest.FixtureRequest) -> Iterator[str]:
    """The address of a fresh, empty namespace on the backend under test."""
    if request.param == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        yield f"{cluster.url}/contract/{uuid.uuid4().hex[:8]}"
        return
    from phoenixft.controlplane.server import serve_store

    server = serve_store("127.0.0.1", 0)
    yield server.addr
    del server


@pytest.fixture
def clients(addr: str) -> Callable[..., Store]:
    """A factory of new clients of the test's namespace."""

    def make(timeout_s: float = 10.0) -> Store:
        return connect(addr, timeout_s=timeout_s)

    return make


@pytest.fixture
def store(clients: Callable[..., Store]) -> Store:
    return clients()


# ---------------------------------------------------------------------- c10d key-value operations
def test_set_get_check_delete(store: Store) -> None:
    assert not store.check(["a"])
    store.set("a", "1")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xffbin"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"])
    assert store.delete_key("a") and not store.check(["a"]) and not store.delete_key("a")


def test_get_blocks_until_set_and_wait_times_out(clients: Callable[..., Store]) -> None:
    store, other = clients(), clients()
    threading.Timer(0.3, lambda: other.set("late", "here")).start()
    t = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.2 < time.monotonic() - t < 5.0
    t = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout"):
        store.wait(["never"], timedelta(seconds=0.5))
    assert time.monotonic() - t < 3.0


def test_add_is_atomic_across_clients(clients: Callable[..., Store]) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        s = clients(20.0)
        for _ in range(15):
            v = s.add("n", 1)
            with lock:
                results.append(v)

    ts = [threading.Thread(target=bump) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert sorted(results) == list(range(1, 61))  # every value handed out exactly once
    assert clients().get("n") == b"60"  # (a read after the writes: linearizable)
    # add(key, 0) is how pollers read a counter: on etcd a serializable read, answered by the member the client
    # talks to, which may apply the last write a few milliseconds late; it must get there
    poller, deadline = clients(), time.monotonic() + 10
    while (seen := poller.add("n", 0)) != 60 and time.monotonic() < deadline:
        assert seen < 60, seen
        time.sleep(0.01)
    assert seen == 60


def test_append_multi_and_compare_set(store: Store) -> None:
    store.append("log", "x\n")
    store.append("log", "y\n")
    assert store.get("log") == b"x\ny\n" and store.check(["log"])
    store.multi_set(["p", "q"], ["1", "2"])
    assert store.multi_get(["p", "q", "log"]) == [b"1", b"2", b"x\ny\n"]
    assert store.compare_set("c", "", "v1") == b"v1"
    assert store.compare_set("c", "other", "v2") == b"v1"
    assert store.compare_set("c", "v1", "v3") == b"v3" and store.get("c") == b"v3"


def test_num_keys_counts_what_was_written(store: Store) -> None:
    before = store.num_keys()
    store.multi_set(["k1", "k2", "k3"], ["1", "2", "3"])
    assert store.num_keys() == before + 3


# ---------------------------------------------------------------------- polls
def test_reads_without_blocking(store: Store) -> None:
    key = f"h{uuid.uuid4().hex[:8]}"
    t = time.monotonic()
    assert store.get_nowait(key) is None and get_nowait(store, key) is None
    assert time.monotonic() - t < 2.0  # (not a blocking get that timed out)
    store.set(key, "v")
    assert store.get_nowait(key) == b"v"
    # a linearizable read (who leads, before a job's keys are removed) answers alike, without blocking
    assert store.get_nowait(key, serializable=False) == b"v" and store.get_nowait(key + "x", serializable=False) is None
    assert exists_many(store, [key, key + "x", key]) == [True, False, True]
    assert store.exists_many([key, key + "x"], serializable=False) == [True, False]
    assert multi_get_nowait(store, [key]) == [b"v"]
    if store.has_leases:  # keys can vanish there: a missing one reads as None, at once
        assert multi_get_nowait(store, [key, key + "x"]) == [b"v", None]


def test_appended_log_is_read_incrementally(store: Store) -> None:
    key = "hosts/history"
    assert store.read_appended(key, 0)[0] == b""
    store.append(key, "a\n")
    store.append(key, "b\n")
    raw, cursor = store.read_appended(key, 0)
    assert raw == b"a\nb\n"
    store.append(key, "c\n")
    raw, cursor = store.read_appended(key, cursor)
    assert raw == b"c\n" and store.read_appended(key, cursor)[0] == b""
    raw, cursor = store.read_appended(key, 0)
    assert raw == b"a\nb\nc\n" and store.read_appended(key, cursor)[0] == b""


def test_a_log_is_taken_incrementally_however_long_it_grew(store: Store) -> None:
    """`log_push`/`log_take` (the events): each take returns what was pushed since the last, in order; on a
    TCPStore it pops a queue, so a take costs what was added, not the log's length, and a `set` or `delete_key`
    of the log's name by someone else touches nothing pushed."""
    key = "events"
    log = LogReader(store, key)
    assert log.read() == ""
    for i in range(50):
        store.log_push(key, f"{i}\n")
    assert log.read() == "".join(f"{i}\n" for i in range(50)) and log.read() == ""
    store.log_push(key, b"x\n")
    if store.consumes_logs:
        store.set(key, "junk")
        store.delete_key(key)
        store.log_push(key, b"\xff" * (1 << 20))  # (a megabyte pushed once is read once)
        assert log.read_bytes() == b"x\n" + b"\xff" * (1 << 20) and log.read_bytes() == b""
    else:
        assert log.read() == "x\n"


# ---------------------------------------------------------------------- the client and the backend
def test_the_address_reaches_the_same_namespace(store: Store, addr: str) -> None:
    store.set("here", "1")
    again = connect(store.address, 5.0)
    assert again.get("here") == b"1"
    assert describe(addr).replicated == store.replicated
    assert describe(store.address).replicated == store.replicated


def test_an_independent_client_waits_without_holding_up_this_one(store: Store) -> None:
    """A blocking wait on `independent()` (another thread) leaves this client's calls free."""
    other = store.independent()
    started, done = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        try:
            other.wait(["flag"], timedelta(seconds=20))
        finally:
            done.set()

    threading.Thread(target=block, daemon=True).start()
    assert started.wait(5)
    time.sleep(0.3)  # (the wait is in progress)
    t = time.monotonic()
    for _ in range(5):
        assert not store.check(["nothing"])
    assert time.monotonic() - t < 2.0, "the other thread's wait held this client up"
    assert not done.is_set()
    store.set("flag", "1")
    assert done.wait(10), "the wait did not see the key set through the other client"


def test_call_timeout_is_settable(store: Store) -> None:
    store.timeout_s = 1.5
    assert store.timeout_s == 1.5
    t = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout"):
        store.get("never")  # a blocking get now gives up after the new deadline
    assert time.monotonic() - t < 6.0


def test_capabilities_are_consistent(store: Store) -> None:
    assert store.poll_s >= 0 and store.abort_check_s >= 0 and store.wait_slice_s > 0
    assert poll_interval(store, 0.025) == max(0.025, store.poll_s)
    if store.costly_reads:  # a loop on such a store looks less often than its default
        assert store.abort_check_s > 0 and store.poll_s > 0
    if store.has_leases:  # leases live on a replicated service (heartbeats expire with their writer)
        assert store.replicated


def test_clear_job_removes_keys_that_outlive_the_run(store: Store) -> None:
    store.set("x", "1")
    removed = store.clear_job()
    if store.replicated:  # the keys outlive every process of the job: they are removed
        assert removed >= 1 and store.num_keys() == 0
    else:  # they end with the store's server
        assert removed == 0 and store.check(["x"])


def test_independent_opens_a_client_only_where_needed(store: Store) -> None:
    n = clients_opened()
    other = store.independent()
    assert clients_opened() - n == (0 if other is store else 1)
    other.set("k", "v")
    assert store.get("k") == b"v"


def test_heartbeat_and_unguarded_writes(store: Store) -> None:
    hb = Heartbeat(store, "hb/n0", ttl_s=5)
    hb.beat("1")
    hb.beat("2")
    assert store.get_nowait("hb/n0") == b"2"
    assert guarded_set(store, None, ["topo", "journal"], ["t", "j"])
    assert store.multi_get(["topo", "journal"]) == [b"t", b"j"]


_RDZV = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    sys.path.insert(0, {src!r})
    from phoenixft.controlplane import connect
    rank, addr, pre = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    s = connect(addr, 20.0)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(pre, s.c10d), rank, 3, timedelta(seconds=20))
    x = torch.full((4,), float(rank + 1))
    pg.allreduce([x]).wait()
    print("SUM", x[0].item(), flush=True)
""")


def test_gloo_rendezvous_on_the_store(addr: str, tmp_path: Path) -> None:
    """Process groups meet through either backend (`Store.c10d`; 3 processes, one all-reduce)."""
    script = tmp_path / "rdzv.py"
    script.write_text(_RDZV.format(src=SRC))
    pre = uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), addr, pre], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for r in range(3)]
    try:
        outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all("SUM 6.0" in o for o in outs), outs
