"""A run's directory (`--run-dir`): created, or taken over from the run that used it before.

A run writes config.json, its coordinator's journal, the event and metric logs, report.json, the
process logs and the final model there. A directory that holds another run's files is reused: those
files are removed first (the coordinator would otherwise take the old journal for its own history
and refuse every node as "already started", and the logs would interleave two runs). A directory
whose run is still alive is refused with one line instead: its launcher holds a lock on
`.phoenixft.lock` there from its start to its report (`claim`; two launchers started at the same
moment, neither's coordinator up yet, would otherwise both take it), and an older run's coordinator names its
journal. So is a directory holding files of those names that no phoenixft run wrote (a project's own
config.json, metrics.jsonl, logs/*.log): they are the user's and are never removed.

    phoenixft run --run-dir runs/exp1 ...   # again later: the second run replaces the first's files
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

from phoenixft.errors import UserError
from phoenixft.runtime.procs import cmdlines

__all__ = ["RUN_FILES", "JOURNAL", "TOKEN_FILE", "LOCK", "journal_path", "claim", "release", "prepare",
           "store_address", "token_file"]

JOURNAL = "coordinator.journal"
TOKEN_FILE = "token"  # a generated job token (mode 0600)
LOCK = ".phoenixft.lock"  # held (flock) by the launcher that uses the directory, from its start to its report
# what a run writes at the top of its directory (report.html: `phoenixft report`); logs/ and final/ too
RUN_FILES = ("config.json", JOURNAL, "coordinator.port", "control_plane", "events.jsonl", "metrics.jsonl",
             "report.json", "report.html", TOKEN_FILE)


def store_address(run_dir: str, flag: str = "--run-dir") -> str:
    """The control-plane address of the live run whose run directory is `run_dir` (what `phoenixft status` and
    `phoenixft drain` reach it at from this host): its cluster's URL, or its store's loopback port."""
    d = Path(run_dir)
    for name, fmt in (("control_plane", "{}"), ("coordinator.port", "127.0.0.1:{}")):
        if (d / name).is_file():
            return fmt.format((d / name).read_text().strip())
    why = "no such directory" if not d.is_dir() else "no coordinator.port in it"
    raise UserError(f"{flag}={run_dir}: not the directory of a running `phoenixft run` or `phoenixft coordinator` "
                    f"({why})")


def token_file(run_dir: str) -> str:
    """The run directory's generated job token file, if the run generated one ('' otherwise)."""
    path = Path(run_dir) / TOKEN_FILE
    return str(path) if path.is_file() else ""


def journal_path(run_dir: Path) -> str:
    """The journal's path as the coordinator is given it (absolute: how a live run is recognised)."""
    return str(run_dir.resolve() / JOURNAL)


def _previous_run_id(run_dir: Path) -> str:
    try:
        return str(json.loads((run_dir / "report.json").read_text()).get("run_id") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def _make_logs(run_dir: Path) -> None:
    try:
        (run_dir / "logs").mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot create {run_dir / 'logs'} ({e.strerror or e}); give a "
                        "writable path") from None


def _is_runs(run_dir: Path) -> bool:
    """Whether the files found in `run_dir` are a phoenixft run's: its coordinator's journal or port file,
    a report with a run id, or a run's config.json. Anything else (a project's own config.json, metrics.jsonl
    or logs) is the user's, and is never removed."""
    if any((run_dir / n).exists() for n in (JOURNAL, "coordinator.port", "control_plane")):
        return True
    if _previous_run_id(run_dir):
        return True
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and {"nodes", "workers_per_node", "protect", "steps"} <= cfg.keys()


def claim(run_dir: Path) -> int:
    """Take the directory for this process: an exclusive lock on `run_dir/.phoenixft.lock`, held until
    `release` (or the process's end, however it ends). Raises UserError if another launcher holds it:
    two runs started at the same moment with one --run-dir would otherwise both take it (neither's
    coordinator is up yet to be seen) and remove or interleave each other's journal, logs and report."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot create it ({e.strerror or e}); give a writable path") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise UserError(f"--run-dir {run_dir}: another run that is still alive uses it; give another "
                            "directory, or stop that run first") from None
        raise UserError(f"--run-dir {run_dir}: cannot lock it ({e.strerror or e})") from None
    return fd


def release(fd: int, run_dir: Path | None = None) -> None:
    """Give the directory taken by `claim` back; with `run_dir` (a run refused there: nothing of it may stay)
    its lock file is removed too."""
    if run_dir is not None:
        with contextlib.suppress(OSError):
            (run_dir / LOCK).unlink()
    try:
        os.close(fd)
    except OSError:
        pass


def prepare(run_dir: Path) -> str | None:
    """Create `run_dir` (and logs/), or clear the files of the run that used it before; returns a line
    saying what was replaced (None for a new or empty directory). Raises UserError if it cannot be
    created, or if the run that uses it is still alive."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot create it ({e.strerror or e}); give a writable path") \
            from None
    found = [n for n in RUN_FILES if (run_dir / n).exists()]
    logs = sorted((run_dir / "logs").glob("*.log"))
    if not found and not logs and not (run_dir / "final").exists():
        _make_logs(run_dir)
        return None
    journal = journal_path(run_dir)
    live = [pid for pid, argv in cmdlines().items() if journal in argv]
    if live:
        raise UserError(f"--run-dir {run_dir}: a run that is still alive uses it (its coordinator is process "
                        f"{live[0]}); give another directory, or stop that run first")
    if not _is_runs(run_dir):
        raise UserError(f"--run-dir {run_dir}: it holds files that no phoenixft run wrote "
                        f"({', '.join([*found, *(f'logs/{f.name}' for f in logs)][:4])}), which a run would "
                        "replace; give a new or empty directory (or remove them)")
    old = _previous_run_id(run_dir)
    try:
        for n in found:
            (run_dir / n).unlink()
        for f in logs:
            f.unlink()
        shutil.rmtree(run_dir / "final", ignore_errors=True)
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot remove the previous run's files ({e})") from None
    _make_logs(run_dir)
    return (f"--run-dir {run_dir}: replaced the files of the run that used it before"
            f"{f' (run {old})' if old else ''}")
