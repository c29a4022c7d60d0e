"""Host shared memory of a run: segment names, owner records and the orphan sweep.

Every segment of a run is a file `/dev/shm/phoenixft-<run>-<node>.<local rank>-g<gen>-<what>`
(`<what>`: `params.0|1|tags`, `state.data|hdr`, `hold<s>.data|hdr`, with `--redundancy ec:D+H`
`par<gid>.data|hdr|info`), so a run's segments, a
node's and a worker's each share one prefix (`run_prefix`, `node_prefix`, `worker_base`).

Ownership: the processes that may create or keep a run's segments (the launcher, each node
agent) append a line `{"pid", "start", "role"}` to the run's owner record
`/dev/shm/phoenixft-<run>.owner` before any segment exists; `start` is the process start time
(`/proc/PID/stat`), so a recycled PID is never taken for a live owner. A run is *live* while an
owner in its record runs, or while any process names the run id on its command line (every
process of a run does: agents and workers `--run-id`, the coordinator too, and older versions
that wrote no record). Segments of runs that are not live are orphans: `sweep()` removes them
(at the start of every run and agent, and by `phoenixft gc`). A live run's are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phoenixft.runtime.procs import alive, cmdlines, start_time

__all__ = ["SHM_DIR", "check_run_id", "run_prefix", "node_prefix", "worker_base", "holding_glob", "parity_glob",
           "segments", "unlink_segments", "owner_path", "register_owner", "unregister_owner", "live_owners",
           "run_is_live", "SweepResult", "sweep"]

SHM_DIR = Path("/dev/shm")
PREFIX = "phoenixft-"
_RUN_ID = re.compile(r"^[A-Za-z0-9_]{1,64}$")
LOCK_TIMEOUT_S = 10.0


def check_run_id(run_id: str) -> str:
    """A run id is letters, digits and '_' (1-64), so that names parse back unambiguously."""
    if not _RUN_ID.match(run_id):
        from phoenixft.errors import UserError

        raise UserError(f"--run-id={run_id!r} is invalid: use 1-64 letters, digits or '_'")
    return run_id


def run_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}-"


def node_prefix(run_id: str, node: str) -> str:
    return f"{PREFIX}{run_id}-{node}."


def worker_base(run_id: str, wid: str, gen: int) -> str:
    """Path prefix of one worker's segments for partition generation `gen`."""
    return str(SHM_DIR / f"{PREFIX}{run_id}-{wid}-g{gen}")


def holding_glob(run_id: str, wid: str, gen: int) -> str:
    """Glob (under SHM_DIR) of the replica holdings a worker keeps, one `.data` per shard."""
    return f"{PREFIX}{run_id}-{wid}-g{gen}-hold*.data"


def parity_glob(run_id: str, wid: str, gen: int) -> str:
    """Glob (under SHM_DIR) of the parity blocks a worker keeps (`ec:D+H`), one `.data` per group."""
    return f"{PREFIX}{run_id}-{wid}-g{gen}-par*.data"


def segments(run_id: str, node: str | None = None) -> list[Path]:
    pre = node_prefix(run_id, node) if node is not None else run_prefix(run_id)
    return sorted(SHM_DIR.glob(pre + "*"))


def nodes_with_segments(run_id: str) -> set[str]:
    """The node ids that have segments of run `run_id` on this machine."""
    pre = run_prefix(run_id)
    return {p.name[len(pre):].split(".", 1)[0] for p in segments(run_id)}


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def unlink_segments(run_id: str, node: str | None = None) -> list[tuple[str, int]]:
    """Remove a run's (or one node's) segments; returns (name, bytes) of each removed."""
    out = []
    for p in segments(run_id, node):
        n = _size(p)
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        out.append((p.name, n))
    return out


# ---------------------------------------------------------------------- owner record
def owner_path(run_id: str) -> Path:
    return SHM_DIR / f"{PREFIX}{run_id}.owner"


def _locked(path: Path, create: bool) -> int | None:
    """Open `path` and take its exclusive lock (bounded wait); None if it does not exist and
    `create` is false. Retries if the file was replaced or removed while we waited."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"could not lock {path} within {LOCK_TIMEOUT_S:.0f}s") from e
                time.sleep(0.01)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # removed or replaced while we waited for the lock: start over


def _read(fd: int) -> list[dict[str, Any]]:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    out = []
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("pid"), int):
            out.append(rec)
    return out


def _write(fd: int, recs: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(r) + "\n" for r in recs).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def register_owner(run_id: str, role: str, pid: int | None = None) -> None:
    """Record process `pid` (default: this one) as an owner of the run's host memory."""
    pid = pid or os.getpid()
    fd = _locked(owner_path(run_id), create=True)
    assert fd is not None
    try:
        recs = [r for r in _read(fd) if alive(r["pid"], r.get("start"))]
        recs.append({"pid": pid, "start": start_time(pid), "role": role, "t": time.time()})
        _write(fd, recs)
    finally:
        os.close(fd)


def unregister_owner(run_id: str, pid: int | None = None) -> None:
    """Drop `pid` (default: this one) from the record; remove the record when no owner is left."""
    pid = pid or os.getpid()
    path = owner_path(run_id)
    fd = _locked(path, create=False)
    if fd is None:
        return
    try:
        recs = [r for r in _read(fd) if r["pid"] != pid and alive(r["pid"], r.get("start"))]
        if recs:
            _write(fd, recs)
        else:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def live_owners(run_id: str) -> list[dict[str, Any]]:
    fd = _locked(owner_path(run_id), create=False)
    if fd is None:
        return []
    try:
        return [r for r in _read(fd) if alive(r["pid"], r.get("start"))]
    finally:
        os.close(fd)


def run_is_live(run_id: str, argv: dict[int, list[str]] | None = None) -> bool:
    """A live owner in the record, or a process naming the run id on its command line."""
    if live_owners(run_id):
        return True
    argv = cmdlines() if argv is None else argv
    return any(run_id in args for args in argv.values())


# ---------------------------------------------------------------------- sweep
@dataclass
class SweepResult:
    runs: list[str] = field(default_factory=list)  # run ids whose orphaned segments were (or would be) removed
    segments: int = 0
    bytes: int = 0
    live_runs: list[str] = field(default_factory=list)  # run ids left alone because they are live
    errors: list[str] = field(default_factory=list)


def _run_of(name: str) -> tuple[str, bool] | None:
    """(run id, is owner record) for a phoenixft name in SHM_DIR, else None."""
    if not name.startswith(PREFIX):
        return None
    rest = name[len(PREFIX) :]
    m = re.match(r"^([A-Za-z0-9_]+)([-.])", rest)
    if not m:
        return None
    if m.group(2) == ".":
        return (m.group(1), True) if rest == m.group(1) + ".owner" else None
    return m.group(1), False


def sweep(dry_run: bool = False, exclude: tuple[str, ...] = ()) -> SweepResult:
    """Remove the segments (and owner record) of every run on this machine that is not live."""
    res = SweepResult()
    runs: dict[str, list[Path]] = {}
    try:
        names = list(SHM_DIR.iterdir())
    except OSError as e:
        res.errors.append(str(e))
        return res
    for p in names:
        r = _run_of(p.name)
        if r is not None and r[0] not in exclude:
            runs.setdefault(r[0], [])
            if not r[1]:
                runs[r[0]].append(p)
    if not runs:
        return res
    argv = cmdlines()
    for run_id, segs in sorted(runs.items()):
        try:
            fd = _locked(owner_path(run_id), create=False)  # held while deciding, so no owner joins meanwhile
        except TimeoutError as e:
            res.errors.append(str(e))
            continue
        try:
            owners = [r for r in _read(fd) if alive(r["pid"], r.get("start"))] if fd is not None else []
            if owners or any(run_id in args for args in argv.values()):
                res.live_runs.append(run_id)
                continue
            freed = [(p, _size(p)) for p in segs]
            if not dry_run:
                gone = []
                for p, n in freed:
                    try:
                        p.unlink()
                        gone.append((p, n))
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        res.errors.append(f"{p}: {e.strerror}")
                freed = gone
                if fd is not None:
                    owner_path(run_id).unlink(missing_ok=True)
            if freed:
                res.runs.append(run_id)
                res.segments += len(freed)
                res.bytes += sum(n for _, n in freed)
        finally:
            if fd is not None:
                os.close(fd)
    return res
