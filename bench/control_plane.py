"""Control-plane load: the recovery protocol's real store traffic for W simulated workers, no training.

    python bench/control_plane.py            # W = 64, 256, 1024, 4096 (G = 8 workers per node)
    python bench/control_plane.py --quick    # W = 64, 256
    python bench/control_plane.py --sizes 64 --out /tmp/x

For each W: a real TCPStore served in this process (127.0.0.1, free port), the REAL coordinator in
its own process (`python -m phoenixft.coordinator --store ...`, own session, killed in a
`finally`), W/G active nodes and one spare node of G workers each. Every node's agent is a thread
that first gets itself admitted (the job token's HMAC challenge-response, `phoenixft.auth`), then
heartbeats `hb/<node>` every 0.25 s and checks its fence, as `phoenixft.agent` does; every
node's workers are one thread with one store client that does, for each worker in turn (with
`--thread-per-worker`: a thread and client per worker), what `phoenixft.worker` does on the store:
`ready/<wid>`, wait for the topology of epoch 0 (a spare: for `assign/s0`, then its topology),
wait for the failure flag (as the `FailureWatcher`: a server-side `wait`), then the store calls of
`Worker.recover()` - fence check, append a `failure_detected` event, post its
descriptor (`desc/<e>/<wid>`, built with `recovery.planner.Descriptor` from the topology: the two
ping-pong steps of its parameters, its own shard and the replicas of its ring sources, with crcs)
and bump `desc_posted/<e>` - and reads the next topology. Workers wait with the store's
server-side `wait` rather than the real worker's 5 ms poll, so that this one process can drive
4,096 of them on two cores. Descriptors are built before the failure (a real worker builds its own
in parallel with the others; here they would be serialized on one GIL).

Once every worker has read epoch 0, node n1 is killed the way the launcher reports an agent exit
(`exit/n1` set, the `exits` counter bumped; its agent stops heartbeating, its workers go silent).
Measured, from the coordinator's own records (`recovery/1`, the `epoch` event) and the workers'
clocks (one machine, one clock):

* detect: kill -> failure flag set (`t_start` of the recovery record);
* gather: failure flag -> the last descriptor posted;
* decide: failure flag -> topology 1 published (the `epoch` event, or the first read if earlier);
* publish: topology 1 published -> every member of epoch 1 (the spare included) has read it.

Checked: epoch 1 has s0 in n1's slot and every member read it. Prints a table, writes
bench/results/control_plane.json (`control_plane_decide_s`, `..._detect_s`, `..._publish_s`:
{W: seconds}).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a timed-out wait slice is no news: keep c10d quiet

from benchlib import REPO, RESULTS, kill_group, log, machine_info, spawn, table, tail, write_json

SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import torch.distributed as dist  # noqa: E402

from phoenixft import auth, keys  # noqa: E402
from phoenixft.config import RunConfig  # noqa: E402
from phoenixft.recovery.planner import Descriptor  # noqa: E402
from phoenixft.topology import Topology, shard_name  # noqa: E402

G = 8  # workers per node
SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (64, 256)
KILLED = "n1"
STEP = 7  # the step every survivor holds (and STEP - 1, the other ping-pong half)
HB_S = 0.25  # the agent's heartbeat period
WAIT_SLICE_S = 30.0  # server-side waits in long slices: thousands of timed-out waits a second starve the GIL
CONNECTS_AT_ONCE = 64
THREAD_PER_WORKER = False  # --thread-per-worker: the first harness (4,096 threads at W = 4,096)


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
    """State the harness threads share (all writes under `lock`)."""

    stop: threading.Event = field(default_factory=threading.Event)
    killed: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    connects: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(CONNECTS_AT_ONCE))
    read0: int = 0
    woke: dict[str, float] = field(default_factory=dict)  # wid -> when it saw the failure flag
    posted: dict[str, float] = field(default_factory=dict)  # wid -> when its descriptor was posted
    read1: dict[str, float] = field(default_factory=dict)  # wid -> when it had read topology 1
    nodes1: dict[str, list[str]] = field(default_factory=dict)  # wid -> the members it read
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


def _agent(addr: str, node: str, sh: Shared, deadline: float) -> None:
    """A node agent's store traffic: fence check, heartbeat every HB_S; silent once its node is
    killed (the harness reports that as the launcher does, with `exit/<node>`)."""
    try:
        c = _connect(addr, sh)
        req = {"name": node, "spare": node.startswith("s"), "workers": G, "host": "127.0.0.1", "pid": os.getpid()}
        auth.request_admission(c, req, os.environ[auth.TOKEN_ENV], max(1.0, deadline - time.monotonic()), addr)
        while not sh.stop.is_set() and time.monotonic() < deadline:
            if c.check([keys.fence(node)]) or c.check([keys.node_exit(node)]):
                return
            c.set(keys.heartbeat(node), str(time.time()))
            sh.stop.wait(HB_S)
    except Exception as e:  # noqa: BLE001 - the store is gone (the harness ended): nothing to report to
        print(f"agent {node}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def agents_main(addr: str, nodes: list[str], budget_s: float) -> int:
    """The agents of every node, as threads of one child process (`--agents`): apart from the
    workers' threads, so that thousands of those cannot starve a heartbeat of the GIL."""
    sh = Shared()
    deadline = time.monotonic() + budget_s
    threading.stack_size(512 * 1024)
    threads = [threading.Thread(target=_agent, args=(addr, n, sh, deadline), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return 0


def _worker(addr: str, wid: str, sh: Shared, deadline: float) -> None:
    """One worker's store traffic through epoch 0, the failure and the join of epoch 1."""
    node = wid.rsplit(".", 1)[0]
    try:
        c = _connect(addr, sh)
        c.set(keys.ready(wid), str(time.time()))
        if node.startswith("s"):  # a spare: wait, warm, to be promoted
            e = _wait_get(c, keys.assign(node), sh, deadline)
            if e is None:
                return
            raw = _wait_get(c, keys.topo(int(e)), sh, deadline)
            if raw is not None:
                _read1(sh, wid, raw)
            return
        raw = _wait_get(c, keys.topo(0), sh, deadline)
        if raw is None:
            return
        topo = Topology.from_json(raw)
        desc = descriptor(topo, wid)
        with sh.lock:
            sh.read0 += 1
        if _wait_get(c, keys.failflag(0), sh, deadline) is None or (node == KILLED and sh.killed.is_set()):
            return
        _post_descriptor(c, sh, topo, node, wid, desc)
        raw = _wait_get(c, keys.topo(1), sh, deadline)
        c.check([keys.fence(node)])
        if raw is not None:
            _read1(sh, wid, raw)
    except Exception as e:  # noqa: BLE001 - reported, the run then misses its checks
        if not sh.stop.is_set():
            with sh.lock:
                sh.errors.append(f"worker {wid}: {type(e).__name__}: {e}")


def _post_descriptor(c: Any, sh: Shared, topo: Topology, node: str, wid: str, desc: dict[str, Any]) -> None:
    """One worker's store calls of Worker.recover(), in its order: notice, event, descriptor."""
    desc["t"] = time.time()
    with sh.lock:
        sh.woke[wid] = desc["t"]
    c.check([keys.fence(node)])  # (the flag is not set again: a worker woken by it leaves it be)
    rec = {"t": desc["t"], "kind": "failure_detected", "wid": wid, "epoch": 0, "error": desc["error"],
           "rank": topo.rank_of(node, int(wid.rsplit(".", 1)[1]))}
    c.append(keys.EVENTS, json.dumps(rec) + "\n")
    c.set(keys.desc(0, wid), json.dumps(desc))
    c.add(keys.desc_posted(0), 1)
    with sh.lock:
        sh.posted[wid] = time.time()


def _node(addr: str, node: str, sh: Shared, deadline: float) -> None:
    """The store traffic of one node's G workers from one thread and client, each worker's calls in
    turn (the same calls, keys and order as `_worker`; G times fewer threads, so that W = 4,096 does
    not mean 4,096 threads woken at once on one interpreter lock). A real node's workers make these
    calls in parallel, so this is, if anything, slower than the real thing."""
    wids = [f"{node}.{i}" for i in range(G)]
    try:
        c = _connect(addr, sh)
        for wid in wids:
            c.set(keys.ready(wid), str(time.time()))
        if node.startswith("s"):  # a spare: wait, warm, to be promoted
            e = _wait_get(c, keys.assign(node), sh, deadline)
            if e is None or _wait_get(c, keys.topo(int(e)), sh, deadline) is None:
                return
            for wid in wids:
                _read1(sh, wid, bytes(c.get(keys.topo(int(e)))))
            return
        raw = _wait_get(c, keys.topo(0), sh, deadline)
        if raw is None:
            return
        topo = Topology.from_json(raw)
        descs = {wid: descriptor(topo, wid) for wid in wids}
        with sh.lock:
            sh.read0 += G
        if _wait_get(c, keys.failflag(0), sh, deadline) is None or (node == KILLED and sh.killed.is_set()):
            return
        for wid in wids:
            _post_descriptor(c, sh, topo, node, wid, descs[wid])
        if _wait_get(c, keys.topo(1), sh, deadline) is None:
            return
        for wid in wids:
            raw = bytes(c.get(keys.topo(1)))
            c.check([keys.fence(node)])
            _read1(sh, wid, raw)
    except Exception as e:  # noqa: BLE001 - reported, the run then misses its checks
        if not sh.stop.is_set():
            with sh.lock:
                sh.errors.append(f"node {node}: {type(e).__name__}: {e}")


def _read1(sh: Shared, wid: str, raw: bytes) -> None:
    t = time.time()
    nodes = Topology.from_json(raw).nodes
    with sh.lock:
        sh.read1[wid] = t
        sh.nodes1[wid] = nodes


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _until(cond: Any, deadline: float, what: str, coord: Any, log_path: Path, why: Any = None) -> None:
    """Wait (bounded by `deadline`) until cond(); raise naming `what` (and why()) if not."""
    while not cond():
        if coord.poll() is not None:
            raise RuntimeError(f"coordinator exited ({coord.returncode}) while waiting for {what}"
                               + (f" ({why()})" if why else "") + f":\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}" + (f" ({why()})" if why else ""))
        time.sleep(0.01)


def run_one(w: int, workdir: Path, failure_timeout: float = 60.0) -> dict[str, Any]:
    """One recovery at W workers (W/G nodes + one spare node); the timings and checks.

    `failure_timeout` is long (the run's default is 10 s) so that this harness, one Python
    process driving thousands of workers, is never mistaken for unresponsive nodes: nothing
    here waits for it when every survivor answers."""
    if w % G or w // G < 3:
        raise ValueError(f"W={w}: need a multiple of {G} with at least 3 nodes")
    n_nodes = w // G
    budget = 60.0 + 0.03 * w
    deadline = time.monotonic() + budget
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    addr = f"127.0.0.1:{server.port}"
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    cfg = RunConfig(nodes=n_nodes, workers_per_node=G, spares=1, protect="phoenix", replicas=1,
                    failure_timeout=failure_timeout, quiet=True)
    store.set(keys.CONFIG, cfg.to_json())
    store.set(keys.RUN_ID, f"cp{w}")
    sh = Shared()
    coord_log = workdir / f"coordinator-w{w}.log"
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           auth.TOKEN_ENV: auth.generate_token()}  # the coordinator signs with it, the agents prove it
    nodes = [f"n{i}" for i in range(n_nodes)] + ["s0"]
    coord = spawn([sys.executable, "-m", "phoenixft.coordinator", "--store", addr], coord_log, env=env)
    agents = None
    threads: list[threading.Thread] = []
    old_stack = threading.stack_size(512 * 1024)
    try:
        agents = spawn([sys.executable, str(Path(__file__).resolve()), "--agents", ",".join(nodes), "--store", addr,
                        "--budget", str(budget)], workdir / f"agents-w{w}.log", env=env)
        t_setup = time.monotonic()
        for n in nodes:
            if THREAD_PER_WORKER:
                threads += [threading.Thread(target=_worker, args=(addr, f"{n}.{i}", sh, deadline), daemon=True)
                            for i in range(G)]
            else:
                threads.append(threading.Thread(target=_node, args=(addr, n, sh, deadline), daemon=True))
        for t in threads:
            t.start()
        _until(lambda: sh.read0 == w or bool(sh.errors), deadline, "every worker to read epoch 0", coord, coord_log,
               lambda: f"{sh.read0} of {w} read it; topology 0 published: {store.check([keys.topo(0)])}")
        if sh.errors:
            raise RuntimeError("; ".join(sh.errors[:3]))
        setup_s = time.monotonic() - t_setup
        time.sleep(0.5)  # the coordinator is in its steady loop, every node has heartbeated
        members = [f"{n}.{i}" for n in nodes if n != KILLED for i in range(G)]
        cpu0 = _cpu_s(coord.pid)
        t_kill = time.time()
        sh.killed.set()  # its workers go silent; its agent stops at the exit key
        store.set(keys.node_exit(KILLED), str(t_kill))  # what the launcher does when an agent exits
        store.add("exits", 1)
        _until(lambda: len(sh.read1) == len(members) or bool(sh.errors), deadline,
               "every member to read epoch 1", coord, coord_log,
               lambda: f"{len(sh.posted)} posted, {len(sh.read1)} of {len(members)} read it; run error: "
                       f"{store.get(keys.RUN_ERROR).decode() if store.check([keys.RUN_ERROR]) else None}")
        coord_cpu_s = _cpu_s(coord.pid) - cpu0
        rec = json.loads(store.get(keys.recovery(1)))
        events = [json.loads(x) for x in store.get(keys.EVENTS).decode().splitlines() if x.strip()]
    finally:
        sh.stop.set()
        kill_group(coord)
        kill_group(agents)
        threading.stack_size(old_stack)
        join_by = time.monotonic() + 5.0  # daemons: one still blocked in a wait ends with the store
        for t in threads:
            t.join(timeout=max(0.0, join_by - time.monotonic()))
    ep1 = next(e for e in events if e.get("kind") == "epoch" and e.get("epoch") == 1)
    t_flag = rec["t_start"]
    t_pub = min([ep1["t"], *sh.read1.values()])
    planned = next((e for e in events if e.get("kind") == "recovery_planned" and e.get("epoch") == 1), {})
    read_ok = all(sh.nodes1[m][1] == "s0" and KILLED not in sh.nodes1[m] for m in members)
    return {
        "workers": w, "nodes": n_nodes, "workers_per_node": G, "setup_s": setup_s,
        "detect_s": t_flag - t_kill,
        "woke_s": max(sh.woke.values()) - t_flag,
        "gather_s": max(sh.posted.values()) - t_flag,
        "decide_s": t_pub - t_flag,
        "plan_s": planned.get("decide_s"),
        "publish_s": max(sh.read1.values()) - t_pub,
        "total_s": max(sh.read1.values()) - t_kill,
        "coordinator_cpu_s": coord_cpu_s,
        "descriptors": len(sh.posted), "members_read": len(sh.read1), "members": len(members),
        "promoted": rec["promoted"], "dead": rec["dead"], "action": rec["action"],
        "spare_in_slot": read_ok, "errors": sh.errors[:5],
        "harness": "thread per worker" if THREAD_PER_WORKER else "thread per node (its workers' calls in turn)",
    }


def run(quick: bool, out: Path = RESULTS, sizes: tuple[int, ...] | None = None) -> dict[str, Any]:
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
                r = run_one(w, workdir)
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
          ["W", "nodes", "detect s", "gather s", "decide s", "publish s", "coordinator CPU s", "ok"],
          [[r["workers"], r["nodes"], r["detect_s"], r["gather_s"], r["decide_s"], r["publish_s"],
            r["coordinator_cpu_s"], r["spare_in_slot"] and r["members_read"] == r["members"]] for r in rows])
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"W = {', '.join(map(str, QUICK_SIZES))} only")
    ap.add_argument("--sizes", default="", help="comma-separated W (multiples of 8, at least 24)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--agents", default="", help=argparse.SUPPRESS)  # internal: run these nodes' agents
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--thread-per-worker", action="store_true",
                    help="one harness thread per simulated worker (default: one per node, its workers in turn)")
    a = ap.parse_args()
    global THREAD_PER_WORKER
    THREAD_PER_WORKER = a.thread_per_worker
    if a.agents:
        return agents_main(a.store, a.agents.split(","), a.budget)
    sizes = tuple(int(x) for x in a.sizes.split(",") if x.strip()) or None
    res = run(a.quick, out=Path(a.out), sizes=sizes)
    ok = not res["failed"] and all(r["spare_in_slot"] and r["members_read"] == r["members"] for r in res["runs"])
    return 0 if ok else 1


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: worker threads may still sit in a store call."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    rc = 130
    try:
        rc = main()
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001 - print it, then exit without the teardown
        import traceback

        traceback.print_exc()
        rc = 1
    _exit(rc)
