"""What the GPU check reads out of its runs and hands back: the NCCL transport from NCCL's own INFO lines,
the timed snapshot copies (src/phoenixft/distributed/cuda_timing.py), and the packing of every run's
directory and logs into one archive under the output folder (rewritten after every step, so a run cut
off by the machine's time limit still returns what it had).

    python bench/gpu_evidence.py nccl DIR      # the transport summary of the NCCL logs under DIR
    python bench/gpu_evidence.py timing FILE   # the summary of a timing file
"""

from __future__ import annotations

import io
import json
import os
import re
import statistics
import sys
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["nccl_env", "nccl_summary", "timing_summary", "pack", "write_json", "ARCHIVE", "ARCHIVE_LIMIT"]

ARCHIVE = "runs.tar.gz"
ARCHIVE_LIMIT = 15 << 20  # the device machine returns files of at most 16 MiB
SKIP_NAMES = {"token", ".phoenixft.lock"}  # the run's secret, a lock file
SKIP_DIRS = {"final", "__pycache__"}  # the exported model (megabytes, no evidence)

_VERSION = re.compile(r"NCCL version (\S+)")
_VIA = re.compile(r"\bvia (\S+)")
_NETWORK = re.compile(r"Using network (\S+)")
_COMM = re.compile(r"nRanks (\d+) nNodes (\d+) localRanks (\d+)")


def nccl_env(log_dir: Path) -> dict[str, str]:
    """The environment that makes NCCL write its initialisation (versions, transports) to one file per
    process under `log_dir`."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": str(log_dir / "nccl.%h.%p.log")}


def _transport(via: str) -> str:
    """'NET/Socket/0' -> 'NET/Socket', 'P2P/CUMEM/read' -> 'P2P/CUMEM', 'SHM/direct/direct' -> 'SHM'."""
    parts = via.split("/")
    if parts[0] in ("SHM", "COLLNET", "NVLS"):
        return parts[0]
    return "/".join(parts[:2])


def nccl_summary(root: Path) -> dict[str, Any]:
    """Versions, transports (connections by kind), networks and communicator shapes in the NCCL logs
    under `root`, with one line saying what was and was not exercised."""
    versions: Counter[str] = Counter()
    via: Counter[str] = Counter()
    nets: Counter[str] = Counter()
    shapes: Counter[str] = Counter()
    files = sorted(root.rglob("nccl.*.log")) if root.exists() else []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            if m := _VERSION.search(line):
                versions[m.group(1)] += 1
            if m := _VIA.search(line):
                via[_transport(m.group(1))] += 1
            if m := _NETWORK.search(line):
                nets[m.group(1)] += 1
            if m := _COMM.search(line):
                shapes[f"{m.group(1)} ranks on {m.group(2)} node(s), {m.group(3)} per node"] += 1
    out: dict[str, Any] = {"log_files": len(files), "versions": sorted(versions), "connections": dict(via),
                           "networks": sorted(nets), "communicators": dict(shapes)}
    if not files:
        out["verdict"] = "no NCCL log was written (NCCL_DEBUG_FILE): transport unknown"
    elif not via:
        out["verdict"] = "NCCL logged no connection line: transport unknown"
    else:
        used = sorted(via)
        missed = [t for t in ("P2P", "SHM", "NVLS") if not any(u.startswith(t) for u in used)]
        out["verdict"] = (f"connections via {', '.join(used)}"
                          + (f"; not exercised: {', '.join(missed)} (NVLink/P2P need ranks on distinct GPUs of one "
                             "host identity)" if missed else ""))
    return out


def timing_summary(path: Path) -> dict[str, Any]:
    """The timed snapshot copies in `path` (JSON lines), summarised: pinned, copy and step medians, how
    many copies finished inside the step beside them."""
    if not path.exists():
        return {"copies": 0, "verdict": "no copy was timed (no CUDA worker, or no protection)"}
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not recs:
        return {"copies": 0, "verdict": "no copy was timed (the run ended before its events completed)"}
    pinned = sum(1 for r in recs if r.get("pinned"))
    over = sum(1 for r in recs if r.get("overlapped"))
    copy = statistics.median(r["copy_ms"] for r in recs)
    step = statistics.median(r["step_ms"] for r in recs)
    out = {"copies": len(recs), "pinned": pinned, "overlapped": over, "bytes": recs[0]["bytes"],
           "copy_ms_median": round(copy, 3), "step_ms_median": round(step, 3),
           "gb_per_s_median": statistics.median(r["gb_per_s"] or 0.0 for r in recs), "records": recs[:6]}
    out["verdict"] = (f"{pinned}/{len(recs)} copies into pinned host memory; {over}/{len(recs)} ended inside the "
                      f"next step of the compute stream (copy {copy:.3f} ms, step {step:.3f} ms)")
    return out


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, atomically (a reader, or a kill mid-write, never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _members(work: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(work):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        out += [Path(dirpath) / f for f in filenames if f not in SKIP_NAMES and not f.endswith(".tmp")]
    return sorted(out)


def pack(work: Path, out_dir: Path, limit: int = ARCHIVE_LIMIT) -> dict[str, Any]:
    """Every file under `work` (but the exported models and the run tokens) into out_dir/ARCHIVE,
    atomically; the largest files are left out, and named, while the archive exceeds `limit`."""
    files = _members(work)
    left: list[str] = []
    while True:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for f in files:
                try:
                    tar.add(f, arcname=str(f.relative_to(work.parent)))
                except OSError:  # (a file removed while packing: a run's temporary)
                    continue
        if buf.tell() <= limit or not files:
            break
        biggest = max(files, key=lambda p: p.stat().st_size if p.exists() else 0)
        left.append(str(biggest.relative_to(work.parent)))
        files.remove(biggest)
    tmp = out_dir / (ARCHIVE + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_dir / ARCHIVE)
    return {"archive": ARCHIVE, "bytes": buf.tell(), "files": len(files), "left_out": left}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("nccl", "timing"):
        print("usage: gpu_evidence.py nccl DIR | timing FILE", file=sys.stderr)
        return 2
    what = nccl_summary(Path(args[1])) if args[0] == "nccl" else timing_summary(Path(args[1]))
    print(json.dumps(what, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
