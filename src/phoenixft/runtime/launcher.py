"""The launcher behind `phoenixft run` (the whole job as local processes) and `phoenixft coordinator`
(the head of a job whose nodes are on other hosts): `run_job` runs a job end to end.

It checks what the mode can do (`check_mode`), then puts three parts together: the job's processes on
this host (`phoenixft.runtime.localjob.LocalJob`: the store, the coordinators, the agents, supervising
them, the run directory), their teardown (`phoenixft.runtime.teardown`, on every exit path) and the
report (`phoenixft.runtime.jobreport`). Ctrl-C, SIGTERM and SIGHUP stop the run (`failed: interrupted`)
with a report and a full teardown, never an orphaned job; the head's `--stop-signal`s, and SIGTERM when the job has a
persistent tier, stop it at a step boundary with its state saved instead (`phoenixft.runtime.stopsignal`).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import remote_spec_problem
from phoenixft.errors import UserError
from phoenixft.observe.display import Display
from phoenixft.runtime import hostcheck, rundir, zygote
from phoenixft.runtime.jobreport import (
    FINAL_WAIT_S,
    INTERRUPTED,
    final_report,
    interrupted_report,
    signals_held,
    write_report,
)
from phoenixft.runtime.localjob import LocalJob
from phoenixft.runtime.stopsignal import StopOnSignal, term_stops
from phoenixft.runtime.teardown import STOP_GRACE_S

__all__ = ["LocalJob", "run_job", "check_mode", "check_local_size", "STOP_GRACE_S", "INTERRUPTED"]

AGENT_FLOOR_MIB = 25  # what an agent process costs at least (its own pages; forked from the zygote: measured 27)
SCRIPT_EXIT_S = 120.0  # how long a script's workers may run its lines after the loop before the teardown
WORKER_FLOOR_MIB = 100  # what a worker process costs at least before its model's state (`tiny`: measured 120)


def _mem_total_mib() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    except (OSError, ValueError, AttributeError):  # (a platform without these names)
        return None


def check_local_size(cfg: RunConfig) -> None:
    """UserError when a local run's processes cannot fit this machine's memory even before their models:
    `phoenixft run --nodes 100000` passed every check and started forking agents until the kernel's OOM
    killer stepped in (taking whatever else it chose with it)."""
    total = _mem_total_mib()
    nodes = cfg.nodes + cfg.spares
    need = nodes * (AGENT_FLOOR_MIB + cfg.workers_per_node * WORKER_FLOOR_MIB)
    if total is not None and need > total:
        raise UserError(
            f"--nodes={cfg.nodes} is invalid here: {nodes:,} local node(s) (--nodes + --spares) x "
            f"{cfg.workers_per_node} worker(s) need at least {need / 1024:,.1f} GiB for their processes alone "
            f"(about {WORKER_FLOOR_MIB} MiB per worker and {AGENT_FLOOR_MIB} MiB per agent before any model state), "
            f"and this machine has {total / 1024:,.1f} GiB: run fewer nodes here, or spread them over hosts "
            "(`phoenixft coordinator` + `phoenixft agent`); `phoenixft run --dry-run` sizes a layout without "
            "starting it")


def check_mode(cfg: RunConfig, local: bool) -> None:
    """UserError for what the mode cannot do: partitions need separate hosts; the head can neither
    start nor kill agents, nor signal a coordinator from another host; a local run must fit this machine."""
    if local:
        check_local_size(cfg)
        hostcheck.check_host(cfg, hostcheck.local_nodes(cfg), "this host")  # every node runs here
    for f in cfg.faults:
        why = f.kind_of.refuse(f, local)
        if why:
            raise UserError(f"--inject={f.text!r} is invalid here: {why}")
    problem = None if local else remote_spec_problem(cfg.control_plane)
    if problem:
        raise UserError(problem)
    if not local:
        for flag, v in (("--repair-after", cfg.repair_after), ("--spare-arrives-at-step", cfg.spare_arrives_at_step)):
            if v:
                raise UserError(f"{flag}={v:g} is invalid here: the coordinator starts no agents; start a spare on "
                                "any host with `phoenixft agent --coordinator HOST:PORT --node NAME --spare`")


def _run(job: LocalJob, cfg: RunConfig) -> str:
    """Start the job and watch it to its end: the run state (a `done` whose final record is not signed with
    the run key is a failure)."""
    if job.local and zygote.enabled():  # its `import torch` overlaps the job's start-up; only once the checks
        zygote.Zygote.shared()          # above have passed (a run refused for its flags or run dir starts none)
    job.start()
    state = job.monitor()
    if state == "done":
        job.await_final(FINAL_WAIT_S)
        if cfg.script and job.local:
            job.await_scripts(SCRIPT_EXIT_S)
        if job.final is None:  # "done" signed, its record not: overwritten since by a party without the key
            state = ("failed: the run's final state in the store is not signed with this run's key "
                     "(something other than this job overwrote it)")
    return state


def run_job(cfg: RunConfig, display: Display | None = None, *, host: str = "127.0.0.1", port: int = 0,
            token: str | None = None, local: bool = True, stop_signals: list[int] | None = None) -> dict[str, Any]:
    """Run a job end to end; returns the report (also written to the run dir and --report).

    `local`: start every agent here (`phoenixft run`); else be the head that agents on other hosts
    join at host:port (`phoenixft coordinator`). `token`: the job token (None: generate one). `stop_signals`:
    signals that stop the job with its state saved (runtime/stopsignal.py; needs a persistent tier)."""
    check_mode(cfg, local)
    if stop_signals and not cfg.persist_every:
        raise UserError("--stop-signal saves the job's state to the persistent tier when it stops: give "
                        "--persist-every K and --persist-dir DIR (storage every host mounts)")
    job = LocalJob(cfg, display, host=host, port=port, token=token, local=local)
    try:
        state = "failed: did not start"
        report: dict[str, Any] = {}
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler, `kill`) must tear the job down like Ctrl-C does, never orphan it
            # and so must SIGHUP (the terminal closed)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
            signals = term_stops(cfg.persist_every, stop_signals or [])  # (SIGTERM too, with a persistent tier)
            if signals:  # (after SIGTERM's: a stop signal's handler replaces it)
                job.stop_notice = StopOnSignal(signals)
                job.stop_notice.install()
        try:
            state = _run(job, cfg)
            report = final_report(job, cfg, state)
        except KeyboardInterrupt:
            state = INTERRUPTED
            report = interrupted_report(job, cfg, state)
        finally:
            if job.live is not None:  # (the final goodput exported, before the endpoint stops)
                job.live.close(report)
            with signals_held():  # a second Ctrl-C / SIGHUP must not cut the teardown short
                job.teardown()
        report = write_report(job, cfg, state, report)
    finally:
        rundir.release(job.dir_lock)  # (the report is written: the directory is free for the next run)
    job.display.done(report)
    return report
