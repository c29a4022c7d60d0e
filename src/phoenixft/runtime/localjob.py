"""A job's processes on this host: `LocalJob`, behind `phoenixft run` (the whole job as local processes)
and `phoenixft coordinator` (the head of a job whose nodes are on other hosts).

It serves the control-plane store on the address given (127.0.0.1 for `run`; `--host/--port` for the
head) or, with `--control-plane` naming a replicated cluster, uses that cluster (starting a local
one when asked: `controlplane.provision_cluster`) under the job's own prefix, which it deletes at
the end; it starts `--coordinators` coordinator processes (restarting any that dies: it reloads its
journal, or stands by), publishes the config and the run id, and gives both the job token through
the environment (never the command line, the store, the run directory or a log). A local job
then starts one agent per node and per spare node (each in its own session, so a node is one process
group; `agent_args` are added to every agent's command line, e.g. the entry point its workers run) and
watches them (`monitor`): agent exits are reported to the control plane at once, fence requests are
carried out (SIGKILL to the node's process group). The head starts no agent: agents on other hosts
join it (`phoenixft agent --coordinator HOST:PORT`), failures are found by their heartbeats, a fence
is only logical (the fenced host's own processes obey it), and the final model stays with rank 0's
host (no shared filesystem is assumed). Both show progress and events; the run directory is theirs
(config, logs, the token file, `coordinator.port`); the end (`phoenixft.runtime.teardown`) is idempotent.

The processes it starts are forked from a warm zygote (`phoenixft.runtime.zygote`: one `import torch` per
launching process instead of one per coordinator and agent), each set up as a fresh `python -m`
would be (own session, log, environment, command line); `PHOENIXFT_ZYGOTE=0`, or a zygote that
fails, starts them fresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.config.training import model_label
from phoenixft.controlplane import (
    LogReader,
    ProvisionedCluster,
    Store,
    StoreUnavailable,
    auth,
    describe,
    exists_many,
    get_nowait,
    keys,
    provision_cluster,
    sealed,
)
from phoenixft.controlplane.keeper import Keeper
from phoenixft.controlplane.signed import final_record, run_ended, sign
from phoenixft.controlplane.values import note_bad, parse_int
from phoenixft.distributed.cuda_env import PLACEMENT_ENV
from phoenixft.errors import UserError, user_traceback
from phoenixft.health.history import HOST_ID_ENV, quarantined_hosts
from phoenixft.observe.display import Display
from phoenixft.observe.live import LiveMetrics
from phoenixft.protect import shm
from phoenixft.runtime import hostcheck, rundir, zygote
from phoenixft.runtime.jobfaults import LauncherFaults
from phoenixft.runtime.repair import RepairQueue
from phoenixft.runtime.teardown import JobTeardown

__all__ = ["LocalJob", "Proc", "AGENT_MODULE", "CONTROL_PLANE_TIMEOUT_S", "timeout_state"]

PARENT = "{parent}"  # in a spawned command line: the PID of the process it must not outlive
Proc = subprocess.Popen[bytes] | zygote.Child  # a process this launcher started
AGENT_MODULE = "phoenixft.runtime.agent"  # what a local job's node runs (`python -m`)
CONTROL_PLANE_TIMEOUT_S = 15.0  # a cluster: no answer for this long and the run is failed (agents' default too)
ALL_GONE_GRACE_S = 5.0  # every node exited, no run state yet: how long the coordinator gets to decide (and record why)
# a coordinator exits 0 only once it verified the run's end: how long this launcher looks for that end itself before
# it takes the exit for a crash (whoever reaches the store can overwrite `run/state` until its writer puts it back)
COORD_END_GRACE_S = 5.0


def timeout_state(limit: float) -> str:
    """The state of a run stopped by its --timeout: the flag and its value named (0.5 is not "0s")."""
    return (f"failed: timeout after {limit:g}s (--timeout {limit:g}, the run's wall-clock limit: raise it, or leave "
            "--timeout out for none)")


def _publish(path: Path, text: str) -> None:
    """Write a run-directory file that other processes poll for (`phoenixft status`, `drain`, scripts): whole
    or absent, never seen empty (written beside it and renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class LocalJob(JobTeardown):
    """One job's store, coordinators and (local) agents on this host, from its start to its teardown."""

    def __init__(self, cfg: RunConfig, display: Display | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, local: bool = True, agent_args: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.agent_args = list(agent_args)  # added to every agent's command line (e.g. what its workers run)
        self.local = local  # False: the head of a multi-host job (agents join from other hosts)
        self.host, self.port = host, port
        self.token = token or auth.generate_token()
        from phoenixft.controlplane.tls import TlsFiles

        self.tls = TlsFiles.given(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)  # (checked again: files may have changed)
        self._gateway: Any = None  # with TLS: the relay agents reach the loopback-only store through
        self._front: Any = None  # the store's front (controlplane.front), while the store is served
        self.public_addr = ""  # where agents join: the store, or with TLS its gateway
        self.token_generated = token is None
        self.run_id = uuid.uuid4().hex[:10]
        sealed.bind(self.token, self.run_id)  # what this process writes to the store and acts on is sealed
        self.keeper: Keeper = None  # type: ignore[assignment]  # what this launcher wrote once and keeps (start())
        self.t_launch = time.time()  # the start of the run's goodput window
        self.run_dir = Path(cfg.run_dir or Path("runs") / time.strftime(f"%Y%m%d-%H%M%S-{self.run_id}"))
        self.dir_lock = rundir.claim(self.run_dir)  # held until the report is written (another launcher: refused)
        try:
            replaced = rundir.prepare(self.run_dir)  # a previous run's files there are removed (a live run's: refused)
        except BaseException:
            rundir.release(self.dir_lock, self.run_dir)  # (refused there: leave nothing of this run behind)
            raise
        self.display = display or Display(quiet=cfg.quiet, json_events=cfg.json_events, steps=cfg.steps)
        if replaced:
            self.display.info(replaced)
        self.display.joins = not local
        self.coords: dict[int, Proc] = {}  # --coordinators: one leads, the others stand by
        self.cluster: ProvisionedCluster | None = None  # a replicated control plane (and the one it started)
        self.faults = LauncherFaults(cfg)  # the --inject faults the launcher fires itself
        self.hosts: dict[str, str] = {}  # node -> the (simulated) host its agent runs on
        self._quarantine_shown: set[str] = set()  # quarantined hosts that came back repaired once (and were refused)
        self._log: Any = None
        self._events_macs: set[bytes] = set()  # the event lines read so far (a copied line is read once)
        self.agents: dict[str, Proc] = {}
        self._zygote_error: str | None = None
        self.exited: set[str] = set()
        self.fenced: set[str] = set()
        self.store: Store = None  # type: ignore[assignment]  # connected by start()
        self.addr = ""
        self._torn_down = False
        self._server: Any = None
        self._coord_pids: list[int] = []
        self.coord_restarts = 0
        self.final: dict[str, Any] | None = None  # the final-state record, once one signed with the run key is seen
        self._exits_told = 0  # node exits told to the coordinator (the `exits` counter, written by this launcher only)
        self._coord_exits: list[float] = []  # when the coordinator exited: a crash loop is 5 within a minute
        self._coord_ended: dict[int, float] = {}  # a coordinator that exited 0 -> when this launcher saw it
        self._reapers: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self.leaks: dict[str, list[Any]] = {"killed": [], "removed_segments": []}
        self.stopped_starting: list[str] = []  # agents stopped before they reached the control plane
        self.stop_notice: Any = None  # the head's stop signals (runtime/stopsignal.py), if it was given any
        self._owner = False
        self.events_seen: list[str] = []  # the events read so far (what is written if the store is lost)
        self.control_plane_lost: str | None = None  # why the store no longer answers, once it has not for too long
        self.handed_over: str | None = None  # the coordinator (not ours) leading the job this one lost
        self._unreported: list[str] = []  # agent exits not yet told to the control plane
        self.last_step_shown = 0
        self.live: LiveMetrics | None = None  # metrics.jsonl, the live goodput and the exports, once started
        # --repair-after: a lost node comes back as a fresh spare (ids past the configured ones)
        self.repair = RepairQueue(cfg.repair_after, cfg.spares + (1 if cfg.spare_arrives_at_step else 0))

    # ------------------------------------------------------------------ processes
    def _spawn(self, args: list[str], log: str, env: dict[str, str] | None = None) -> Proc:
        """Start `python -m args...` in its own session, logging to logs/`log`: forked from the warm
        zygote (phoenixft.runtime.zygote), or fresh if that is off or failed. PARENT in `args` is replaced by
        this process's PID: it follows the launcher, whether its parent is the launcher or the zygote
        (procs.die_with_parent), so a zygote that dies takes nothing with it."""
        path = self.run_dir / "logs" / log
        extra = {"PYTHONUNBUFFERED": "1", auth.TOKEN_ENV: self.token, **(self.tls.env() if self.tls else {}),
                 **(env or {})}
        if self.local and not os.environ.get(PLACEMENT_ENV):  # every node on this host: spread over its GPUs
            extra[PLACEMENT_ENV] = "spread"

        argv = [str(os.getpid()) if a == PARENT else a for a in args]
        if zygote.enabled() and self._zygote_error is None:
            preload = zygote.SCRIPT_PRELOAD if self.cfg.script and "phoenixft.runtime.agent" in argv else ()
            try:
                return zygote.Zygote.shared().spawn(argv, path, extra, preload)
            except zygote.ZygoteError as e:
                self._zygote_error = str(e)
                self.display.info(f"starting processes fresh: the warm zygote failed ({e})")
        out = open(path, "ab")
        return subprocess.Popen([sys.executable, "-m", *argv], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ, **extra))

    def _threads(self) -> int:
        if self.cfg.threads:
            return self.cfg.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.cfg.world))

    def start(self) -> None:
        from phoenixft.controlplane import connect

        if self.local:
            swept = shm.sweep(exclude=(self.run_id,))
            if swept.segments:
                self.display.info(f"removed {swept.segments} orphaned shared-memory segment(s), "
                                  f"{swept.bytes / 2**20:.1f} MiB, of dead run(s) {', '.join(swept.runs)}")
            shm.register_owner(self.run_id, "launcher")
            self._owner = True
            for line in hostcheck.local_notes(self.cfg, os.environ):
                self.display.info(line)
        from phoenixft.workload import WorkloadContext, load_workload

        wl = load_workload(self.cfg.workload, WorkloadContext.from_config(self.cfg))
        if wl.prepare is not None and self.local:
            try:
                wl.prepare()  # e.g. build the corpus cache once, before the workers map it
            except Exception as e:  # noqa: BLE001 - user code: one line, with its own traceback above it
                where, trace = user_traceback(e)
                raise UserError(f"--workload={self.cfg.workload!r}: its prepare() failed: {type(e).__name__}: "
                                f"{e} (at {where})", detail=trace) from None
        self.display.tokens_per_step = wl.tokens_per_microbatch * self.cfg.total_microbatches
        if self.cfg.control_plane == "tcpstore":
            # The store is served from this process (its server thread needs no GIL), so that the
            # coordinator's logic can crash and be restarted without taking the store with it. It
            # listens on the address given only (see store_server).
            self._serve()
        else:
            self.cluster = provision_cluster(self.cfg.control_plane, self.run_id, str(self.run_dir / "logs"),
                                             self.display.info, tls=self.tls, token=self.token)
            self.addr = self.public_addr = self.cluster.addr
            _publish(self.run_dir / "control_plane", self.addr)
        # on a replicated store a call that no member answers fails after CONTROL_PLANE_TIMEOUT_S (the monitor
        # then fails the run)
        self.store = connect(self.addr, CONTROL_PLANE_TIMEOUT_S if describe(self.addr).replicated else 30.0, self.tls,
                             self.token)
        self._log = LogReader(self.store, keys.EVENTS)
        self.live = LiveMetrics(self.cfg, self.run_dir, self.host, self.t_launch, self.display.info, token=self.token)
        if self.live.prom is not None:
            self.display.info(f"Prometheus metrics at http://{self.cfg.metrics_host}:{self.live.prom.port}/metrics")
        raw_cfg = self.cfg.to_json()  # its signature first: whoever sees the config can check a token on it
        kept = {keys.CONFIG_SIG: sign(self.token, self.run_id, keys.CONFIG, raw_cfg).encode(),
                keys.CONFIG: raw_cfg.encode(), keys.RUN_ID: self.run_id.encode()}
        if self.local:  # rank 0 writes the final model there: only where it shares this filesystem
            kept[keys.RUN_DIR] = sealed.seal(keys.RUN_DIR, str(self.run_dir.resolve()))
        # what this launcher wrote once and others read when they start (a restarted coordinator or worker, a
        # spare): put back, at most once a second, where something else overwrote or deleted it
        self.keeper = Keeper(self.store)
        self.keeper.put_many_raw(list(kept), list(kept.values()))
        for i in range(self.cfg.coordinators):
            self._start_coordinator(i)
        (self.run_dir / "config.json").write_text(json.dumps(json.loads(self.cfg.to_json()), indent=2))
        if self.token_generated:  # for agents started by hand (--token-file); readable by this user only
            auth.write_token_file(self.run_dir / rundir.TOKEN_FILE, self.token)
        if self.local:
            nodes = [f"n{i}" for i in range(self.cfg.nodes)] + [f"s{i}" for i in range(self.cfg.spares)]
            for n in nodes:
                self._start_agent(n)
            self.display.info(f"run {self.run_id}: {self.cfg.nodes} node(s) x {self.cfg.workers_per_node} worker(s), "
                              f"{self.cfg.spares} spare(s), {model_label(self.cfg.to_dict())}, "
                              f"protect={self.cfg.protect}, store {self.addr}"
                              f"{' (agents through TLS at ' + self.public_addr + ')' if self._gateway else ''}, "
                              f"dir {self.run_dir}")
            return
        self.display.info(f"phoenixft coordinator: run {self.run_id} serving at {self.public_addr}"
                          f"{' (TLS, store on ' + self.addr + ')' if self._gateway else ''}, dir {self.run_dir}; "
                          f"waiting for {self.cfg.nodes} node(s) x {self.cfg.workers_per_node} worker(s) to join "
                          f"(--join-timeout {self.cfg.join_timeout:g}s), spares welcome")
        if self.token_generated:  # (never printed: a batch log is read by more people than the job's owner)
            self.display.info(f"job token (generated): in {self.run_dir / rundir.TOKEN_FILE} (mode 0600); give it "
                              f"to every agent with --token-file (or as ${auth.TOKEN_ENV})")
        tls = " --tls-cert CERT --tls-key KEY --tls-ca CA" if self.tls else ""
        self.display.info(f"join with: phoenixft agent --coordinator {self.public_addr} --node NAME "
                          f"--workers {self.cfg.workers_per_node} [--spare]{tls}")

    def _serve(self) -> None:
        """Serve the store from this process (its server thread needs no GIL), so that the coordinator's
        logic can crash and be restarted without taking the store with it, behind its front (controlplane.front):
        the store's own socket in a network namespace of its own, this host's processes of this user at the
        front's loopback port, other hosts' agents at the address given (with TLS: certificates of the job CA
        only; without, a plain TCP port, said in one line)."""
        from phoenixft.controlplane.front import is_loopback, serve_job_store
        from phoenixft.controlplane.storewire import Limits

        limits = Limits(max_bytes=self.cfg.store_max_mb << 20, max_keys=self.cfg.store_max_keys)
        self._front = serve_job_store(self.host, self.port, self.tls.env() if self.tls else None, limits)
        self._server = self._front.server
        self.addr, self.public_addr = self._front.local_addr, self._front.public_addr
        self._gateway = self._front.relay if self.tls is not None else None
        if self._front.shared:
            self.display.info(f"!! the store is reachable by every user of this host: {self._front.shared}")
        if not self.local and self.tls is None and not is_loopback(self.host):
            self.display.info(f"!! --host={self.host} serves the store without TLS: anyone who reaches "
                              f"{self.public_addr} can read and write it (give --tls-cert, --tls-key and --tls-ca; "
                              "`phoenixft certs DIR` makes them)")
        _publish(self.run_dir / "coordinator.port", self.addr.rsplit(":", 1)[1])

    def _start_agent(self, node: str, host: str = "") -> None:
        """Start node's agent; `host`: the simulated host it runs on (a repaired node's: the host it was lost
        on), by default a host of its own, named after the node (the failure history is kept per host)."""
        self.hosts[node] = host or f"{socket.gethostname()}/{node}"
        self.agents[node] = self._spawn(self.agent_command(node), f"{node}.log", {HOST_ID_ENV: self.hosts[node]})

    def agent_command(self, node: str) -> list[str]:
        """The command line (after `python -m`) of node's agent: this job's store, TLS files, node id, workers
        and threads, run id and parent, then `agent_args`."""
        return [AGENT_MODULE, "--store", self.public_addr, *(self.tls.args() if self.tls else []), "--node", node,
                "--workers", str(self.cfg.workers_per_node), "--threads", str(self._threads()),
                "--run-id", self.run_id, "--parent-pid", PARENT, *self.agent_args]

    def _start_coordinator(self, i: int = 0) -> None:
        # it dies with the launcher (which serves the store it needs); --run-id makes it findable
        journal = ["--journal", rundir.journal_path(self.run_dir)] if self.cfg.control_plane == "tcpstore" \
            else []  # on a cluster the journal is in the store (a standby on another host reads it)
        p = self._spawn(["phoenixft.runtime.procs", "--parent", PARENT, "--signal",
                         str(int(signal.SIGKILL)), "phoenixft.coordinator", "--store", self.addr,
                         *journal, "--run-id", self.run_id],
                        "coordinator.log" if i == 0 else f"coordinator{i}.log")
        self.coords[i] = p
        self._coord_pids.append(p.pid)

    # ------------------------------------------------------------------ monitoring
    def node_log(self, node: str) -> str:
        """Where node's agent and workers write: this run directory's logs/ for a local run, else their host."""
        if self.local:
            return str(self.run_dir / "logs" / f"{node}.log")
        return f"the log of node {node}'s agent on its host"

    def _poll_events(self) -> None:
        got = sealed.lines(keys.EVENTS, self._log.read_bytes(), self._events_macs)
        if got and self.store.consumes_logs:  # (taken from the queue: kept under `events`, for status and drain)
            self.store.append(keys.EVENTS, b"".join(line + b"\n" for line, _ in got))
        for _, ev in got:
            self.events_seen.append(json.dumps(ev))
            self._keep_fault(ev)
            if ev.get("kind") == "run_failed" and ev.get("traceback") and ev.get("node"):
                ev["log"] = self.node_log(str(ev["node"]))  # (where the traceback is: said with the error)
            if self.live is not None:
                self.live.event(ev)
            try:
                self.display.event(ev)
            except (KeyError, TypeError, ValueError, AttributeError):
                note_bad(keys.EVENTS, "an event this launcher cannot show", json.dumps(ev))
        if self.live is not None:  # (the exported goodput moves on while no step completes: a recovery)
            self.live.live_goodput()

    def _keep_fault(self, ev: dict[str, Any]) -> None:
        """A fault fires once a run, on the nodes of its first firing (faults/inject.py keeps both in the store):
        once its event is in, this launcher keeps them there too, so that a step replayed after the recovery it
        caused finds them whatever overwrote them since (its firing worker is gone, by design)."""
        i = ev.get("index")
        if ev.get("kind") != "fault" or type(i) is not int or not 0 <= i < len(self.cfg.faults):
            return
        self.keeper.put(keys.fault_fired(i), "1")
        if isinstance(ev.get("nodes"), list):
            self.keeper.put(keys.fault_targets(i), json.dumps(ev["nodes"]))

    def events(self) -> list[dict[str, Any]]:
        """The run's events as this launcher read them as the run went (each once, in order)."""
        return [json.loads(x) for x in self.events_seen]

    def seen(self) -> dict[str, Any]:
        """What this launcher read as the run went that the report needs: the progress, the recoveries, the step
        records (those deleted from the store are only in its metrics.jsonl)."""
        if self.live is None:
            return {"progress": self.last_step_shown, "recoveries": []}
        return {"progress": self.last_step_shown, "recoveries": self.live.recoveries, "steps": self.live.history(),
                "steps_from": self.live.pruned + 1}

    def _tell_exits(self) -> None:
        """Tell the coordinator of the nodes that exited: `exit/<node>`, then the `exits` counter."""
        while self._unreported:  # (told once the store answers, if it did not at first)
            self.keeper.put(keys.node_exit(self._unreported[0]), str(time.time()))
            self._exits_told += 1
            sealed.hint(self.store, keys.EXITS)  # (a hint, never an `add`: see controlplane.sealed)
            self._unreported.pop(0)

    def _look_final(self) -> None:
        """Keep the first final-state record signed with the run key (kept: a stranger that overwrites
        the key afterwards cannot take the run's true final state away)."""
        if self.final is None and self.store.check([keys.FINAL]):
            self.final = final_record(self.store, self.token, self.run_id)  # (signed, and by rank 0's node)
            if self.final is not None:  # (rank 0 writes it again until it is seen: a stranger's overwrite is raced)
                sealed.put(self.store, keys.FINAL_SEEN, "1")

    def await_final(self, timeout_s: float) -> None:
        """The signed final-state record, looked for every 20 ms for at most `timeout_s` (the run state said
        done: rank 0 writes both again until this launcher has the record)."""
        deadline = time.monotonic() + timeout_s
        self._look_final()
        while self.final is None and time.monotonic() < deadline:
            time.sleep(0.02)
            self._look_final()

    def _last_steps(self) -> None:
        """The step records not yet read when the run ended (to its exports; the report writes metrics.jsonl)."""
        if self.live is not None:
            with contextlib.suppress(Exception):  # (an export that fails must not cost the report)
                self.live.advance(self.store, parse_int(sealed.get(self.store, keys.PROGRESS), keys.PROGRESS, 0))

    def _show_progress(self, rec: dict[str, Any]) -> None:
        if self.cfg.script and self.display.steps == self.cfg.steps:  # (a script's loop says how many it runs)
            total = parse_int(sealed.get(self.store, keys.SCRIPT_TOTAL_STEPS), keys.SCRIPT_TOTAL_STEPS, 0)
            if total > 0:
                self.display.steps = total
        try:
            if self.live is not None:  # (every step record up to this one, in order: metrics.jsonl, the exports)
                self.live.advance(self.store, int(rec["step"]))
                self.live.prune(self.store)  # (records in metrics.jsonl past the store's window: deleted)
                self.display.goodput = self.live.live_goodput()
            self.display.progress(rec)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            note_bad("step/<n>", "a step record this launcher cannot show", json.dumps(rec))

    def _look(self) -> None:
        """The launcher's look at the store: new events, the run's end, the keeper's puts, a stop signal's request."""
        self._poll_events()
        self._look_final()
        self.keeper.tick()
        if self.stop_notice is not None:  # a stop signal received: ask the coordinator to stop the job
            self.stop_notice.tick(self.store, self.display.info)

    def monitor(self) -> str:
        deadline = time.monotonic() + self.cfg.timeout if self.cfg.timeout > 0 else float("inf")
        last_progress = -1
        # Local processes are looked at every 10 ms; the store every 50 ms, where reads are costly every
        # 250 ms (every read costs CPU on the machines that train; its fences and the run state in one request)
        store_every = 0.25 if self.store.costly_reads else 0.05
        last_look = 0.0
        over = False
        last_ok = time.monotonic()  # when the store last answered every call of a look
        all_gone: float | None = None  # when the launcher saw every node exited (local runs)
        ended: str | None = None  # the run state, once one signed with the run key is in the store
        while True:
            try:
                look = time.monotonic() - last_look >= store_every
                fenced_now: set[str] = set()
                if look:
                    last_look = time.monotonic()
                    unfenced = [n for n in self.agents if n not in self.fenced]
                    *fences, over = exists_many(self.store, [keys.fence(n) for n in unfenced] + [keys.RUN_STATE])
                    if any(fences):  # (a fence not sealed with the run key is ignored, logged)
                        fences = sealed.present(self.store, [keys.fence(n) for n in unfenced], fences)
                    fenced_now = {n for n, f in zip(unfenced, fences, strict=True) if f}
                    ended = run_ended(self.store, self.run_id, self.token) if over else None
                    over = ended is not None  # (a run state not signed with the run key is ignored, logged)
                for n, p in self.agents.items():  # (the head has none: remote agents are judged by heartbeats)
                    if n not in self.exited and p.poll() is not None:
                        self.exited.add(n)
                        self._unreported.append(n)
                        self._reap_async(n)
                        self.repair.lost(n)
                    if n in fenced_now:
                        self.fenced.add(n)
                        if self.cfg.fence_kill:  # besides the logical fence that the node's processes obey
                            self._kill_group(n)
                        self.repair.lost(n)
                self._tell_exits()
                if self.local:
                    self._start_repaired()
                crash_loop = self._restart_coordinators(over)
                if crash_loop is not None:
                    return crash_loop
                raw_prog = sealed.get(self.store, keys.PROGRESS) if look else None
                prog = parse_int(raw_prog, keys.PROGRESS, -1) if raw_prog is not None else -1
                if prog >= 0:
                    self.faults.fire_due(self.store, self.cluster, prog)
                    late = self.cfg.spare_arrives_at_step
                    if late and prog >= late and f"s{self.cfg.spares}" not in self.agents:
                        self._start_agent(f"s{self.cfg.spares}")
                    if prog != last_progress and self.store.check([keys.step(prog)]):
                        last_progress = self.last_step_shown = prog
                        rec = sealed.get_json(self.store, keys.step(prog))
                        if rec is not None:
                            self._show_progress(rec)
                if look:
                    self._look()
                if over and ended is not None:
                    return ended
                if time.monotonic() > deadline:
                    return timeout_state(self.cfg.timeout)
                if self.local and all(n in self.exited for n in self.agents):
                    ended = run_ended(self.store, self.run_id, self.token) if self.store.check([keys.RUN_STATE]) \
                        else None
                    if ended is not None:  # the run ended, then its nodes: looked at since `over`
                        return ended
                    # the last node was lost by a fault: the coordinator's recovery (told of the exits above)
                    # fails the run saying why, and the report lists that recovery; unless it does not answer
                    all_gone = all_gone or time.monotonic()
                    if time.monotonic() - all_gone > ALL_GONE_GRACE_S:
                        return "failed: every node exited"
                time.sleep(0.01)
                if look:
                    last_ok = time.monotonic()
            except (StoreUnavailable, TimeoutError, ConnectionError) as e:
                if not self.store.replicated:
                    raise
                # every call retries over the members until its deadline: this one found none for that long
                if time.monotonic() - last_ok >= CONTROL_PLANE_TIMEOUT_S:
                    why = str(e).splitlines()[0] if str(e) else type(e).__name__
                    why = why.rsplit("(last: ", 1)[-1].rstrip(")") if "(last: " in why else why
                    self.control_plane_lost = (f"{describe(self.addr).name} at {self.addr} did not answer for "
                                               f"{time.monotonic() - last_ok:.0f}s (last: {why[:200]})")
                    return f"failed: control plane lost: {self.control_plane_lost}"
                time.sleep(0.25)

    def _restart_coordinators(self, over: bool) -> str | None:
        """Restart each coordinator that exited while the run goes on (it reloads its journal; a standby takes
        over meanwhile); the run's failure if they keep exiting."""
        for i, cp in list(self.coords.items()):
            if cp.poll() is None or over or run_ended(self.store, self.run_id, self.token) is not None:
                continue
            now_m = time.monotonic()
            if cp.returncode == 0 and now_m - self._coord_ended.setdefault(i, now_m) < COORD_END_GRACE_S:
                continue  # (it saw the run end: this launcher will too, once the state is put back)
            self._coord_ended.pop(i, None)
            self._coord_exits = [t for t in self._coord_exits if now_m - t < 60.0] + [now_m]
            if len(self._coord_exits) > 5 * self.cfg.coordinators:
                return "failed: the coordinator keeps exiting (6 times within a minute)"
            self.coord_restarts += 1
            gone = sealed.seal(keys.COORDINATOR_PID, "")
            self.store.compare_set(keys.COORDINATOR_PID, sealed.seal(keys.COORDINATOR_PID, str(cp.pid)), gone)
            if get_nowait(self.store, keys.COORDINATOR_PID) == gone:
                self.store.delete_key(keys.COORDINATOR_PID)
            t = time.time()
            self._start_coordinator(i)
            sealed.append(self.store, keys.EVENTS, {"t": t, "kind": "coordinator_exited", "by": "launcher",
                                                    "code": cp.returncode, "pid": cp.pid,
                                                    "standbys": self.cfg.coordinators - 1})
        return None

    def _start_repaired(self) -> None:
        """--repair-after: start the spares whose repair is due; the coordinator admits them."""
        for spare, lost in self.repair.due(self.agents):
            host = self.hosts.get(lost, "")
            if host and host in quarantined_hosts(self.store, self.cfg.quarantine_after, self.cfg.quarantine_window):
                if host in self._quarantine_shown:
                    continue  # it came back once and was refused: it is not repaired again
                self._quarantine_shown.add(host)
            self._start_agent(spare, host)
            sealed.append(self.store, keys.EVENTS, {"t": time.time(), "kind": "spare_repaired", "by": "launcher",
                                                    "node": spare, "replaces": lost})

    def await_scripts(self, timeout_s: float) -> None:
        """A script's run ended: its workers run the script's lines after the loop (a save, an evaluation) and
        exit on their own; the local agents leave with them. Waits for that, at most `timeout_s` (the teardown
        then ends whatever is left)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.agents.values()):
            time.sleep(0.05)

    def pids(self) -> list[int]:
        return [p.pid for p in self.agents.values()] + [p.pid for p in self.coords.values()]
