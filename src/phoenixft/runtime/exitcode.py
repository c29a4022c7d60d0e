"""The exit code of `phoenixft run` and `phoenixft coordinator`: what a scheduler (Slurm's `RequeueExit`, a batch
script, a Kubernetes restart policy) decides a job's next step by.

| code | the run | what to do with the job |
|---|---|---|
| 0 | done: every step trained | nothing: do not requeue |
| 75 (EX_TEMPFAIL) | stopped with its state saved (a stop signal, or SIGTERM with a persistent tier) | requeue, resume |
| 1 | failed: what went wrong would go wrong again (the workload, a broken guarantee, the flags...) | do not requeue |
| 2 | refused: a flag or the environment is wrong (one line says which) | do not requeue |
| 130 | interrupted: Ctrl-C, SIGHUP, or SIGTERM without a persistent tier | do not requeue (someone stopped it) |
"""

from __future__ import annotations

from typing import Any

__all__ = ["DONE", "FAILED", "USAGE", "RESUMABLE", "INTERRUPTED_CODE", "exit_code", "command_exit"]

DONE, FAILED, USAGE, RESUMABLE, INTERRUPTED_CODE = 0, 1, 2, 75, 130


def exit_code(report: dict[str, Any]) -> int:
    """The exit code of a run that ended with `report` (see the module docstring)."""
    from phoenixft.coordinator.stop import STOPPED
    from phoenixft.runtime.jobreport import INTERRUPTED

    state = report.get("state")
    if state == "done":
        return DONE
    if state == STOPPED:
        return RESUMABLE
    if state == INTERRUPTED:
        return INTERRUPTED_CODE
    return FAILED


def command_exit(report: dict[str, Any]) -> int:
    """The exit code of the command that ran the job (`phoenixft run`, `coordinator`, `launch`), whose report is
    written. A job stopped by a SIGTERM (a scheduler ending it: SIGKILL follows, KillWait later) exits here at once,
    without the interpreter's finalization (seconds with torch imported, on a busy host): its exit code must reach
    the scheduler before the SIGKILL does."""
    code = exit_code(report)
    stopped = report.get("stopped")
    if isinstance(stopped, dict) and stopped.get("reason") == "SIGTERM received":
        from phoenixft.runtime.procs import exit_now

        exit_now(code)
    return code
