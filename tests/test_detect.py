"""The coordinator's failure detection during a recovery (`FailureDetector.gather`), its timing logic
on stubbed inputs: which nodes are silent, exited or restarted is given, the clock is real."""

from __future__ import annotations

import time
from typing import Any

import pytest

from phoenixft.config import RunConfig
from phoenixft.controlplane import values
from phoenixft.coordinator import detect
from phoenixft.coordinator.detect import FailureDetector
from phoenixft.coordinator.shared import Membership


class _Store:
    def add(self, key: str, n: int) -> int:
        return 0  # nobody posts a descriptor, nobody exits

    def check(self, keys: list[str]) -> bool:
        return False  # (the hints are read with `get`: none is there)

    def get_nowait(self, key: str) -> bytes | None:
        return None


class _Job:
    def __init__(self) -> None:
        self.store, self.g = _Store(), 1
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def posted(self, e: int, nodes: list[str]) -> bool:
        return False


class _Silent(FailureDetector):
    """Every node and spare silent from the start; nothing exits or restarts."""

    def exited(self, nodes: list[str]) -> set[str]:
        return set()

    def restarts(self, nodes: list[str]) -> set[str]:
        return set()

    def stale(self, nodes: list[str], now: float) -> set[str]:
        return set(nodes)


def test_every_node_silent_is_fenced_after_the_timeout_and_the_silent_wait_not_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All nodes silent at once (the head cut off, or all of them dead): the gather waits --failure-timeout
    plus ALL_SILENT_WAIT_S, then fences. When the silent wait ran out, the gather took it for "heard from
    again" and gave everyone a full --failure-timeout more (and a grace of as much)."""
    monkeypatch.setattr(detect, "ALL_SILENT_WAIT_S", 1.0)
    monkeypatch.setattr(detect, "HB_RECOVER_S", 0.02)
    cfg = RunConfig(nodes=3, spares=1, failure_timeout=1.5)
    state = Membership()
    state.spare_pool = ["s0"]
    job = _Job()
    det = _Silent(job, cfg, state, admission=None, gather_poll_s=0.01)  # type: ignore[arg-type]
    t = time.monotonic()
    dead, fenced, restarted = det.gather(1, ["n0", "n1", "n2"])
    took = time.monotonic() - t
    assert dead == fenced == {"n0", "n1", "n2"} and restarted == set()
    assert [k for k, _ in job.events] == ["all_silent"]
    assert 2.4 <= took < 3.4, took  # 1.5 + 1.0 (+ polls), not a third 1.5 s wait


def test_heartbeats_unread_while_the_coordinator_or_its_store_was_stopped_are_not_staleness(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`phoenixft run` (the TCPStore's process) SIGSTOPped for 8 s during a run, --failure-timeout 3: no beat
    could land and the coordinator read nothing meanwhile, yet its first read afterwards judged every node
    silent for 8 s and started a recovery that found nobody dead (a spurious `reconfigure` in the report).
    Silence this process could not observe is not counted; a node that stays silent is still found."""
    from types import SimpleNamespace

    clock = [100.0]
    monkeypatch.setattr(detect, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))

    class _Beats:
        def check(self, keys: list[str]) -> bool:
            return True

        def multi_get_nowait(self, keys: list[str]) -> list[bytes | None]:
            return [b"same"] * len(keys)  # nothing beats while the store is stopped

    job = _Job()
    job.store = _Beats()  # type: ignore[assignment]
    det = FailureDetector(job, RunConfig(nodes=2, failure_timeout=3.0), Membership(), admission=None,  # type: ignore[arg-type]
                          gather_poll_s=0.01)
    nodes = ["n0", "n1"]
    assert det.stale(nodes, clock[0]) == set()
    for _ in range(8):  # polled every 0.25 s: 2 s of silence, within the timeout
        clock[0] += 0.25
        assert det.stale(nodes, clock[0]) == set()
    clock[0] += 8.0  # stopped: the next read returns 8 s later
    assert det.stale(nodes, clock[0]) == set(), "silence nobody could observe was counted"
    for _ in range(12):  # 3 s more of silence, observed: within the timeout
        clock[0] += 0.25
        assert det.stale(nodes, clock[0]) == set()
    clock[0] += 0.25
    assert det.stale(nodes, clock[0]) == {"n0", "n1"}  # silent for longer than the timeout, seen: stale


def test_forged_and_replayed_heartbeats_keep_no_dead_node_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat counts when it is sealed with the run key and its writer's monotonic clock grew: a
    stranger who writes garbage, or writes an older sealed beat back, into a silent node's key does not
    delay its detection; a genuine new beat does count."""
    from types import SimpleNamespace

    from phoenixft.controlplane import keys, sealed

    clock = [100.0]
    monkeypatch.setattr(detect, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    sealed.bind("t" * 32, "rid")
    beats: dict[str, bytes] = {}

    class _Beats:
        def check(self, names: list[str]) -> bool:
            return all(n in beats for n in names)

        def multi_get_nowait(self, names: list[str]) -> list[bytes | None]:
            return [beats.get(n) for n in names]

    job = _Job()
    job.store = _Beats()  # type: ignore[assignment]
    det = FailureDetector(job, RunConfig(nodes=1, failure_timeout=3.0), Membership(), admission=None,  # type: ignore[arg-type]
                          gather_poll_s=0.01)
    key = keys.heartbeat("n0")
    old = sealed.beat_value(key)
    time.sleep(0.001)
    beats[key] = sealed.beat_value(key)
    assert det.stale(["n0"], clock[0]) == set()
    for i in range(16):  # 4 s of a stranger's writes, the node itself silent: garbage, and the older beat
        clock[0] += 0.25
        beats[key] = old if i % 2 else b"garbage %d" % i
        silent = det.stale(["n0"], clock[0])
    assert silent == {"n0"}, "forged or replayed heartbeats kept a silent node alive"
    beats[key] = sealed.beat_value(key)  # the node beats again
    clock[0] += 0.25
    assert det.stale(["n0"], clock[0]) == set()


class _Counting:
    """A real store's client that records the keys looked for."""

    def __init__(self, store: Any) -> None:
        self._s, self.looked = store, []  # type: list[str]

    def exists_many(self, names: list[str], serializable: bool = False) -> list[bool]:
        self.looked += names
        out: list[bool] = self._s.exists_many(names, serializable)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)


def test_restarts_look_only_at_the_workers_of_nodes_whose_agent_restarted_one() -> None:
    """On a live TCPStore (one round trip per key looked for): the workers restarted in place are found by
    their sealed `wexit/<wid>` keys, looking at the workers of only those nodes whose agent set its sealed
    node key. A node key that does not verify (a stranger's) costs a look at nothing more."""
    from phoenixft.controlplane import keys, sealed
    from phoenixft.controlplane.server import serve_store
    from phoenixft.coordinator.shared import Job
    from phoenixft.distributed.comm import connect_store

    server = serve_store("127.0.0.1", 0)
    st = _Counting(connect_store(server.addr))
    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run-detect")
    try:
        job = Job.__new__(Job)
        job.store, job.g = st, 4
        nodes = [f"n{i}" for i in range(64)]
        det = FailureDetector(job, RunConfig(nodes=64, workers_per_node=4), Membership(), admission=None,  # type: ignore[arg-type]
                              gather_poll_s=0.01)
        assert det.restarts(nodes) == set()
        assert len(st.looked) == 64, "a node key per node, no worker's key"
        for wid in ("n7.2", "n40.0", "n40.3"):  # as the agents write them: the worker's key, the node's, the hint
            sealed.put(st, keys.worker_exit(wid), "{}")
            sealed.put(st, keys.node_restarts(wid.split(".")[0]), wid)
            sealed.hint(st, keys.WORKER_EXITS)
        st.set(keys.node_restarts("n9"), "forged")
        st.looked.clear()
        assert det.restarts(nodes) == {"n7.2", "n40.0", "n40.3"}
        assert sorted(k for k in st.looked if k.startswith("wexit/")) == sorted(
            keys.worker_exit(f"n{n}.{i}") for n in (7, 40) for i in range(4))
        st.looked.clear()
        assert det.restarts(nodes) == set() and st.looked == [], "the hint did not move: no key looked at"
        st.delete_key(keys.worker_exit("n40.0"))  # dealt with by a recovery; its node key stays
        sealed.hint(st, keys.WORKER_EXITS)
        assert det.restarts(nodes) == {"n7.2", "n40.3"}
    finally:
        sealed.unbind()
        values._noted.clear()
