"""The node agent: one per node (failure domain), supervising the node's G workers.

It imports torch once and forks its workers from that warm image (so a node of G workers
pays one `import torch`; a local run's agents are themselves forked from the launcher's warm
zygote, `phoenixft.runtime.zygote`, and pay none), heartbeats to the control plane, and reports worker exits.
A spare node is the same agent started with `--spare`: its workers build the model and wait,
warm, for promotion. The agent and its workers share one process group (the agent is a
session leader), so a node is killed, or fenced, as one unit.

The agent owns its node's host shared memory (`phoenixft.protect.shm`): it is listed in the run's owner
record, its workers die with it (`PR_SET_PDEATHSIG`), and when it ends - normally, on SIGTERM,
SIGHUP or SIGINT, when the launcher that started it dies (`--parent-pid`: SIGTERM, from the kernel
or, when the launcher's zygote forked it, from a thread watching the launcher), or after losing
the control plane for `--control-plane-timeout` seconds - it kills its workers, waits for them,
and unlinks the node's segments. A worker that dies while the agent lives is restarted in place and
finds the segments it left.

Joining: the agent proves to the coordinator that it holds the job token (HMAC challenge-response,
`phoenixft.controlplane.auth`) before it is admitted; the coordinator names its node id (`n<i>` for an active
slot, `s<k>` for a spare; a `--node` that already has that form is asked for as is) and the run id.
Only then does it fork its workers, with the token in their environment (they verify the signature
of every topology) and this host's address (`PHOENIXFT_BIND`: their gloo groups listen on it).

Across hosts the agent is also where a host's own faults live: a `partition:` fault for its slot
is fired here (`phoenixft.faults.partition`), and when it comes back from a partition it finds itself
fenced (the coordinator declared it dead meanwhile) and stops the node without writing. A store
call that failed or timed out is never retried on the same connection (a late answer could be read
as the answer to the next call): the agent reconnects.

Run as `phoenixft agent --coordinator HOST:PORT --node NAME [--spare]` (the launcher does this
for local runs, with `--store` and fixed ids).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import time
import traceback

from phoenixft.config import MAX_FAILURE_TIMEOUT_S, MAX_THREADS, MAX_WORKERS
from phoenixft.controlplane import Store, auth
from phoenixft.errors import UserError
from phoenixft.protect import shm
from phoenixft.runtime.procs import die_with_parent, exit_now, process_state

__all__ = ["main", "probe_store", "CALL_TIMEOUT_S"]


MAX_RESTARTS = 3
MAX_AGENT_WAIT_S = MAX_FAILURE_TIMEOUT_S  # --connect-timeout, --join-timeout, --control-plane-timeout: a day
CALL_TIMEOUT_S = 5.0  # the agent's own store calls: a partitioned host notices within this, then reconnects
_ID = re.compile(r"^[ns]\d+$")


class StoppedWorkers:
    """Which of the node's workers have been stopped for how long. The agent's heartbeat vouches for the
    whole node, but a worker can be stopped (SIGSTOP, SIGTSTP, a tracer's stop) while its agent runs on:
    its peers then wait in a collective that no heartbeat would ever time out. So the agent looks at
    each worker's scheduler state (/proc/PID/stat: `T` or `t`) before each heartbeat; a worker seen
    stopped for longer than --failure-timeout stops the heartbeat, and the coordinator fences the node
    as it does a silent one. A worker that runs, however slowly or busily, is never judged."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}  # pid -> when it was first seen stopped (this clock)

    def stopped(self, children: dict[int, int]) -> dict[int, float]:
        """{local rank: seconds seen stopped} of the workers in `children` (pid -> local rank) that are
        stopped now."""
        now = time.monotonic()
        out = {}
        for pid, lr in children.items():
            if process_state(pid) in ("T", "t"):
                out[lr] = now - self._since.setdefault(pid, now)
            else:
                self._since.pop(pid, None)
        for pid in set(self._since) - set(children):
            del self._since[pid]
        return out

    def forget(self) -> None:
        """Workers stopped on purpose (the partition fault's `wait=` hold): their stop is not counted."""
        self._since.clear()


def _fork_worker(store: str, node: str, local_rank: int, run_id: str, threads: int, incarnation: int = 0) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_DFL)
            die_with_parent(signal.SIGKILL, parent)  # never outlive the agent that owns the node's memory
            from phoenixft.runtime.worker import worker_main

            code = worker_main(store, node, local_rank, run_id, threads, incarnation)
        except BaseException:  # noqa: BLE001 - report and exit non-zero
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def probe_store(addr: str, timeout_s: float, flag: str = "--store") -> tuple[str, int, str]:
    """Wait (at most timeout_s) until something accepts TCP connections at HOST:PORT (for a
    cluster's URL: at any of its endpoints); UserError if not.
    Returns (host, port, the local address this host reaches it from)."""
    from phoenixft.controlplane import describe

    try:
        eps = describe(addr).endpoints()
    except ValueError as e:
        raise UserError(f"{flag}={addr!r} is invalid: {e}") from None
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        for host, p in eps:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((host, p), timeout=max(0.1, min(2.0, left))) as s:
                    return host, p, str(s.getsockname()[0])
            except OSError as e:
                why = e.strerror or type(e).__name__
        if time.monotonic() + 0.2 > deadline:
            raise UserError(f"{flag}={addr}: no phoenixft store is reachable there ({why}; waited "
                            f"{timeout_s:g}s, see --connect-timeout)")
        time.sleep(0.2)


def _check_bind(addr: str) -> None:
    """UserError unless `addr` is an address of this host (its data plane listens there)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError as e:
        raise UserError(f"--host={addr} is invalid: not an address of this host ({e.strerror or e}); give the "
                        "address the other hosts reach this one at, or leave it out") from None


def _reconnect(addr: str) -> Store | None:
    from phoenixft.dist.comm import connect_store

    try:
        return connect_store(addr, CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - still unreachable: the caller keeps counting
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="phoenixft agent")
    ap.add_argument("--coordinator", "--store", dest="store", required=True, metavar="HOST:PORT",
                    help="the job's coordinator (its control-plane store)")
    ap.add_argument("--node", required=True, help="this node's name (n<i> / s<k>: ask for that id)")
    ap.add_argument("--spare", action="store_true", help="join as a spare node")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--run-id", default="", help="expected run id (the coordinator names it)")
    ap.add_argument("--parent-pid", type=int, default=0, help="die (cleanly) when this parent process dies")
    ap.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the store at start")
    ap.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for admission")
    ap.add_argument("--control-plane-timeout", type=float, default=15.0,
                    help="stop the node (and free its memory) after this long without reaching the store")
    ap.add_argument("--token", default="", help=f"the job token (default: ${auth.TOKEN_ENV})")
    ap.add_argument("--host", default="", help="this host's address for the data plane (default: the one it "
                                               "reaches the coordinator from)")
    a = ap.parse_args(argv)
    flag = "--coordinator" if any(x.startswith("--coordinator") for x in argv) else "--store"
    if not auth.NAME_RE.match(a.node):
        raise UserError(f"--node={a.node!r} is invalid: 1-64 letters, digits, '-' or '_', starting with a letter "
                        "or digit")
    if a.spare and a.node.startswith("n") and _ID.match(a.node):
        raise UserError(f"--node={a.node} --spare is contradictory: n<i> names an active slot; give a spare another "
                        "name (or s<k>)")
    if a.run_id:
        shm.check_run_id(a.run_id)
    if not 1 <= a.workers <= MAX_WORKERS:
        raise UserError(f"--workers={a.workers} is invalid: need 1 to {MAX_WORKERS:,}")
    if not 1 <= a.threads <= MAX_THREADS:
        raise UserError(f"--threads={a.threads} is invalid: need 1 to {MAX_THREADS} (torch threads per worker)")
    for name, v in (("--connect-timeout", a.connect_timeout), ("--control-plane-timeout", a.control_plane_timeout),
                    ("--join-timeout", a.join_timeout)):
        if not 0 < v <= MAX_AGENT_WAIT_S:  # (inf and 1e300 were accepted: an agent that never gave up)
            raise UserError(f"{name}={v:g} is invalid: must be > 0 and at most {MAX_AGENT_WAIT_S:g} seconds")
    token = auth.resolve_token(a.token)
    if token:
        auth.check_token(token, "--token" if a.token else f"${auth.TOKEN_ENV}")
    if a.parent_pid:
        die_with_parent(signal.SIGTERM, a.parent_pid)  # the launcher died: clean up (handler below)
    _, _, local_addr = probe_store(a.store, a.connect_timeout, flag)
    bind = a.host.strip("[]") or local_addr
    _check_bind(bind)

    from phoenixft.config import RunConfig
    from phoenixft.controlplane import keys
    from phoenixft.dist.comm import BIND_ENV, connect_store

    connect_deadline = time.monotonic() + a.connect_timeout
    store: Store | None
    while True:  # something listens there (probed): a client that times out on a loaded host tries again
        try:
            store = connect_store(a.store, min(a.connect_timeout, CALL_TIMEOUT_S))
            store.check([keys.CONFIG])
            cfg = RunConfig.from_json(store.get(keys.CONFIG).decode())
            served = store.get(keys.RUN_ID).decode() if a.run_id and store.check([keys.RUN_ID]) else ""
            break
        except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, ...
            timed_out = "timed out" in str(e) or "timeout" in str(e).lower()
            if not timed_out or time.monotonic() > connect_deadline:
                raise UserError(f"{flag}={a.store}: not a reachable phoenixft store "
                                f"({str(e).splitlines()[0][:120]})") from None
    if served and a.run_id != served:  # before asking to join: a refused agent must not hold a slot
        raise UserError(f"--run-id={a.run_id} is not the run of the coordinator at {a.store} ({served})")
    request = {"name": a.node, "spare": a.spare or (a.node.startswith("s") and bool(_ID.match(a.node))),
               "workers": a.workers, "host": bind, "hostname": socket.gethostname(), "pid": os.getpid()}
    verdict = auth.request_admission(store, request, token, a.join_timeout, a.store)
    node, run_id = str(verdict["node"]), str(verdict["run_id"])
    shm.check_run_id(run_id)
    if a.run_id and a.run_id != run_id:
        raise UserError(f"--run-id={a.run_id} is not the run of the coordinator at {a.store} ({run_id})")
    note = f" ({verdict['note']})" if verdict.get("note") else ""
    print(f"phoenixft agent {a.node}: admitted by {a.store} as {node}, run {run_id}, address {bind}{note}",
          flush=True)
    assert token is not None  # admitted: the verdict verified with it
    os.environ[auth.TOKEN_ENV] = token  # the workers verify the coordinator's plans with it
    os.environ[BIND_ENV] = bind  # ... and listen on this host's address

    children: dict[int, int] = {}
    registered = False
    fenced = False
    from phoenixft.faults.partition import PartitionInjector

    injector = PartitionInjector(cfg.faults, node, bind, lambda: list(children), token)

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
            injector.heal()  # only once the workers are gone: a healed link must find nothing to write
            shm.unlink_segments(run_id, node)
            if registered:
                shm.unregister_owner(run_id)
        except Exception:  # noqa: BLE001 - best effort on the way out
            traceback.print_exc()

    def stop(signum: int, frame: object) -> None:
        cleanup()
        os._exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)

    if not a.parent_pid:  # started by hand: free what dead runs left on this machine
        res = shm.sweep(exclude=(run_id,))
        if res.segments:
            print(f"phoenixft agent: removed {res.segments} orphaned shared-memory segment(s), "
                  f"{res.bytes / 2**20:.1f} MiB, of run(s) {', '.join(res.runs)}", file=sys.stderr)
        # this machine's earlier incarnation in this run (its agent killed, its node fenced since; e.g. a
        # repaired host that rejoins as a spare) left its node's memory here, which the sweep spares while
        # the run lives: a fenced node never uses it again
        try:
            dead = sorted(n for n in shm.nodes_with_segments(run_id) - {node} if store.check([keys.fence(n)]))
        except Exception:  # noqa: BLE001 - the store did not answer: the heartbeat loop reconnects
            dead = []
        for n in dead:
            freed = shm.unlink_segments(run_id, n)
            print(f"phoenixft agent: removed {len(freed)} shared-memory segment(s), "
                  f"{sum(b for _, b in freed) / 2**20:.1f} MiB, of fenced node {n} of this run", file=sys.stderr)
    registered = True  # first: a signal during the registration must still unregister (a no-op if absent)
    shm.register_owner(run_id, f"agent {node}")

    import torch  # noqa: F401 - warm the image the workers are forked from

    import phoenixft.runtime.worker  # noqa: F401

    for i in range(a.workers):
        children[_fork_worker(a.store, node, i, run_id, a.threads)] = i
    restarts = {i: 0 for i in range(a.workers)}
    from phoenixft.controlplane import Heartbeat

    beat: Heartbeat | None = None
    worst = 0
    last_ok = time.monotonic()
    # where reads are costly every look costs the cluster CPU (and a heartbeat is a replicated write): look
    # every second or a quarter of the failure timeout, whichever is shorter; otherwise at every turn
    look_every = min(1.0, cfg.failure_timeout / 4) if store.costly_reads else 0.0
    last_look = 0.0
    stopped_workers = StoppedWorkers()
    silent_said = False
    while children:
        try:
            if store is None:
                raise ConnectionError("no connection to the store")
            if time.monotonic() - last_look >= look_every:
                last_look = time.monotonic()
                # one request on a cluster; there a job's keys can also vanish (its head removed them at its end)
                fenced_now, there = (store.exists_many([keys.fence(node), keys.CONFIG]) if store.replicated
                                     else (store.check([keys.fence(node)]), True))
                if fenced_now:  # declared dead while stopped or cut off: never write again
                    print(f"phoenixft agent {node}: fenced by the control plane; stopping the node", flush=True)
                    fenced = True
                    stop(signal.SIGTERM, None)
                if not there:  # nothing left to train for (its workers would wait for keys that never come)
                    print(f"phoenixft agent {node}: the job's keys are gone from {a.store} (the run ended and its "
                          "keys were removed); stopping the node", file=sys.stderr, flush=True)
                    cleanup()
                    return 1
                if beat is None or beat.store is not store:
                    beat = Heartbeat(store, keys.heartbeat(node), cfg.failure_timeout)  # (a lease where there are)
                # a worker stopped (SIGSTOP) for longer than the failure timeout while this agent runs: no
                # longer vouch for the node (workers the partition fault's hold pauses itself are not judged)
                if injector.holding:
                    stopped_workers.forget()
                stopped = stopped_workers.stopped(children)
                if stopped and store.check([keys.RUN_STATE]):
                    # the run ended: a stopped worker would never see it, and this agent would wait for it
                    # (the launcher until its grace ran out); it has nothing left to do
                    for wpid in [w for w, r in children.items() if r in stopped]:
                        os.kill(wpid, signal.SIGKILL)
                quiet = {lr: t for lr, t in stopped.items() if t > cfg.failure_timeout}
                if not quiet:
                    beat.beat(str(time.time()))
                    silent_said = False
                elif not silent_said:
                    silent_said = True
                    print(f"phoenixft agent {node}: worker(s) "
                          + ", ".join(f"{node}.{lr} ({q:.1f}s)" for lr, q in sorted(quiet.items()))
                          + f" stopped (SIGSTOP) for longer than --failure-timeout={cfg.failure_timeout:g}s; "
                          "no heartbeat for the node until they run again", flush=True)
                injector.tick(store)
            last_ok = time.monotonic()
        except Exception:  # noqa: BLE001 - control plane gone: keep supervising for a bounded time
            if time.monotonic() - last_ok > a.control_plane_timeout:
                print(f"phoenixft agent {node}: no control plane for {a.control_plane_timeout:g}s; "
                      "stopping the node", file=sys.stderr, flush=True)
                cleanup()
                return 1
            store = _reconnect(a.store)  # never reuse a connection whose call failed: its answer may come late
            if store is None:
                time.sleep(0.2)
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
            wid = f"{node}.{lr}"
            try:
                over = store is not None and (store.check([keys.RUN_STATE]) or store.check([keys.fence(node)]))
                if store is not None and not over and restarts[lr] < MAX_RESTARTS:
                    # the node is healthy and one worker died: restart it in place from the snapshot it
                    # left in shared memory (transient failure; no spare needed)
                    restarts[lr] += 1
                    store.set(keys.worker_exit(wid), json.dumps({"t": time.time(), "code": code,
                                                                 "incarnation": restarts[lr]}))
                    store.add(keys.WORKER_EXITS, 1)  # the coordinator looks at wexit/ keys when this moves
                    children[_fork_worker(a.store, node, lr, run_id, a.threads, restarts[lr])] = lr
                    continue
            except Exception:  # noqa: BLE001 - no control plane: nothing to rejoin
                pass
            worst = max(worst, abs(code))
            if restarts[lr] >= MAX_RESTARTS:  # crash loop: give up the whole node (permanent)
                stop(signal.SIGTERM, None)
    cleanup()
    try:
        if store is not None and not fenced and not store.check([keys.fence(node)]):
            store.set(keys.left(node), str(worst))  # the head stops serving the store once every node has left
            store.check([keys.left(node)])  # a set is not acknowledged: an answered request flushes it
    except Exception:  # noqa: BLE001 - the store is gone already: nobody is waiting
        pass
    return worst


if __name__ == "__main__":
    try:
        rc = main()
    except UserError as e:  # one line, as `phoenixft agent` prints it (e.g. the run ended while it joined)
        print(f"phoenixft agent: {e}", file=sys.stderr)
        rc = 2
    exit_now(rc)  # its files are closed and its memory freed: no need for a slow interpreter teardown
