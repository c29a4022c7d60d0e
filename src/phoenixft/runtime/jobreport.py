"""The end of a run as the launcher writes it: the report (read from the store, or what the launcher saw
itself when the control plane was lost or the run was interrupted), report.json and `--report`, and
the end message.

Every path out of a run writes a report: a normal end (`final_report`: built by
`phoenixft.observe.report.build_report` from the store), Ctrl-C / SIGTERM / SIGHUP (`interrupted_report`:
what the run did up to then), a control plane that stopped answering (`lost_report`: only what the
launcher had seen)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phoenixft.controlplane import keys, sealed
from phoenixft.observe.report import build_report

if TYPE_CHECKING:
    from phoenixft.config import RunConfig
    from phoenixft.runtime.localjob import LocalJob

__all__ = ["INTERRUPTED", "FINAL_WAIT_S", "signals_held", "final_report", "interrupted_report", "lost_report",
           "write_report", "resume_point", "resume_line"]

INTERRUPTED = "failed: interrupted"  # the state of a run stopped by Ctrl-C, SIGTERM or SIGHUP
FINAL_WAIT_S = 12.0  # the run state said done: how long to look for the signed final-state record
LOST_TEARDOWN_CALL_S = 2.0  # a replicated store lost: each teardown call gets this long (if it is back: cleaned)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP for the duration (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def final_report(job: LocalJob, cfg: RunConfig, state: str) -> dict[str, Any]:
    """The report of a run that ended by itself (`state`, as `LocalJob.monitor` returned it)."""
    if job.control_plane_lost is not None:
        return lost_report(job, cfg, state)
    job._poll_events()
    job._last_steps()
    report = build_report(job.store, cfg, state, job.run_dir, job.run_id, final=job.final, t_launch=job.t_launch,
                          token=job.token, events=job.events(), seen=job.seen())
    if report.get("error_node"):
        report["error_log"] = job.node_log(str(report["error_node"]))
    # the control-plane store as the run left it (its teardown then removes the job's keys): how many keys, and
    # the first step whose record it may still hold (older ones are only in metrics.jsonl)
    report["store"] = {"keys": job.store.num_keys(),
                       "step_records_from": job.live.pruned + 1 if job.live is not None else None,
                       "step_records_kept": cfg.store_step_records}
    if job.store.check([keys.MEMBERS]):
        report["members"] = sealed.get_json(job.store, keys.MEMBERS, {})
    stop = next((ev for ev in reversed(job.events()) if ev.get("kind") == "run_stopped"), None)
    if stop is not None:  # a stop of the whole job (coordinator/stop.py): the step it stopped after, saved or not
        report["stopped"] = {k: stop.get(k) for k in ("step", "saved", "reason", "source", "notice_to_stopped_s",
                                                      "why") if k in stop}
    return report


def interrupted_report(job: LocalJob, cfg: RunConfig, state: str) -> dict[str, Any]:
    """The report of a run stopped by Ctrl-C, SIGTERM or SIGHUP: what it did up to then (steps, faults,
    recoveries, events.jsonl and metrics.jsonl), read from the store, which is still served until the
    teardown that follows; just the state if the run had not started or the store no longer answers."""
    base = {"config": json.loads(cfg.to_json()), "state": state, "run_id": job.run_id, "run_dir": str(job.run_dir)}
    if job.store is None:
        return base
    try:
        with signals_held():  # a second signal must not cut this short either
            job._poll_events()
            job._last_steps()
            return build_report(job.store, cfg, state, job.run_dir, job.run_id, final=job.final, t_launch=job.t_launch,
                                token=job.token, events=job.events(), seen=job.seen())
    except Exception as e:  # noqa: BLE001 - the teardown must still run; the report says why it is short
        base["report_error"] = f"{type(e).__name__}: {e}"
        return base


def lost_report(job: LocalJob, cfg: RunConfig, state: str) -> dict[str, Any]:
    """The report of a run whose control plane stopped answering: what the launcher saw itself (the
    events it had read, written to events.jsonl, and the last step it showed); nothing is read from
    the store. Its teardown gives each store call LOST_TEARDOWN_CALL_S (the store may be back: then the
    run's end is still announced and its keys removed)."""
    if job.store.replicated:
        job.store.timeout_s = LOST_TEARDOWN_CALL_S
    (job.run_dir / "events.jsonl").write_text("".join(line + "\n" for line in job.events_seen))
    return {"run_id": job.run_id, "state": state, "config": json.loads(cfg.to_json()),
            "error": f"control plane lost: {job.control_plane_lost}",
            "steps_completed": job.last_step_shown,
            "final_state_sha256": None, "recoveries": [], "faults": [], "run_dir": str(job.run_dir),
            "goodput": job.live.account() if job.live is not None else None,  # (of what the launcher saw)
            "report_partial": "the control plane was lost: this report holds only what the launcher had seen"}


def resume_point(persist_dir: str, verify: bool = True) -> dict[str, Any] | None:
    """The newest complete checkpoint of the persistent tier once the run's processes are gone (every write
    they had begun finished or given up): {"dir", "step"}, or None if there is none that verifies. `verify`
    False: the newest complete one, its files not read (a job being ended by SIGTERM has until the SIGKILL; reading
    a large checkpoint back could take longer, and `--resume` verifies it anyway)."""
    from phoenixft.protect.persist import latest_manifest, verified_manifest

    try:
        man = verified_manifest(persist_dir)[0] if verify else latest_manifest(persist_dir)
    except Exception:  # noqa: BLE001 - an unreadable directory: nothing to resume from, said so
        return None
    return {"dir": persist_dir, "step": int(man["step"])} if man is not None else None


def resume_line(persist_dir: str, point: dict[str, Any] | None) -> str:
    """What the end of a run that did not finish says about its persistent tier."""
    if point is None:
        return f"the persistent tier holds no complete checkpoint in {persist_dir} (none was due yet)"
    return (f"the persistent tier saved step {point['step']} in {point['dir']}: go on from there with the same "
            f"flags and --resume {point['dir']}")


def write_report(job: LocalJob, cfg: RunConfig, state: str, report: dict[str, Any]) -> dict[str, Any]:
    """The report once the job is torn down (its teardown's findings added), written to the run directory
    and to --report; the end of the job said (a job handed over to another host's coordinator)."""
    if not report:
        report = {"config": json.loads(cfg.to_json()), "state": state, "run_id": job.run_id}
    report["teardown"] = job.leaks
    if job.handed_over is not None:
        report["handed_over_to"] = job.handed_over
        job.display.info(f"the job goes on without this host: coordinator {job.handed_over} leads it (a standby "
                         "took over while this host was cut off from the control plane); its keys are left to it")
    report["teardown_stopped_while_starting"] = job.stopped_starting
    if state != "done" and cfg.persist_dir:
        ending = getattr(job.stop_notice, "deadline", None) is not None  # (a SIGTERM's stop: SIGKILL follows)
        report["resume_from"] = resume_point(cfg.persist_dir, verify=not ending)
        job.display.info(resume_line(cfg.persist_dir, report["resume_from"]))
    (job.run_dir / "report.json").write_text(json.dumps(report, indent=2))
    if cfg.report:
        Path(cfg.report).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.report).write_text(json.dumps(report, indent=2))
    return report
