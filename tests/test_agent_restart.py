"""An agent's decision to restart a worker in place (`_Node._exited`, `_Node.restart`), on a live TCPStore.

A worker that exits while the control plane does not answer (a store slow for a moment, a reconnect) is
not given up: whether to restart it is decided once the store answers again, within
--control-plane-timeout. Giving it up at once left a healthy node without its worker, and a node with no
worker left the job (a hot-swap, or a failed run without a spare, for a failure an in-place restart heals).

    .venv/bin/python -m pytest -q tests/test_agent_restart.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import pytest

from phoenixft.config import RunConfig
from phoenixft.controlplane import keys, sealed, values
from phoenixft.controlplane.server import serve_store
from phoenixft.distributed.comm import connect_store
from phoenixft.runtime import agent


class _Unanswered:
    """A store that does not answer (every call times out)."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError("the store did not answer within 5s")
        return fail


class _Notice:
    drain_signal = 0

    def expired(self) -> bool:
        return False


class _NoCheck:
    def owns(self, pid: int) -> bool:
        return False


def _child_exiting(code: int) -> int:
    """A child process that exits with `code` (reaped by the agent's `os.waitpid`, as a worker)."""
    return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]).pid


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> Any:
    server = serve_store("127.0.0.1", 0)
    store = connect_store(server.addr)
    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run-agent")
    forks: list[tuple[int, int]] = []

    def fork(addr: str, node: str, lr: int, run_id: str, threads: int, incarnation: int = 0,
             drain_signal: int = 0, script: tuple[str, list[str]] | None = None, term_ignored: bool = False) -> int:
        forks.append((lr, incarnation))
        return _child_exiting(0)  # (the restarted worker: ends at once, done)

    monkeypatch.setattr(agent, "_fork_worker", fork)
    monkeypatch.setattr(agent, "_reconnect", lambda addr: store)
    n = agent._Node.__new__(agent._Node)
    n.a = argparse.Namespace(store=server.addr, threads=1, workers=2, control_plane_timeout=15.0)
    n.cfg, n.node, n.run_id, n.script = RunConfig(nodes=2, workers_per_node=2), "n1", "run-agent", None
    n.store, n.children, n.restarts, n.undecided, n.worst = store, {}, {0: 0, 1: 0}, {}, 0
    n.notice, n.health, n.last_ok, n.last_look, n.look_every = _Notice(), _NoCheck(), 0.0, 0.0, 0.0
    n.term_saves, n.term_at, n.term_stop_seen = False, None, False  # (no SIGTERM received)
    monkeypatch.setattr(n, "look", lambda store: True, raising=False)
    try:
        yield n, store, forks
    finally:
        for pid in n.children:  # (a restarted worker not reaped by a failed test)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        sealed.unbind()
        values._noted.clear()


def test_a_worker_that_exits_while_the_store_does_not_answer_is_restarted_once_it_does(node: Any,
                                                                                      capsys: Any) -> None:
    """(SIGKILLed while the store does not answer: not given up, not restarted blind; restarted once it
    answers, its keys written for the coordinator.)"""
    n, store, forks = node
    n.last_ok = time.monotonic()
    n.store = _Unanswered()
    n._exited(1, -9)  # SIGKILLed while the store does not answer
    assert n.undecided == {1: -9} and forks == [] and n.store is None, "given up (or restarted blind)"
    assert "its restart waits for it" in capsys.readouterr().out
    assert n.supervise() is None  # the store answers again: decided, restarted, the restarted worker done
    assert forks == [(1, 1)] and n.undecided == {} and n.restarts == {0: 0, 1: 1}
    assert sealed.present(store, [keys.worker_exit("n1.1"), keys.node_restarts("n1")]) == [True, True]
    assert n.worst == 0


def test_no_restart_once_the_node_is_fenced_or_the_worker_failed_too_often(node: Any) -> None:
    n, store, forks = node
    n.restarts[0] = agent.MAX_RESTARTS
    assert n.restart(0, 1) is False
    sealed.put(store, keys.fence("n1"), "1")
    assert n.restart(1, 1) is False and forks == []
    store.delete_key(keys.fence("n1"))
    assert n.restart(1, 1) is True and forks == [(1, 1)]


def test_an_agent_forks_with_its_follower_thread_and_warns_nothing() -> None:
    """An agent forks its workers beside one other thread (the one that follows the launcher): Python 3.12
    warns at every such fork that it may deadlock the child, in every agent's log. `procs.fork` does not."""
    from phoenixft.runtime import procs

    follower = threading.Thread(target=time.sleep, args=(2.0,), daemon=True)
    follower.start()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pid = procs.fork()
        if pid == 0:
            os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    assert [str(w.message) for w in said] == []
