"""The node agent: one per node (failure domain), supervising the node's G workers.

It imports torch once and forks its workers from that warm image (so a node of G workers
pays one `import torch`), heartbeats to the control plane, and reports worker exits.
A spare node is the same agent started with `--spare`: its workers build the model and wait,
warm, for promotion. The agent and its workers share one process group (the agent is a
session leader), so a node is killed, or fenced, as one unit.

Run as `phoenixft agent --store HOST:PORT --node ID` (the launcher does this for local runs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

__all__ = ["main"]


MAX_RESTARTS = 3


def _fork_worker(store: str, node: str, local_rank: int, run_id: str, threads: int, incarnation: int = 0) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phoenixft agent")
    ap.add_argument("--store", required=True, help="control-plane store HOST:PORT")
    ap.add_argument("--node", required=True, help="node id (n<i> active, s<i> spare)")
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--run-id", required=True)
    a = ap.parse_args(argv)

    import torch  # noqa: F401 - warm the image the workers are forked from

    import phoenixft.worker  # noqa: F401

    children = {_fork_worker(a.store, a.node, i, a.run_id, a.threads): i for i in range(a.workers)}

    def stop(signum: int, frame: object) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    from phoenixft import keys
    from phoenixft.comm import connect_store

    store: Any = connect_store(a.store)
    if a.node.startswith("s"):
        store.append("spares", a.node + "\n")  # join the spare pool (also when started late, by hand)
    restarts = {i: 0 for i in range(a.workers)}
    worst = 0
    while children:
        try:
            if store.check([keys.fence(a.node)]):  # declared dead while stopped or cut off: never write again
                print(f"phoenixft agent {a.node}: fenced by the control plane; stopping the node", flush=True)
                stop(signal.SIGTERM, None)
            store.set(keys.heartbeat(a.node), str(time.time()))
        except Exception:  # noqa: BLE001 - control plane gone: keep supervising, the launcher decides
            pass
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
                    children[_fork_worker(a.store, a.node, lr, a.run_id, a.threads, restarts[lr])] = lr
                    continue
            except Exception:  # noqa: BLE001 - no control plane: nothing to rejoin
                pass
            worst = max(worst, abs(code))
            if restarts[lr] >= MAX_RESTARTS:  # crash loop: give up the whole node (permanent)
                stop(signal.SIGTERM, None)
    return worst


if __name__ == "__main__":
    sys.exit(main())
