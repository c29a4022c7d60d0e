"""The node agent: one per node (failure domain), supervising the node's G workers.

It imports torch once and forks its workers from that warm image (so a node of G workers
pays one `import torch`; a local run's agents are themselves forked from the launcher's warm
zygote, `phoenixft.runtime.zygote`, and pay none), heartbeats to the control plane, and reports worker exits.
A spare node is the same agent started with `--spare`: its workers build the model and wait,
warm, for promotion. The agent and its workers share one process group (the agent is a
session leader when a local run starts it), so a node is killed, or fenced, as one unit; an agent started
by hand may share its group with the script that started it, and a fault or an expired notice then
strikes only the node's own process tree (`procs.signal_node`).

The agent owns its node's host shared memory (`phoenixft.protect.shm`): it is listed in the run's owner
record, its workers die with it (`PR_SET_PDEATHSIG`), and when it ends - normally, on SIGTERM,
SIGHUP or SIGINT, when the launcher that started it dies (`--parent-pid`: SIGTERM, from the kernel
or, when the launcher's zygote forked it, from a thread watching the launcher), or after losing
the control plane for `--control-plane-timeout` seconds - it kills its workers, waits for them,
and unlinks the node's segments. A worker that dies while the agent lives is restarted in place and
finds the segments it left.

A SIGTERM, when the job has a persistent tier (and SIGTERM is not the agent's drain notice), may mean that the whole
job is being ended (Slurm at `scancel` or at the time limit signals every process of it at once, SIGKILL following):
the head then stops the job with its state saved, so the agent keeps its node (and its workers, which ignore SIGTERM)
until the run ends, within the stop's window; with no stop of the job seen within TERM_DECIDE_S, the SIGTERM was
this node's alone and the node stops as above (`_Node.on_sigterm`, `_Node.term_tick`).

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

from phoenixft.config import MAX_FAILURE_TIMEOUT_S, MAX_THREADS, MAX_WORKERS, RunConfig
from phoenixft.config.agent import add_agent_arguments
from phoenixft.controlplane import Store, auth
from phoenixft.controlplane.values import clean
from phoenixft.errors import UserError
from phoenixft.faults.notice import NoticeHandler, signal_number
from phoenixft.protect import shm
from phoenixft.runtime import hostcheck
from phoenixft.runtime.procs import die_with_parent, exit_now, process_state, signal_node

__all__ = ["main", "run_agent", "probe_store", "CALL_TIMEOUT_S"]


MAX_RESTARTS = 3
RUN_ID_SETTLE_S = 3.0  # a run id in the store that is not --run-id: looked at again this long (put back?) first
MAX_AGENT_WAIT_S = MAX_FAILURE_TIMEOUT_S  # --connect-timeout, --join-timeout, --control-plane-timeout: a day
CALL_TIMEOUT_S = 5.0  # the agent's own store calls: a partitioned host notices within this, then reconnects
TERM_DECIDE_S = 5.0  # after a SIGTERM (with a persistent tier): no stop of the job within this, and the node stops
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


def _fork_worker(store: str, node: str, local_rank: int, run_id: str, threads: int, incarnation: int = 0,
                 drain_signal: int = 0, script: tuple[str, list[str]] | None = None, term_ignored: bool = False) -> int:
    """A worker forked from this agent's image: the built-in trainer's, or (`script`: its path and arguments) a
    user's training script run as `__main__` (runtime/script.py). `term_ignored`: the worker ignores SIGTERM (its
    agent decides what one means for the node: `_Node.on_sigterm`)."""
    from phoenixft.runtime.procs import fork

    parent = os.getpid()
    pid = fork()
    if pid == 0:  # child
        code = 1
        try:
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_DFL)
            if term_ignored:  # (a scheduler ending the job signals every process: the job saves its state first)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if drain_signal not in (0, signal.SIGTERM):  # a notice sent to the node's whole process group (Slurm
                signal.signal(drain_signal, signal.SIG_IGN)  # signals every process of a step) is the agent's
            die_with_parent(signal.SIGKILL, parent)  # never outlive the agent that owns the node's memory
            if script is not None:
                from phoenixft.runtime.script import script_main

                code = script_main(script, store, node, local_rank, run_id, threads, incarnation)
            else:
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
    from phoenixft.distributed.comm import connect_store

    try:
        return connect_store(addr, CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - still unreachable: the caller keeps counting
        return None


def main(argv: list[str] | None = None) -> int:
    """The agent process: parse its flags (`phoenixft.config.agent`, plus the launcher's --parent-pid) and run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="phoenixft agent")
    add_agent_arguments(ap)
    ap.add_argument("--parent-pid", type=int, default=0, help="die (cleanly) when this parent process dies")
    a = ap.parse_args(argv)
    flag = "--coordinator" if any(x.startswith("--coordinator") for x in argv) else "--store"
    return run_agent(a, flag)


def run_agent(a: argparse.Namespace, flag: str) -> int:
    """Check the flags, join the job at `a.store` (named `flag` in errors), run the node's workers until the
    run ends or the node must stop, and leave; the worst exit code of its workers."""
    _check_args(a)
    path = getattr(a, "token_file", "")
    token = auth.resolve_token(a.token, path)
    if token:
        auth.check_token(token, auth.token_source(a.token, path))
    if a.parent_pid:
        die_with_parent(signal.SIGTERM, a.parent_pid)  # the launcher died: clean up (the node's signal handler)
    a.given_store = a.store  # (what errors name: `_through_tls` may put this host's forwarder in its place)
    _, _, local_addr = probe_store(a.store, a.connect_timeout, flag)
    _check_tls_mismatch(a, flag)
    _through_tls(a, flag)
    bind = a.host.strip("[]") or local_addr
    _check_bind(bind)
    store, cfg, _ = _connect(a, flag)
    _prepare_host(cfg, a.node, shm=not a.parent_pid)  # (before asking to join, too)
    node, run_id = _admit(a, store, token, bind)
    assert token is not None  # admitted: the verdict verified with it
    from phoenixft.controlplane import sealed

    sealed.bind(token, run_id)  # what this agent writes to the store and acts on is sealed
    checked = _verified_config(a, flag, store, token, run_id)
    if checked.to_json() != cfg.to_json():  # (the one read before the join was not the job's: check again)
        _prepare_host(checked, a.node, shm=not a.parent_pid)
    return _Node(a, store, checked, node, run_id, bind, token).run()


def _verified_config(a: argparse.Namespace, flag: str, store: Store, token: str, run_id: str) -> RunConfig:
    """The job's config once its signature verifies with the run key of the token and the run id the
    signed admission verdict named (the launcher puts back one that something else overwrote), waited for
    until --connect-timeout; UserError then."""
    from phoenixft.controlplane import keys
    from phoenixft.controlplane.signed import wait_verified

    raw = wait_verified(store, token, run_id, keys.CONFIG, a.connect_timeout)
    if raw is None:
        raise UserError(f"{flag}={_given(a)}: the job's config there is not signed with the key of run {run_id} "
                        "(something other than the job wrote it)")
    return RunConfig.from_json(raw.decode())


def _given(a: argparse.Namespace) -> str:
    """The store's address as the user gave it (errors name it; `a.store` may be this host's TLS forwarder)."""
    return str(getattr(a, "given_store", "") or a.store)


TLS_PROBE_S = 0.5  # how long a plain agent waits for the TLS answer of a head started with TLS (loopback: ~1 ms)
# how long an agent with --tls-* waits for it: a head started at the same moment (a batch script starting the head
# and the agents together) accepts connections before its TLS front answers them, by up to seconds on a busy host
TLS_START_S = 10.0


def _check_tls_mismatch(a: argparse.Namespace, flag: str) -> None:
    """An agent without --tls-* at a head started with them: one line naming the flags, at once (its store client
    got the gateway's refusal only after seconds of retries, and said 'not a reachable phoenixft store')."""
    from phoenixft.controlplane import describe, tls

    if a.tls_cert or a.tls_key or a.tls_ca or a.parent_pid or describe(a.store).replicated:
        return  # (an agent of `phoenixft run` is given the flags its launcher's store needs)
    host, _, port = a.store.rpartition(":")
    if tls.speaks_tls(host.strip("[]"), int(port), TLS_PROBE_S):
        raise UserError(f"{flag}={a.store}: the coordinator there speaks TLS (it was started with --tls-cert, "
                        "--tls-key and --tls-ca): give this agent --tls-cert, --tls-key and --tls-ca too (a "
                        "certificate of this host signed by the job's CA, and that CA; `phoenixft certs` makes them)")


def _through_tls(a: argparse.Namespace, flag: str) -> None:
    """With --tls-*: a replicated control plane is spoken to over HTTPS (the files go into the environment every
    client of this process and its workers reads); a TCPStore is reached through a forwarder of this host
    (controlplane.tls), whose loopback address becomes the store's for this agent and its workers."""
    from phoenixft.controlplane import describe, tls

    files = tls.TlsFiles.given(a.tls_cert, a.tls_key, a.tls_ca)
    if files is None:
        return
    os.environ.update(files.env())
    if describe(a.store).replicated:
        return
    host, _, port = a.store.rpartition(":")
    if not tls.speaks_tls(host.strip("[]"), int(port), TLS_START_S):  # (before a handshake that would wait for it)
        raise UserError(f"{flag}={a.store}: the coordinator there does not speak TLS (it was started without "
                        "--tls-cert, --tls-key and --tls-ca): leave those flags out here, or start the coordinator "
                        "with them")
    why = tls.probe(host.strip("[]"), int(port), files)
    if why:
        raise UserError(f"{flag}={a.store}: no TLS channel to the coordinator ({why}): are this agent's --tls-cert "
                        "and the coordinator's certificate both signed by --tls-ca?")
    relay = tls.start_forwarder(a.store, files)
    print(f"phoenixft agent {a.node}: reaching the store at {a.store} through TLS (this host's forwarder at "
          f"{relay.addr})", flush=True)
    a.store = relay.addr
    a.tls_relay = relay  # (kept referenced; it exits with this process)


def _prepare_host(cfg: RunConfig, node: str, shm: bool = True) -> None:
    """The device is decided here, where the workers run: UserError (one line) when this host cannot
    train on it or its /dev/shm cannot hold the node's snapshot halves; on CUDA, the NCCL settings a
    survivor needs go into the environment the workers are forked with (said once when a user value
    is replaced). Without CUDA being initialised here (the workers are forked after it). `shm` False:
    an agent of `phoenixft run`, whose launcher checked /dev/shm for every node of this host."""
    kind = hostcheck.check_host(cfg, 1 if shm else 0, f"this host (node {node})")
    if kind == "cuda":
        line = hostcheck.prepare_nccl(os.environ)
        if line:
            print(f"phoenixft agent {node}: {line}", flush=True)


def _check_args(a: argparse.Namespace) -> None:
    """UserError for a node name, run id, worker or thread count, or timeout the agent cannot work with."""
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
    try:
        sig = signal_number(a.drain_signal)
    except (KeyError, ValueError):
        raise UserError(f"--drain-signal={a.drain_signal!r} is invalid: not a signal name (e.g. SIGUSR1) or "
                        "number") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        raise UserError(f"--drain-signal={a.drain_signal} is invalid: {signal.Signals(sig).name} cannot be caught "
                        "or already means something to the agent; use SIGUSR1, SIGUSR2 or SIGTERM")
    if not 1 <= a.threads <= MAX_THREADS:
        raise UserError(f"--threads={a.threads} is invalid: need 1 to {MAX_THREADS} (torch threads per worker)")
    for name, v in (("--connect-timeout", a.connect_timeout), ("--control-plane-timeout", a.control_plane_timeout),
                    ("--join-timeout", a.join_timeout)):
        if not 0 < v <= MAX_AGENT_WAIT_S:  # (inf and 1e300 were accepted: an agent that never gave up)
            raise UserError(f"{name}={v:g} is invalid: must be > 0 and at most {MAX_AGENT_WAIT_S:g} seconds")


def _connect(a: argparse.Namespace, flag: str) -> tuple[Store, RunConfig, str]:
    """(a client of the store, the job's config as the store holds it, the run id it serves) - retried while
    the store's answers time out (a loaded host) until --connect-timeout; UserError if it is no phoenixft
    store. The config is checked (`_verified_config`) once the admission has proven the token and named the
    run; before, it only sizes the host's check (`_prepare_host`), done again if the checked one differs."""
    from phoenixft.controlplane import keys
    from phoenixft.distributed.comm import connect_store

    connect_deadline = time.monotonic() + a.connect_timeout
    mismatch_since = 0.0  # when the store first named another run
    store: Store | None
    while True:  # something listens there (probed): a client that times out on a loaded host tries again
        try:
            store = connect_store(a.store, min(a.connect_timeout, CALL_TIMEOUT_S))
            store.check([keys.CONFIG])
            raw = store.get(keys.CONFIG)
            served = clean(store.get(keys.RUN_ID), 64) if store.check([keys.RUN_ID]) else ""
            if a.run_id and served and a.run_id != served:  # before asking to join: a refused agent holds no slot
                mismatch_since = mismatch_since or time.monotonic()  # (one something else wrote is put back within
                if time.monotonic() - mismatch_since > RUN_ID_SETTLE_S:  # a second: looked at again until then)
                    raise UserError(f"--run-id={a.run_id} is not the run of the coordinator at {_given(a)} ({served})")
                time.sleep(0.2)
                continue
            try:
                return store, RunConfig.from_json(bytes(raw).decode(errors="replace")), served
            except Exception:  # noqa: BLE001 - not a config (overwritten by a stranger): its writer puts it back
                if time.monotonic() > connect_deadline:
                    raise UserError(f"{flag}={_given(a)}: the job's config there is unreadable") from None
                time.sleep(0.2)
                continue
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, ...
            timed_out = "timed out" in str(e) or "timeout" in str(e).lower()
            if not timed_out or time.monotonic() > connect_deadline:
                raise UserError(f"{flag}={_given(a)}: not a reachable phoenixft store "
                                f"({str(e).splitlines()[0][:120]})") from None


def _admit(a: argparse.Namespace, store: Store, token: str | None, bind: str) -> tuple[str, str]:
    """Ask the coordinator to admit this node (proving the job token); (its node id, the run id). Sets the
    token and this host's address in the environment the workers are forked with."""
    from phoenixft.distributed.comm import BIND_ENV
    from phoenixft.health.history import HOST_ID_ENV

    request = {"name": a.node, "spare": a.spare or (a.node.startswith("s") and bool(_ID.match(a.node))),
               "workers": a.workers, "host": bind, "hostname": socket.gethostname(), "pid": os.getpid(),
               "hostid": os.environ.get(HOST_ID_ENV, "") or f"{socket.gethostname()}@{bind}"}
    given = _given(a)
    verdict = auth.request_admission(store, request, token, a.join_timeout, given)
    node, run_id = str(verdict["node"]), str(verdict["run_id"])
    shm.check_run_id(run_id)
    if a.run_id and a.run_id != run_id:
        raise UserError(f"--run-id={a.run_id} is not the run of the coordinator at {given} ({run_id})")
    note = f" ({verdict['note']})" if verdict.get("note") else ""
    print(f"phoenixft agent {a.node}: admitted by {given} as {node}, run {run_id}, address {bind}{note}",
          flush=True)
    assert token is not None  # admitted: the verdict verified with it
    os.environ[auth.TOKEN_ENV] = token  # the workers verify the coordinator's plans with it
    os.environ[BIND_ENV] = bind  # ... and listen on this host's address
    return node, run_id


def _sweep_leftovers(store: Store, run_id: str, node: str) -> None:
    """An agent started by hand frees what dead runs left on this machine, and the memory of this run's
    nodes that were fenced here (an earlier incarnation of this host, e.g. one repaired and rejoining
    as a spare: the sweep spares a live run's segments, and a fenced node never uses its memory again)."""
    from phoenixft.controlplane import keys, sealed

    res = shm.sweep(exclude=(run_id,))
    if res.segments:
        print(f"phoenixft agent: removed {res.segments} orphaned shared-memory segment(s), "
              f"{res.bytes / 2**20:.1f} MiB, of run(s) {', '.join(res.runs)}", file=sys.stderr)
    try:
        dead = sorted(n for n in shm.nodes_with_segments(run_id) - {node} if sealed.has(store, keys.fence(n)))
    except Exception:  # noqa: BLE001 - the store did not answer: the heartbeat loop reconnects
        dead = []
    for n in dead:
        freed = shm.unlink_segments(run_id, n)
        print(f"phoenixft agent: removed {len(freed)} shared-memory segment(s), "
              f"{sum(b for _, b in freed) / 2**20:.1f} MiB, of fenced node {n} of this run", file=sys.stderr)


class _Node:
    """One admitted node: its workers, its heartbeat, its shared memory, and the way out."""

    def __init__(self, a: argparse.Namespace, store: Store, cfg: RunConfig, node: str, run_id: str, bind: str,
                 token: str) -> None:
        from phoenixft.controlplane import Heartbeat
        from phoenixft.faults.partition import PartitionInjector
        from phoenixft.health.history import HOST_ID_ENV
        from phoenixft.health.spare import SpareHealth

        self.a, self.cfg, self.node, self.run_id = a, cfg, node, run_id
        # a user's training script (its path and arguments, from the signed config) instead of the built-in trainer
        self.script: tuple[str, list[str]] | None = (cfg.script, list(cfg.script_args)) if cfg.script else None
        self.store: Store | None = store  # None while reconnecting
        self.children: dict[int, int] = {}  # pid -> local rank
        self.restarts = {i: 0 for i in range(a.workers)}
        # local rank -> exit code of a worker that exited while the control plane did not answer: whether to
        # restart it is decided once it answers again (within --control-plane-timeout; the node stops after)
        self.undecided: dict[int, int] = {}
        self.registered = False
        self.fenced = False
        self.worst = 0
        self.injector = PartitionInjector(cfg.faults, node, bind, token)
        self.beat: Heartbeat | None = None
        self.last_ok = time.monotonic()
        # where reads are costly every look costs the cluster CPU (and a heartbeat is a replicated write): look
        # every second or a quarter of the failure timeout, whichever is shorter; otherwise at every turn
        self.look_every = min(1.0, cfg.failure_timeout / 4) if store.costly_reads else 0.0
        self.last_look = 0.0
        self.stopped_workers = StoppedWorkers()
        self.silent_said = False
        sig = signal_number(getattr(a, "drain_signal", "SIGUSR1"))
        self.notice = NoticeHandler(node, cfg.faults, sig, getattr(a, "drain_on_sigterm", False)
                                    or sig == signal.SIGTERM)
        # a spare's health checks: when it joins, and whenever the coordinator asks (a re-check, a promotion)
        host = os.environ.get(HOST_ID_ENV, "") or f"{socket.gethostname()}@{bind}"
        self.health = SpareHealth(cfg, node, run_id, host, self.notice.drain_signal, a.workers)
        # SIGTERM with a persistent tier and no --drain-on-sigterm: the job may be being ended (a scheduler signals
        # every process of it at once), and then it saves its state first (`on_sigterm`, `term_tick`)
        self.term_saves = bool(cfg.persist_every) and not self.notice.on_sigterm
        self.term_at: float | None = None  # when the first such SIGTERM came (this clock)
        self.term_stop_seen = False  # ... and whether the job's stop has been seen since

    def run(self) -> int:
        """Own the node's memory, fork the workers, supervise them until they are done, then leave."""
        for s in (signal.SIGHUP, signal.SIGINT):
            signal.signal(s, self.stop)
        if self.notice.drain_signal != signal.SIGTERM:
            self.notice.install()
        signal.signal(signal.SIGTERM, self.on_sigterm)
        if not self.a.parent_pid and self.store is not None:
            _sweep_leftovers(self.store, self.run_id, self.node)
        self.registered = True  # first: a signal during the registration must still unregister (a no-op if absent)
        shm.register_owner(self.run_id, f"agent {self.node}")

        import torch  # noqa: F401 - warm the image the workers are forked from

        if self.script is None:
            import phoenixft.runtime.worker  # noqa: F401
        else:  # what a script's workers import: torch's compiler stack (its first optimizer), the job (a no-op where
            import importlib  # the zygote this agent was forked from has them)

            from phoenixft.runtime.zygote import SCRIPT_PRELOAD

            for m in SCRIPT_PRELOAD:
                importlib.import_module(m)

        if self.store is not None:  # (it runs once they are ready; a promotion meanwhile waits for its verdict)
            try:
                self.health.start_join(self.store)
            except Exception as e:  # noqa: BLE001 - no check announced: the spare is never promoted unchecked
                print(f"phoenixft agent {self.node}: health check not started ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
        for i in range(self.a.workers):
            self.children[_fork_worker(self.a.store, self.node, i, self.run_id, self.a.threads, script=self.script,
                                       drain_signal=self.notice.drain_signal, term_ignored=self.term_saves)] = i
        stopped_early = self.supervise()
        if stopped_early is not None:
            return stopped_early
        self.cleanup()
        if self.worst and self.job_stopped():  # (its workers left a job stopped with its state saved: no failure)
            self.worst = 0
        self.leave()
        return self.worst

    def job_stopped(self) -> bool:
        """The run ended `stopped` (signed with the run key): the job stopped with its state saved."""
        from phoenixft.controlplane import keys
        from phoenixft.controlplane.signed import run_ended
        from phoenixft.coordinator.stop import STOPPED

        try:
            store = self.store
            return store is not None and store.check([keys.RUN_STATE]) and run_ended(store, self.run_id) == STOPPED
        except Exception:  # noqa: BLE001 - the store is gone: the exit codes say what they say
            return False

    def supervise(self) -> int | None:
        """Look at the control plane and reap worker exits until no worker is left; an exit code if the node
        had to stop first (its job's keys gone, or no control plane for --control-plane-timeout)."""
        while self.children or self.undecided:
            try:
                if self.store is None:
                    raise ConnectionError("no connection to the store")
                if time.monotonic() - self.last_look >= self.look_every:
                    self.last_look = time.monotonic()
                    if not self.look(self.store):
                        self.cleanup()
                        return 1
                self.last_ok = time.monotonic()
                for lr, code in list(self.undecided.items()):  # the control plane answers again: decide now
                    del self.undecided[lr]
                    self._exited(lr, code)
            except Exception:  # noqa: BLE001 - control plane gone: keep supervising for a bounded time
                if time.monotonic() - self.last_ok > self.a.control_plane_timeout:
                    print(f"phoenixft agent {self.node}: no control plane for {self.a.control_plane_timeout:g}s; "
                          "stopping the node", file=sys.stderr, flush=True)
                    self.cleanup()
                    return 1
                self.store = _reconnect(self.a.store)  # never reuse a failed connection: its answer may come late
                if self.store is None:
                    time.sleep(0.2)
            self.term_tick()
            if self.notice.expired():  # a preemption's notice ran out before the node left: it goes now
                print(f"phoenixft agent {self.node}: preemption notice ran out; SIGKILL of the node", flush=True)
                signal_node(os.getpid(), signal.SIGKILL)  # (this node only: never the script that started it)
            if self.children:
                self.reap(0.25)
            else:  # (only exits left to decide: wait for the control plane)
                time.sleep(0.05)
        return None

    def on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM: a drain notice with --drain-on-sigterm (the first one, the launcher alive); with a persistent tier,
        the job being ended, maybe (`term_tick` decides; this one, and any that follow, only recorded); else stop."""
        parent_gone = False
        if self.a.parent_pid:
            try:
                os.kill(self.a.parent_pid, 0)
            except ProcessLookupError:
                parent_gone = True
            except PermissionError:
                pass
        if self.notice.takes_sigterm() and not parent_gone:
            self.notice.on_signal(signum, frame)
            return
        if self.term_saves and not parent_gone:
            if self.term_at is None:
                self.term_at = time.monotonic()
            return
        self.stop(signum, frame)

    def term_tick(self) -> None:
        """After a SIGTERM with a persistent tier (`on_sigterm`): the node stays while the job stops with its state
        saved (the head got the SIGTERM too and asked for that stop: its workers train to the step boundary and save
        it, then the run ends and the node leaves as after any run), bounded by the stop's window; when no stop of
        the job is seen within TERM_DECIDE_S, the SIGTERM was this node's alone and the node stops (a lost node)."""
        from phoenixft.runtime.stopsignal import TERM_OVERDUE_S, TERM_WINDOW_S

        if self.term_at is None:
            return
        if not self.term_stop_seen and self.store is not None:
            try:
                self.term_stop_seen = self.job_stopping(self.store)
            except Exception:  # noqa: BLE001 - no answer now: the supervision loop reconnects, the window runs on
                pass
        waited = time.monotonic() - self.term_at
        if waited > (TERM_WINDOW_S + TERM_OVERDUE_S if self.term_stop_seen else TERM_DECIDE_S):
            print(f"phoenixft agent {self.node}: SIGTERM "
                  + (f"and the job did not end within {waited:.0f}s" if self.term_stop_seen else
                     f"and no stop of the job within {TERM_DECIDE_S:g}s (the signal was this node's)")
                  + "; stopping the node", flush=True)
            self.stop(signal.SIGTERM, None)

    def job_stopping(self, store: Store) -> bool:
        """The job is stopping with its state saved (its stop request, sealed with the run key), or has ended."""
        from phoenixft.controlplane import keys, sealed
        from phoenixft.controlplane.signed import run_ended

        if sealed.has(store, keys.STOP_REQUEST):
            return True
        return store.check([keys.RUN_STATE]) and run_ended(store, self.run_id) is not None

    def look(self, store: Store) -> bool:
        """One look at the control plane: stop if fenced, heartbeat unless a worker has been stopped too long,
        fire this host's partition fault. False when the job's keys are gone (nothing left to train for)."""
        from phoenixft.controlplane import Heartbeat, keys, sealed
        from phoenixft.controlplane.signed import run_ended

        node = self.node
        # one request on a cluster; there a job's keys can also vanish (its head removed them at its end)
        fenced_now, there = (store.exists_many([keys.fence(node), keys.CONFIG]) if store.replicated
                             else (store.check([keys.fence(node)]), True))
        # declared dead while stopped or cut off: never write again (a fence not sealed with the run key: ignored)
        if fenced_now and sealed.has(store, keys.fence(node)):
            print(f"phoenixft agent {node}: fenced by the control plane; stopping the node", flush=True)
            self.fenced = True
            self.stop(signal.SIGTERM, None)
        if not there:  # (its workers would wait for keys that never come)
            print(f"phoenixft agent {node}: the job's keys are gone from {_given(self.a)} (the run ended and its "
                  "keys were removed); stopping the node", file=sys.stderr, flush=True)
            return False
        if self.beat is None or self.beat.store is not store:
            self.beat = Heartbeat(store, keys.heartbeat(node), self.cfg.failure_timeout)  # (a lease where there are)
        # a worker stopped (SIGSTOP) for longer than the failure timeout while this agent runs: no
        # longer vouch for the node
        stopped = self.stopped_workers.stopped(self.children)
        if stopped and store.check([keys.RUN_STATE]) and run_ended(store, self.run_id) is not None:
            # the run ended: a stopped worker would never see it, and this agent would wait for it
            # (the launcher until its grace ran out); it has nothing left to do
            for wpid in [w for w, r in self.children.items() if r in stopped]:
                os.kill(wpid, signal.SIGKILL)
        quiet = {lr: t for lr, t in stopped.items() if t > self.cfg.failure_timeout}
        if not quiet:
            self.beat.beat(sealed.beat_value(keys.heartbeat(node)))
            self.silent_said = False
        elif not self.silent_said:
            self.silent_said = True
            print(f"phoenixft agent {node}: worker(s) "
                  + ", ".join(f"{node}.{lr} ({q:.1f}s)" for lr, q in sorted(quiet.items()))
                  + f" stopped (SIGSTOP) for longer than --failure-timeout={self.cfg.failure_timeout:g}s; "
                  "no heartbeat for the node until they run again", flush=True)
        self.injector.tick(store)
        self.notice.tick(store)
        self.health.answer(store)  # (a spare's check done, or asked for again)
        return True

    def reap(self, window_s: float) -> None:
        """For `window_s`, collect the workers that exit: restart one in place when the node is healthy, give
        up the node after MAX_RESTARTS of one worker."""
        deadline = time.monotonic() + window_s
        while self.children and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
            if self.health.owns(pid):  # (the spare's health check, done: its verdict is posted now)
                self._post_health(reaped=True)
                continue
            lr = self.children.pop(pid, None)
            if lr is not None:
                self._exited(lr, os.waitstatus_to_exitcode(status))

    def _exited(self, lr: int, code: int) -> None:
        """Worker `lr` exited with `code`: restart it in place, or count its failure (undecided while the control
        plane does not answer)."""
        if code == 0:
            return
        restarted = self.restart(lr, code)
        if restarted is None:
            self.undecided[lr] = code
            return
        if restarted:
            return
        self.worst = max(self.worst, abs(code))
        if self.restarts[lr] >= MAX_RESTARTS:  # crash loop: give up the whole node (permanent)
            self.stop(signal.SIGTERM, None)

    def _post_health(self, reaped: bool = False) -> None:
        try:
            self.health.poll(self.store, reaped)
        except Exception:  # noqa: BLE001 - not posted: the supervision loop reconnects, the next look posts it
            traceback.print_exc()

    def restart(self, lr: int, code: int) -> bool | None:
        """The node is healthy and its worker `lr` died (exit `code`): restart it in place from the snapshot
        it left in shared memory (a transient failure; no spare needed). False if it is not restarted (the run
        is over, the node fenced, or the worker failed MAX_RESTARTS times); None if the control plane did not
        answer (asked again once it does: a store slow for a moment must not cost the node a worker)."""
        from phoenixft.controlplane import keys, sealed
        from phoenixft.controlplane.signed import run_ended

        store, wid = self.store, f"{self.node}.{lr}"
        if self.restarts[lr] >= MAX_RESTARTS:
            return False
        if store is None:
            return None
        try:
            if ((store.check([keys.RUN_STATE]) and run_ended(store, self.run_id) is not None)
                    or sealed.has(store, keys.fence(self.node))):
                return False
            n = self.restarts[lr] + 1
            sealed.put(store, keys.worker_exit(wid), json.dumps({"t": time.time(), "code": code, "incarnation": n}))
            sealed.put(store, keys.node_restarts(self.node), wid)  # (after the worker's key: looked at first)
            sealed.hint(store, keys.WORKER_EXITS)  # the coordinator looks at wexit/ keys when this moves
        except Exception as e:  # noqa: BLE001 - the control plane did not answer: decided once it does
            print(f"phoenixft agent {self.node}: worker {wid} exited ({code}); the control plane did not answer "
                  f"({type(e).__name__}: {e}): its restart waits for it", flush=True)
            self.store = None  # (reconnected by the supervision loop, never reused after a failed call)
            return None
        self.restarts[lr] = n
        try:
            self.children[_fork_worker(self.a.store, self.node, lr, self.run_id, self.a.threads, n,
                                       self.notice.drain_signal, script=self.script,
                                       term_ignored=self.term_saves)] = lr
        except OSError as e:  # (no memory or process left on the host: this node cannot go on whole)
            print(f"phoenixft agent {self.node}: worker {wid} exited ({code}) and could not be restarted: {e}",
                  flush=True)
            return False
        return True

    def cleanup(self) -> None:
        """Kill and reap the workers (and a health check), then free the node's shared memory; never raises."""
        self.health.stop()
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while self.children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)
            else:
                self.children.pop(pid, None)
        try:
            self.injector.heal()  # only once the workers are gone: a healed link must find nothing to write
            shm.unlink_segments(self.run_id, self.node)
            if self.registered:
                shm.unregister_owner(self.run_id)
        except Exception:  # noqa: BLE001 - best effort on the way out
            traceback.print_exc()

    def stop(self, signum: int, frame: object) -> None:
        """Signal handler (and the node's way out): clean up and exit at once."""
        self.cleanup()
        os._exit(128 + signum)

    def leave(self) -> None:
        """Tell the head this node has left (unless it was fenced); the head stops serving the store once
        every node has left."""
        from phoenixft.controlplane import keys, sealed

        try:
            store, node = self.store, self.node
            if store is not None and not self.fenced and not sealed.has(store, keys.fence(node)):
                sealed.put(store, keys.left(node), str(self.worst))
                store.check([keys.left(node)])  # a set is not acknowledged: an answered request flushes it
        except Exception:  # noqa: BLE001 - the store is gone already: nobody is waiting
            pass


if __name__ == "__main__":
    try:
        rc = main()
    except UserError as e:  # one line, as `phoenixft agent` prints it (e.g. the run ended while it joined)
        print(f"phoenixft agent: {e}", file=sys.stderr)
        rc = 2
    exit_now(rc)  # its files are closed and its memory freed: no need for a slow interpreter teardown
