"""Control-plane load: the recovery protocol's real store traffic for W simulated workers, no training.

    python bench/control_plane.py            # W = 64, 256, 1024, 4096 (G = 8 workers per node)
    python bench/control_plane.py --quick    # W = 64, 256
    python bench/control_plane.py --sizes 64 --out /tmp/x

For each W: a real TCPStore served by this process as the launcher serves it
(`phoenixft.controlplane.server`: 127.0.0.1, a free port; its server is torch's C++ thread: while the
protocol runs, this process's Python threads only read the children's pipes), the REAL coordinator
in its own process (`python -m phoenixft.coordinator --store ...`, started as the launcher starts
it), W/G active nodes and one spare node of G workers each. Every node's agent has its own store
client and first gets itself admitted (the job token's HMAC challenge-response, `phoenixft.controlplane.auth`),
then every 0.25 s checks its fence and heartbeats `hb/<node>`, the two calls of `phoenixft.runtime.agent`
(the agents are one child process, their heartbeats driven by `--threads` threads). The workers
are simulated by `--procs` child processes (default: one per core, at least 2, at most 8), the
nodes dealt round-robin over them, each process driving its nodes from `--threads` threads
(default 4), each node with one store client that does, for each of its workers in turn (with
`--thread-per-worker`: a thread and client per worker), what `phoenixft.runtime.worker` does on the store:
`ready/<wid>`, wait for the topology of epoch 0 (a spare: for `assign/s0`, then its topology),
wait for the failure flag (as the `FailureWatcher`: a server-side `wait`), then the store calls of
`Worker.recover()` - fence check, post its
descriptor (`desc/<e>/<wid>`, built with `recovery.planner.Descriptor` from the topology: the two
ping-pong steps of its parameters, its own shard and the replicas of its ring sources, with crcs)
and set the hint `desc_posted/<e>` - and reads the next topology. What a real process writes sealed with
the run key (`phoenixft.controlplane.sealed`: readiness, heartbeats, descriptors, the agent's exit), the
harness writes sealed too, so the coordinator checks every MAC it would check in a job; the spare health
gate is off (its checks are the spare host's own work, before any failure). A thread takes its nodes one after the
other, phase by phase; a node after the first finds the flag (or the topology) set when it makes its
server-side wait. Workers wait with the store's server-side `wait` rather than the real worker's
back-off poll. Descriptors are built before the failure (a real worker builds its own in parallel with
the others; here they would be serialized).

Why so few threads and several processes: store round trips from one interpreter slow down with
the number of threads that make them (on the 2-core machine of the README: 4,096 descriptor posts
from 4 threads take ~0.2 s, from 16 ~0.4 s, from 64 ~5 s), so the first harness's one thread per
node, all in one process, made its own gather grow faster than W (512 threads at W = 4,096). The
simulating children also run without the cyclic garbage collector: one of them holds the state of
hundreds of workers, and a collection that walks all of it is the harness's cost, not the
protocol's (a real worker holds its own only). (The store is served as the launcher serves it, on
a socket of its own: a `TCPStore(is_master=True)` listens on a dual-stack socket, and the server
thread's reverse lookup of each IPv4-mapped peer, unanswered here, stalled it for seconds during
set-up.) Every child runs in its own session and is
SIGKILLed with its process group in a `finally` (SIGTERM unwinds to it too), and by the kernel if
this process dies first (`PR_SET_PDEATHSIG`); every wait in the harness has a deadline.

Once every worker has read epoch 0, node n1 is killed the way the launcher reports an agent exit
(`exit/n1` set, the `exits` hint set; its agent stops at the exit key, its workers, woken by
the failure flag, see it and go silent).
Measured, from the coordinator's own records (`recovery/1`, the `epoch` event) and the workers'
clocks (one machine, one clock):

* detect: kill -> failure flag set (`t_start` of the recovery record);
* gather: failure flag -> the last descriptor posted;
* decide: failure flag -> topology 1 published (the `epoch` event, or the first read if earlier);
  of it, `after_gather_s`: the last descriptor posted -> the coordinator's `t_decided` (its own
  fetch, parse and plan);
* publish: topology 1 published -> every member of epoch 1 (the spare included) has read it.

Also recorded per W: the CPU seconds, kill -> every member read epoch 1, of the coordinator
(`coordinator_cpu_s`) and of this process (`store_cpu_s`: the store's server thread, the rest of
it idle), and the harness's shape (`procs`, `harness`).

Checked: epoch 1 has s0 in n1's slot and every member read it. Prints a table, writes
bench/results/control_plane.json (`control_plane_decide_s`, `..._detect_s`, `..._publish_s`:
{W: seconds}).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a timed-out wait slice is no news: keep c10d quiet

from benchlib import BENCH_DIR, REPO, RESULTS, kill_group, log, machine_info, spawn, table, tail, write_json

SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import torch.distributed as dist  # noqa: E402

from phoenixft.config import RunConfig  # noqa: E402
from phoenixft.controlplane import auth, keys, sealed  # noqa: E402
from phoenixft.controlplane.server import serve_store  # noqa: E402
from phoenixft.controlplane.signed import sign  # noqa: E402
from phoenixft.distributed.topology import Topology, shard_name  # noqa: E402
from phoenixft.recovery.planner import Descriptor  # noqa: E402
from phoenixft.runtime.procs import die_with_parent  # noqa: E402

G = 8  # workers per node
SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (64, 256)
KILLED = "n1"
STEP = 7  # the step every survivor holds (and STEP - 1, the other ping-pong half)
HB_S = 0.25  # the agent's heartbeat period
WAIT_SLICE_S = 30.0  # server-side waits in long slices: thousands of timed-out waits a second starve the GIL
CONNECTS_AT_ONCE = 64
THREAD_PER_WORKER = False  # --thread-per-worker: a thread and client per simulated worker (4,096 threads at W = 4,096)
THREADS = 4  # --threads: threads per simulating process (and in the agents' process), nodes dealt over them
MARK = "@@cp "  # a simulating child's report lines on its stdout start with it (anything else is ignored)


def crc(shard: str, step: int) -> int:
    """A stand-in checksum, the same for every copy of (shard, step)."""
    return zlib.crc32(f"{shard}@{step}".encode())


def descriptor(topo: Topology, wid: str) -> dict[str, Any]:
    """What a survivor of epoch 0 posts: both ping-pong halves of its parameters, its own shard
    and the replicas of its ring sources, with their checksums (as `Worker._descriptor`)."""
    node, lr = wid.rsplit(".", 1)
    rank = topo.rank_of(node, int(lr))
    d = Descriptor(wid=wid, params=[STEP - 1, STEP], error="recovery requested by the control plane")
    own = shard_name(rank, topo.world)
    d.own[own] = {s: crc(own, s) for s in (STEP - 1, STEP)}
    for src in topo.sources(rank):
        name = shard_name(src, topo.world)
        d.holdings[name] = {s: crc(name, s) for s in (STEP - 1, STEP)}
    return d.to_json()


@dataclass
class Shared:
    """State the threads of one process share (all writes under `lock`)."""

    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    connects: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(CONNECTS_AT_ONCE))
    report: Callable[[dict[str, Any]], None] = field(default=lambda msg: None)  # a line to the harness
    woke: dict[str, float] = field(default_factory=dict)  # wid -> when it saw the failure flag
    posted: dict[str, float] = field(default_factory=dict)  # wid -> when its descriptor was posted
    read1: dict[str, float] = field(default_factory=dict)  # wid -> when it had read topology 1
    nodes1: dict[str, list[str]] = field(default_factory=dict)  # wid -> the members of topology 1 it read
    errors: list[str] = field(default_factory=list)


def _connect(addr: str, sh: Shared) -> Any:
    host, port = addr.rsplit(":", 1)
    with sh.connects:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def _wait_get(c: Any, key: str, sh: Shared, deadline: float) -> bytes | None:
    """Block (server-side `wait`, in slices) until `key` exists; None on stop or past the deadline."""
    while not sh.stop.is_set() and time.monotonic() < deadline:
        try:
            c.wait([key], timedelta(seconds=max(0.1, min(WAIT_SLICE_S, deadline - time.monotonic()))))
            return bytes(c.get(key))
        except Exception:  # noqa: BLE001 - a slice timed out (or the store is gone: the deadline ends it)
            continue
    return None


def _epoch(node: str, raw: bytes) -> int:
    """The epoch in spare `node`'s sealed `assign/<node>` (as the worker reads it: the MAC checked)."""
    value = sealed.unseal(keys.assign(node), raw)
    if value is None:
        raise ValueError(f"{keys.assign(node)} does not verify with the run key")
    return int(value)


def _admit(addr: str, node: str, sh: Shared, deadline: float, clients: dict[str, Any]) -> None:
    """One agent gets itself admitted (the job token's HMAC challenge-response) on its own client."""
    try:
        c = _connect(addr, sh)
        req = {"name": node, "spare": node.startswith("s"), "workers": G, "host": "127.0.0.1", "pid": os.getpid()}
        auth.request_admission(c, req, os.environ[auth.TOKEN_ENV], max(1.0, deadline - time.monotonic()), addr)
        with sh.lock:
            clients[node] = c
    except Exception as e:  # noqa: BLE001 - the harness then times out waiting for the job to start
        print(f"agent {node}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _beat(clients: dict[str, Any], sh: Shared, deadline: float) -> None:
    """Every HB_S, each of these agents checks its fence and heartbeats - the real agent's two store
    calls a beat - in turn. n1's agent also looks at its exit key and stops there (how this harness
    tells it that it was killed)."""
    try:
        due = time.monotonic()
        while clients and not sh.stop.is_set() and time.monotonic() < deadline:
            for node, c in list(clients.items()):
                if c.check([keys.fence(node)]) or (node == KILLED and c.check([keys.node_exit(node)])):
                    del clients[node]
                    continue
                c.set(keys.heartbeat(node), sealed.beat_value(keys.heartbeat(node)))
            due = max(due + HB_S, time.monotonic())
            sh.stop.wait(due - time.monotonic())
    except Exception as e:  # noqa: BLE001 - the store is gone (the harness ended): nothing to report to
        print(f"agents {','.join(list(clients)[:3])}..: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def agents_main(addr: str, nodes: list[str], budget_s: float, parent: int) -> int:
    """The agents of every node, in one child process (`--agents`), apart from the workers' processes
    so that those cannot starve a heartbeat: each agent (its own client) is admitted from a thread of
    its own, then THREADS threads heartbeat for all of them, the nodes dealt round-robin - a few
    threads rather than one per agent, whose wake-ups would cost more CPU than the heartbeats
    themselves (a real agent has its own host)."""
    die_with_parent(signal.SIGKILL, parent)  # not even a SIGKILLed harness leaves it behind
    sh = Shared()
    deadline = time.monotonic() + budget_s
    threading.stack_size(512 * 1024)
    clients: dict[str, Any] = {}
    admits = [threading.Thread(target=_admit, args=(addr, n, sh, deadline, clients), daemon=True) for n in nodes]
    for t in admits:
        t.start()
    for t in admits:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    k = max(1, min(THREADS, len(nodes)))
    threads = [threading.Thread(target=_beat, args=({n: clients[n] for n in nodes[i::k] if n in clients}, sh,
                                                    deadline), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return 0


def _silent(c: Any, node: str) -> bool:
    """Woken by the failure flag: is this the killed node? (Its exit was reported before the flag
    was set; it then makes no more calls, as a dead node does not.)"""
    return node == KILLED and bool(c.check([keys.node_exit(node)]))


def _error(sh: Shared, what: str, e: Exception) -> None:
    if not sh.stop.is_set():
        msg = f"{what}: {type(e).__name__}: {e}"
        with sh.lock:
            sh.errors.append(msg)
        sh.report({"error": msg})


def _worker(addr: str, wid: str, sh: Shared, deadline: float) -> None:
    """One worker's store traffic through epoch 0, the failure and the join of epoch 1."""
    node = wid.rsplit(".", 1)[0]
    try:
        c = _connect(addr, sh)
        sealed.put(c, keys.ready(wid), str(time.time()))
        if node.startswith("s"):  # a spare: wait, warm, to be promoted
            e = _wait_get(c, keys.assign(node), sh, deadline)
            if e is None:
                return
            raw = _wait_get(c, keys.topo(_epoch(node, e)), sh, deadline)
            if raw is not None:
                _read1(sh, wid, raw)
            return
        raw = _wait_get(c, keys.topo(0), sh, deadline)
        if raw is None:
            return
        topo = Topology.from_json(raw)
        desc = descriptor(topo, wid)
        sh.report({"read0": 1})
        if _wait_get(c, keys.failflag(0), sh, deadline) is None or _silent(c, node):
            return
        _post_descriptor(c, sh, node, wid, desc)
        raw = _wait_get(c, keys.topo(1), sh, deadline)
        c.check([keys.fence(node)])
        if raw is not None:
            _read1(sh, wid, raw)
    except Exception as e:  # noqa: BLE001 - reported, the run then misses its checks
        _error(sh, f"worker {wid}", e)


def _post_descriptor(c: Any, sh: Shared, node: str, wid: str, desc: dict[str, Any]) -> None:
    """One worker's store calls of Worker.recover(), in its order: fence check, descriptor, counter."""
    desc["t"] = time.time()
    with sh.lock:
        sh.woke[wid] = desc["t"]
    c.check([keys.fence(node)])  # (the flag is not set again: a worker woken by it leaves it be)
    sealed.put(c, keys.desc(0, wid), json.dumps(desc))
    sealed.hint(c, keys.desc_posted(0))  # (a hint, never an `add`: see controlplane.sealed)
    with sh.lock:
        sh.posted[wid] = time.time()


def _wids(node: str) -> list[str]:
    return [f"{node}.{i}" for i in range(G)]


def _open(addr: str, node: str, sh: Shared, clients: dict[str, Any]) -> None:
    """A node's client, connected and its workers announced (`ready/<wid>`): set-up, one thread per
    node so that slow connects overlap (here each may wait seconds for a reverse DNS lookup that
    c10d makes to name the address, unanswered in this sandbox)."""
    try:
        c = _connect(addr, sh)
        for wid in _wids(node):
            sealed.put(c, keys.ready(wid), str(time.time()))
        with sh.lock:
            clients[node] = c
    except Exception as e:  # noqa: BLE001 - reported, the run then misses its checks
        _error(sh, f"node {node}", e)


def _nodes(clients: dict[str, Any], sh: Shared, deadline: float) -> None:
    """The store traffic of the workers of these nodes from one thread: each node has its own client
    (`clients`: node -> client, connected and announced by `_open`), which makes its G workers'
    calls in turn (the same calls, keys and order as `_worker`); the thread takes its nodes one
    after the other, phase by phase (epoch 0 read; woken by the flag, descriptors posted; epoch 1
    read). A node after the first finds the flag (or the topology) there already when its
    server-side wait is made. A real node's workers make these calls in parallel, so this is, if
    anything, slower than the real thing; a few threads per process keep the wake-ups of thousands
    from costing more CPU than the calls."""
    nodes = list(clients)
    try:
        for n in nodes:
            if n.startswith("s"):  # a spare (on a thread of its own): wait, warm, to be promoted
                c = clients[n]
                e = _wait_get(c, keys.assign(n), sh, deadline)
                if e is None or _wait_get(c, keys.topo(_epoch(n, e)), sh, deadline) is None:
                    return
                for wid in _wids(n):
                    _read1(sh, wid, bytes(c.get(keys.topo(_epoch(n, e)))))
        active = [n for n in nodes if not n.startswith("s")]
        topos: dict[str, Topology] = {}
        descs: dict[str, dict[str, dict[str, Any]]] = {}
        for n in active:
            raw = _wait_get(clients[n], keys.topo(0), sh, deadline)
            if raw is None:
                return
            topos[n] = Topology.from_json(raw)
            descs[n] = {wid: descriptor(topos[n], wid) for wid in _wids(n)}
            sh.report({"read0": G})
        live = []
        for n in active:
            c = clients[n]
            if _wait_get(c, keys.failflag(0), sh, deadline) is None:
                return
            if _silent(c, n):
                continue
            for wid in _wids(n):
                _post_descriptor(c, sh, n, wid, descs[n][wid])
            live.append(n)
        for n in live:
            c = clients[n]
            if _wait_get(c, keys.topo(1), sh, deadline) is None:
                return
            for wid in _wids(n):
                raw = bytes(c.get(keys.topo(1)))
                c.check([keys.fence(n)])
                _read1(sh, wid, raw)
    except Exception as e:  # noqa: BLE001 - reported, the run then misses its checks
        _error(sh, f"nodes {','.join(nodes[:3])}{'...' if len(nodes) > 3 else ''}", e)


def _read1(sh: Shared, wid: str, raw: bytes) -> None:
    t = time.time()
    nodes = Topology.from_json(raw).nodes
    with sh.lock:
        sh.read1[wid] = t
        sh.nodes1[wid] = nodes  # checked once every read is done (the check is no worker's work)


def sim_main(addr: str, nodes: list[str], budget_s: float, parent: int) -> int:
    """The workers of `nodes`, simulated by this child process (`--sim`): THREADS threads over the
    nodes (or, `--thread-per-worker`, one per worker), as above. It reports on its stdout, one
    `MARK`ed JSON line each: `{"read0": k}` as k more workers have read epoch 0, `{"error": ...}` at
    once, and `{"result": ...}` (every worker's clocks and checks) once each of its threads is done,
    then exits."""
    die_with_parent(signal.SIGKILL, parent)  # not even a SIGKILLed harness leaves it behind
    gc.disable()  # hundreds of workers' state in one heap: see the module docstring
    out_lock = threading.Lock()

    def report(msg: dict[str, Any]) -> None:
        line = MARK + json.dumps(msg) + "\n"
        with out_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    sh = Shared(report=report)
    deadline = time.monotonic() + budget_s
    threading.stack_size(512 * 1024)
    if THREAD_PER_WORKER:
        threads = [threading.Thread(target=_worker, args=(addr, f"{n}.{i}", sh, deadline), daemon=True)
                   for n in nodes for i in range(G)]
    else:  # the active nodes dealt over THREADS threads, a spare on one of its own
        clients: dict[str, Any] = {}
        opens = [threading.Thread(target=_open, args=(addr, n, sh, clients), daemon=True) for n in nodes]
        for t in opens:
            t.start()
        for t in opens:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        active = [n for n in nodes if not n.startswith("s") and n in clients]
        k = max(1, min(THREADS, len(active)))
        groups = [active[i::k] for i in range(k)] + [[n] for n in nodes if n.startswith("s") and n in clients]
        threads = [threading.Thread(target=_nodes, args=({n: clients[n] for n in grp}, sh, deadline), daemon=True)
                   for grp in groups if grp]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    with sh.lock:  # ok1: wid -> topology 1 it read has s0 in n1's slot
        ok1 = {w: len(ns) > 1 and ns[1] == "s0" and KILLED not in ns for w, ns in sh.nodes1.items()}
        res = {"woke": dict(sh.woke), "posted": dict(sh.posted), "read1": dict(sh.read1), "ok1": ok1,
               "errors": list(sh.errors), "unfinished": sum(t.is_alive() for t in threads)}
    report({"result": res})
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Child:
    """A `--sim` child process and what it has reported (written by its reader thread under `lock`)."""

    proc: subprocess.Popen[bytes]
    log: Path
    lock: threading.Lock
    read0: int = 0
    errors: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None
    reader: threading.Thread | None = None

    def read_reports(self) -> None:
        """Until its stdout closes (it exited, or was killed): the child's MARKed lines."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith(MARK.encode()):
                continue
            try:
                msg = json.loads(line[len(MARK):])
            except ValueError:
                continue
            with self.lock:
                self.read0 += int(msg.get("read0", 0))
                if "error" in msg:
                    self.errors.append(str(msg["error"]))
                if "result" in msg:
                    self.result = msg["result"]

    def gone(self) -> bool:
        """Exited and its output read, without a result: it failed."""
        return self.proc.poll() is not None and self.reader is not None and not self.reader.is_alive() \
            and self.result is None


def _start_child(cmd: list[str], log_path: Path, env: dict[str, str], lock: threading.Lock) -> Child:
    """Start a `--sim` child in its own session (its group is SIGKILLed by `kill_group`), stdout a
    pipe read by a daemon thread, stderr to `log_path`; environment as `benchlib.spawn` gives."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.update(env)
    with open(log_path, "ab") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=full_env, cwd=str(REPO))
    ch = Child(proc=p, log=log_path, lock=lock)
    ch.reader = threading.Thread(target=ch.read_reports, daemon=True)
    ch.reader.start()
    return ch


def _until(cond: Any, deadline: float, what: str, trouble: Any, why: Any = None) -> None:
    """Wait (bounded by `deadline`) until cond(); raise naming `what` (and why()) if not, or at
    once if trouble() names a process that died."""
    while not cond():
        bad = trouble()
        if bad:
            raise RuntimeError(f"{bad} while waiting for {what}" + (f" ({why()})" if why else ""))
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}" + (f" ({why()})" if why else ""))
        time.sleep(0.01)


def default_procs() -> int:
    """Simulating processes: one per core, at least 2 (the GIL of one would carry every node), at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


def run_one(w: int, workdir: Path, failure_timeout: float = 60.0, procs: int = 0) -> dict[str, Any]:
    """One recovery at W workers (W/G nodes + one spare node); the timings and checks.

    `failure_timeout` is long (the run's default is 10 s) so that this harness, a few Python
    processes driving thousands of workers, is never mistaken for unresponsive nodes: nothing
    here waits for it when every survivor answers. `procs`: simulating child processes (0: the
    default, `default_procs()`)."""
    if w % G or w // G < 3:
        raise ValueError(f"W={w}: need a multiple of {G} with at least 3 nodes")
    n_nodes = w // G
    budget = 60.0 + 0.03 * w
    deadline = time.monotonic() + budget
    server = serve_store("127.0.0.1", 0)  # as the launcher serves it (an IPv4 socket of its own, see store_server)
    addr = server.addr
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    cfg = RunConfig(nodes=n_nodes, workers_per_node=G, spares=1, protect="phoenix", replicas=1,
                    failure_timeout=failure_timeout, quiet=True,
                    # the simulated agents run no spare health check (a real one runs on its own host, before
                    # the failure): with the gate off every ready spare counts as healthy, and the spare is
                    # promoted as one whose fresh verdict passed would be, at no cost to the protocol measured
                    health_gate=False)
    token, run_id, raw_cfg = auth.generate_token(), f"cp{w}", cfg.to_json()
    store.set(keys.CONFIG_SIG, sign(token, run_id, keys.CONFIG, raw_cfg))  # as the launcher writes it: signed
    store.set(keys.CONFIG, raw_cfg)
    store.set(keys.RUN_ID, run_id)
    sealed.bind(token, run_id)  # this process writes an agent's exit as the launcher does: sealed
    coord_log = workdir / f"coordinator-w{w}.log"
    agents_log = workdir / f"agents-w{w}.log"
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           auth.TOKEN_ENV: token}  # the coordinator signs with it, the agents prove it
    nodes = [f"n{i}" for i in range(n_nodes)] + ["s0"]
    procs = max(1, min(procs or default_procs(), len(nodes)))
    lock = threading.Lock()
    children: list[Child] = []
    me = str(Path(__file__).resolve())
    lifeline = ["--parent", str(os.getpid())]  # each child dies with this process (PR_SET_PDEATHSIG)
    # as the launcher starts it: SIGKILLed by the kernel if this process dies
    coord = spawn([sys.executable, "-m", "phoenixft.runtime.procs", *lifeline, "--signal", str(int(signal.SIGKILL)),
                   "phoenixft.coordinator", "--store", addr], coord_log, env=env)
    agents = None
    opts = [*lifeline, "--run-id", run_id, "--threads", str(THREADS),
            *(["--thread-per-worker"] if THREAD_PER_WORKER else [])]

    def trouble() -> str | None:
        if coord.poll() is not None:
            return f"coordinator exited ({coord.returncode}):\n{tail(coord_log)}"
        if agents is not None and agents.poll() is not None:
            return f"the agents' process exited ({agents.returncode}):\n{tail(agents_log)}"
        with lock:
            errs = [e for ch in children for e in ch.errors]
            gone = [ch for ch in children if ch.gone()]
        if errs:
            return "; ".join(errs[:3])
        if gone:
            return f"a simulating process exited ({gone[0].proc.returncode}) without its result:\n{tail(gone[0].log)}"
        return None

    def n_read0() -> int:
        with lock:
            return sum(ch.read0 for ch in children)

    def n_done() -> int:
        with lock:
            return sum(ch.result is not None for ch in children)

    try:
        agents = spawn([sys.executable, me, "--agents", ",".join(nodes), "--store", addr, "--budget", str(budget),
                        *opts], agents_log, env=env)
        t_setup = time.monotonic()
        for k in range(procs):
            children.append(_start_child([sys.executable, me, "--sim", ",".join(nodes[k::procs]), "--store", addr,
                                          "--budget", str(budget), *opts], workdir / f"sim{k}-w{w}.log", env, lock))
        def spare_warm() -> bool:
            """s0 admitted and its workers ready (else the recovery would shrink the job, not swap)."""
            if not store.check([keys.ready(f"s0.{i}") for i in range(G)] + [keys.MEMBERS]):
                return False
            return "s0" in json.loads(sealed.peel(store.get(keys.MEMBERS)) or b"{}")

        _until(lambda: n_read0() == w and spare_warm(), deadline, "every worker to read epoch 0, the spare warm",
               trouble, lambda: f"{n_read0()} of {w} read it; topology 0 published: {store.check([keys.topo(0)])}; "
                                f"spare warm: {spare_warm()}")
        setup_s = time.monotonic() - t_setup
        time.sleep(0.5)  # the coordinator is in its steady loop, every node has heartbeated
        members = [f"{n}.{i}" for n in nodes if n != KILLED for i in range(G)]
        cpu0, own0 = _cpu_s(coord.pid), _own_cpu_s()
        t_kill = time.time()
        sealed.put(store, keys.node_exit(KILLED), str(t_kill))  # what the launcher does when an agent exits
        sealed.hint(store, keys.EXITS)  # its agent stops at the exit key; its workers see it when the flag wakes them
        _until(lambda: n_done() == procs, deadline, "every member to read epoch 1", trouble,
               lambda: f"{n_done()} of {procs} simulating processes done; "
                       f"{sum(store.check([keys.desc(0, m)]) for m in members)} descriptors posted; topology 1 "
                       f"published: {store.check([keys.topo(1)])}; run error: "
                       f"{store.get(keys.RUN_ERROR).decode() if store.check([keys.RUN_ERROR]) else None}")
        coord_cpu_s = _cpu_s(coord.pid) - cpu0
        store_cpu_s = _own_cpu_s() - own0
        rec = json.loads(sealed.peel(store.get(keys.recovery(1))) or b"")
        events = [json.loads(sealed.peel(x) or b"") for x in bytes(store.get(keys.EVENTS)).splitlines() if x.strip()]
    finally:
        sealed.unbind()
        kill_group(coord)
        kill_group(agents)
        for ch in children:
            kill_group(ch.proc)
        join_by = time.monotonic() + 5.0
        for ch in children:
            if ch.reader is not None:
                ch.reader.join(timeout=max(0.0, join_by - time.monotonic()))
            if ch.proc.stdout is not None:
                ch.proc.stdout.close()
    woke: dict[str, float] = {}
    posted: dict[str, float] = {}
    read1: dict[str, float] = {}
    ok1: dict[str, bool] = {}
    errors: list[str] = []
    unfinished = 0
    for ch in children:
        r = ch.result or {}
        woke.update(r.get("woke", {}))
        posted.update(r.get("posted", {}))
        read1.update(r.get("read1", {}))
        ok1.update(r.get("ok1", {}))
        errors += r.get("errors", [])
        unfinished += int(r.get("unfinished", 0))
    ep1 = next(e for e in events if e.get("kind") == "epoch" and e.get("epoch") == 1)
    t_flag = rec["t_start"]
    t_pub = min([ep1["t"], *read1.values()])
    planned: dict[str, Any] = next(
        (e for e in events if e.get("kind") == "recovery_planned" and e.get("epoch") == 1), {})
    read_ok = all(ok1.get(m, False) for m in members)
    how = ("a thread per worker" if THREAD_PER_WORKER else
           f"{THREADS} threads each, a client per node (its workers' calls in turn)")
    return {
        "workers": w, "nodes": n_nodes, "workers_per_node": G, "setup_s": setup_s,
        "t_kill": t_kill, "detect_s": t_flag - t_kill,
        "woke_s": max(woke.values()) - t_flag,
        "gather_s": max(posted.values()) - t_flag,
        "decide_s": t_pub - t_flag,
        "after_gather_s": rec["t_decided"] - max(posted.values()),
        "plan_s": planned.get("decide_s"),
        "publish_s": max(read1.values()) - t_pub,
        "total_s": max(read1.values()) - t_kill,
        "coordinator_cpu_s": coord_cpu_s, "store_cpu_s": store_cpu_s,
        "descriptors": len(posted), "members_read": len(read1), "members": len(members),
        "promoted": rec["promoted"], "dead": rec["dead"], "action": rec["action"],
        "spare_in_slot": read_ok, "errors": errors[:5], "unfinished_threads": unfinished,
        "procs": procs, "harness": f"{procs} simulating processes, {how}",
    }


def run(quick: bool, out: Path = RESULTS, sizes: tuple[int, ...] | None = None, procs: int = 0) -> dict[str, Any]:
    """Every W in turn; prints the table, writes out/control_plane.json and returns it."""
    started = time.time()
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    workdir = Path(tempfile.mkdtemp(prefix="phoenixft-cp-"))
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    try:
        for w in sizes:
            log(f"control_plane: W={w} ({w // G} nodes x {G} + 1 spare node)")
            try:
                r = run_one(w, workdir, procs=procs)
            except Exception as e:  # noqa: BLE001 - one size that overran its budget must not lose the others
                log(f"control_plane: W={w} failed: {type(e).__name__}: {str(e)[:500]}")
                failed.append({"workers": w, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
                continue
            rows.append(r)
            log(f"control_plane: W={w}: detect {r['detect_s']:.3f}s decide {r['decide_s']:.3f}s "
                f"publish {r['publish_s']:.3f}s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table("Control plane: one node killed, W simulated workers (store traffic only)",
          ["W", "nodes", "detect s", "gather s", "decide s", "of it after gather s", "publish s",
           "coordinator CPU s", "ok"],
          [[r["workers"], r["nodes"], r["detect_s"], r["gather_s"], r["decide_s"], r["after_gather_s"],
            r["publish_s"], r["coordinator_cpu_s"], r["spare_in_slot"] and r["members_read"] == r["members"]]
           for r in rows])
    res = {
        "part": "control_plane", "quick": quick, "machine": machine_info(),
        "control_plane_detect_s": {str(r["workers"]): r["detect_s"] for r in rows},
        "control_plane_decide_s": {str(r["workers"]): r["decide_s"] for r in rows},
        "control_plane_publish_s": {str(r["workers"]): r["publish_s"] for r in rows},
        "runs": rows, "failed": failed, "elapsed_s": round(time.time() - started, 1),
    }
    write_json(out / "control_plane.json", res)
    return res


def main() -> int:
    global THREAD_PER_WORKER, THREADS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"W = {', '.join(map(str, QUICK_SIZES))} only")
    ap.add_argument("--sizes", default="", help="comma-separated W (multiples of 8, at least 24)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--procs", type=int, default=0,
                    help=f"processes that simulate the workers (default: one per core, 2..8; here {default_procs()})")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="threads per simulating process (and in the agents' one), the nodes dealt over them")
    ap.add_argument("--agents", default="", help=argparse.SUPPRESS)  # internal: run these nodes' agents
    ap.add_argument("--sim", default="", help=argparse.SUPPRESS)  # internal: simulate these nodes' workers
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)  # the harness's pid
    ap.add_argument("--run-id", default="", help=argparse.SUPPRESS)  # the children seal with the run key
    ap.add_argument("--thread-per-worker", action="store_true",
                    help="one harness thread per simulated worker (default: one per node, its workers in turn)")
    a = ap.parse_args()
    THREAD_PER_WORKER = a.thread_per_worker
    if a.procs < 0 or a.threads < 1:
        ap.error("--procs must be at least 1 (0: the default), --threads at least 1")
    THREADS = a.threads
    if a.agents or a.sim:  # what the job's processes write is sealed with the run key (controlplane.sealed)
        sealed.bind(os.environ[auth.TOKEN_ENV], a.run_id)
    if a.agents:
        return agents_main(a.store, a.agents.split(","), a.budget, a.parent or os.getppid())
    if a.sim:
        return sim_main(a.store, a.sim.split(","), a.budget, a.parent or os.getppid())
    sizes = tuple(int(x) for x in a.sizes.split(",") if x.strip()) or None
    res = run(a.quick, out=Path(a.out), sizes=sizes, procs=a.procs)
    ok = not res["failed"] and all(r["spare_in_slot"] and r["members_read"] == r["members"] for r in res["runs"])
    return 0 if ok else 1


class Terminated(BaseException):
    """SIGTERM: unwind (every `finally` kills its children), then exit 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: worker threads may still sit in a store call."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    rc = 130
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc = main()
    except KeyboardInterrupt:
        pass
    except Terminated:
        rc = 143
    except Exception:  # noqa: BLE001 - print it, then exit without the teardown
        import traceback

        traceback.print_exc()
        rc = 1
    _exit(rc)
