"""The node agent: one per node (failure domain), supervising the node's G workers.

It imports torch once and forks its workers from that warm image (so a node of G workers
pays one `import torch`), heartbeats to the control plane, and reports worker exits.
A spare node is the same agent started with `--spare`: its workers build the model and wait,
warm, for promotion. The agent and its workers share one process group (the agent is a
session leader), so a node is killed, or fenced, as one unit.

The agent owns its node's host shared memory (`phoenixft.shm`): it is listed in the run's owner
record, its workers die with it (`PR_SET_PDEATHSIG`), and when it ends - normally, on SIGTERM,
SIGHUP or SIGINT, when the launcher that started it dies (`--parent-pid`: the kernel sends it
SIGTERM), or after losing the control plane for `--control-plane-timeout` seconds - it kills its
workers, waits for them, and unlinks the node's segments. A worker that dies while the agent
lives is restarted in place and finds the segments it left.

Run as `phoenixft agent --store HOST:PORT --node ID` (the launcher does this for local runs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

from phoenixft import shm
from phoenixft.errors import UserError
from phoenixft.procs import die_with_parent, exit_now

__all__ = ["main", "probe_store"]


MAX_RESTARTS = 3


def _fork_worker(store: str, node: str, local_rank: int, run_id: str, threads: int, incarnation: int = 0) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_DFL)
            die_with_parent(signal.SIGKILL, parent)  # never outlive the agent that owns the node's memory
            from phoenixft.worker import worker_main

            code = worker_main(store, node, local_rank, run_id, threads, incarnation)
        except BaseException:  # noqa: BLE001 - report and exit non-zero
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def probe_store(addr: str, timeout_s: float) -> tuple[str, int]:
    """Wait (at most timeout_s) until something accepts TCP connections at HOST:PORT; UserError if not."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--store={addr!r} is invalid: expected HOST:PORT, e.g. 127.0.0.1:29500")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, left))):
                return host, int(port)
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() + 0.2 > deadline:
            raise UserError(f"--store={addr}: no phoenixft store is reachable there ({why}; waited "
                            f"{timeout_s:g}s, see --connect-timeout)")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phoenixft agent")
    ap.add_argument("--store", required=True, help="control-plane store HOST:PORT")
    ap.add_argument("--node", required=True, help="node id (n<i> active, s<i> spare)")
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--parent-pid", type=int, default=0, help="die (cleanly) when this parent process dies")
    ap.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the store at start")
    ap.add_argument("--control-plane-timeout", type=float, default=15.0,
                    help="stop the node (and free its memory) after this long without reaching the store")
    a = ap.parse_args(argv)
    shm.check_run_id(a.run_id)
    if a.workers < 1:
        raise UserError(f"--workers={a.workers} is invalid: need at least 1")
    if not a.connect_timeout > 0:
        raise UserError(f"--connect-timeout={a.connect_timeout:g} is invalid: must be > 0 seconds")
    if not a.control_plane_timeout > 0:
        raise UserError(f"--control-plane-timeout={a.control_plane_timeout:g} is invalid: must be > 0 seconds")
    if a.parent_pid:
        die_with_parent(signal.SIGTERM, a.parent_pid)  # the launcher died: clean up (handler below)
    probe_store(a.store, a.connect_timeout)

    children: dict[int, int] = {}
    registered = False

    def cleanup() -> None:
        """Kill and reap the workers, then free the node's shared memory; never raises."""
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)
            else:
                children.pop(pid, None)
        try:
            shm.unlink_segments(a.run_id, a.node)
            if registered:
                shm.unregister_owner(a.run_id)
        except Exception:  # noqa: BLE001 - best effort on the way out
            traceback.print_exc()

    def stop(signum: int, frame: object) -> None:
        cleanup()
        os._exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)

    if not a.parent_pid:  # started by hand: free what dead runs left on this machine
        res = shm.sweep(exclude=(a.run_id,))
        if res.segments:
            print(f"phoenixft agent: removed {res.segments} orphaned shared-memory segment(s), "
                  f"{res.bytes / 2**20:.1f} MiB, of run(s) {', '.join(res.runs)}", file=sys.stderr)
    shm.register_owner(a.run_id, f"agent {a.node}")
    registered = True

    from phoenixft import keys
    from phoenixft.comm import connect_store

    try:
        store: Any = connect_store(a.store, a.connect_timeout)
        store.check([keys.CONFIG])
    except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, ...
        cleanup()
        raise UserError(f"--store={a.store}: not a reachable phoenixft store ({str(e).splitlines()[0][:120]})") \
            from None

    import torch  # noqa: F401 - warm the image the workers are forked from

    import phoenixft.worker  # noqa: F401

    for i in range(a.workers):
        children[_fork_worker(a.store, a.node, i, a.run_id, a.threads)] = i
    if a.node.startswith("s"):
        store.append("spares", a.node + "\n")  # join the spare pool (also when started late, by hand)
    restarts = {i: 0 for i in range(a.workers)}
    worst = 0
    last_ok = time.monotonic()
    while children:
        try:
            if store.check([keys.fence(a.node)]):  # declared dead while stopped or cut off: never write again
                print(f"phoenixft agent {a.node}: fenced by the control plane; stopping the node", flush=True)
                stop(signal.SIGTERM, None)
            store.set(keys.heartbeat(a.node), str(time.time()))
            last_ok = time.monotonic()
        except Exception:  # noqa: BLE001 - control plane gone: keep supervising for a bounded time
            if time.monotonic() - last_ok > a.control_plane_timeout:
                print(f"phoenixft agent {a.node}: no control plane for {a.control_plane_timeout:g}s; "
                      "stopping the node", file=sys.stderr, flush=True)
                cleanup()
                return 1
        deadline = time.monotonic() + 0.25
        while children and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
            lr = children.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            if code == 0 or lr is None:
                continue
            wid = f"{a.node}.{lr}"
            try:
                over = store.check([keys.RUN_STATE])
                if not over and restarts[lr] < MAX_RESTARTS:
                    # the node is healthy and one worker died: restart it in place from the snapshot it
                    # left in shared memory (transient failure; no spare needed)
                    restarts[lr] += 1
                    store.set(keys.worker_exit(wid), json.dumps({"t": time.time(), "code": code,
                                                                 "incarnation": restarts[lr]}))
                    store.add(keys.WORKER_EXITS, 1)  # the coordinator looks at wexit/ keys when this moves
                    children[_fork_worker(a.store, a.node, lr, a.run_id, a.threads, restarts[lr])] = lr
                    continue
            except Exception:  # noqa: BLE001 - no control plane: nothing to rejoin
                pass
            worst = max(worst, abs(code))
            if restarts[lr] >= MAX_RESTARTS:  # crash loop: give up the whole node (permanent)
                stop(signal.SIGTERM, None)
    cleanup()
    return worst


if __name__ == "__main__":
    exit_now(main())  # its files are closed and its memory freed: no need for a slow interpreter teardown
