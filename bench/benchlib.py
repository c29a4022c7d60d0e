"""Shared helpers of the benchmark harness (not a benchmark itself; imported by bench/*.py).

Process hygiene: every subprocess starts in its own session, has a timeout, and its whole
process group is SIGKILLed in a `finally`; ports are picked free on 127.0.0.1. Also here: the
machine description written into every result, robust step-time statistics, a plain-text table
printer, JSON/PNG writers (matplotlib Agg) and the phoenixft run wrapper used by all parts.

Not meant to be run; `python bench/run_all.py [--quick]` is the entry point.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
VENV_BIN = Path(sys.executable).parent

if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


# ---------------------------------------------------------------------------- machine
def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    import torch

    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        # bf16 arithmetic in hardware (else `--precision bf16` is emulated, and slower than fp32)
        "cpu_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "mem_gib": mem_gib,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    cmd: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session (so its whole process group can be killed), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab")  # noqa: SIM115 - closed with the process by the OS
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if env:
        full_env.update(env)
    return subprocess.Popen(
        list(cmd),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=full_env,
        cwd=str(cwd or REPO),
    )


def kill_group(p: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the process group of `p` (its session) and reap it; safe to call twice."""
    if p is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


@contextlib.contextmanager
def managed(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    p = spawn(cmd, log, env)
    try:
        yield p
    finally:
        kill_group(p)


def run_cmd(cmd: Sequence[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Run to completion or until `timeout_s`; the process group never outlives the call."""
    with managed(cmd, log, env) as p:
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return 124


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def torchrun_cmd(nproc: int, script: Path, args: Sequence[str], max_restarts: int = 0) -> list[str]:
    """torchrun exactly as a user would launch the job on one node (rendezvous on a free port)."""
    return [
        str(VENV_BIN / "torchrun"),
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        str(max_restarts),
        str(script),
        *args,
    ]


#: torch 2.13 + gloo: torchrun's shared rendezvous store made restarts fail or hang (see DESIGN.md).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------- statistics
def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def bootstrap_ratio_ci(a: Sequence[float], b: Sequence[float], n: int = 2000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of median(a) / median(b)."""
    if len(a) < 3 or len(b) < 3:
        return None
    import random

    rng = random.Random(seed)
    rs = []
    for _ in range(n):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        rs.append(ma / mb)
    rs.sort()
    return [rs[int(0.025 * n)], rs[int(0.975 * n) - 1]]


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = [
        title,
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


# ---------------------------------------------------------------------------- output
def machine_paths() -> list[tuple[str, str]]:
    """(path prefix of this machine, what a result writes instead): the checkout, the interpreter's
    environment, the temporary directory and the home directory, longest first."""
    import tempfile

    pairs = [(str(REPO), "<repo>"), (sys.prefix, "<venv>"), (tempfile.gettempdir(), "<tmp>"),
             (str(Path.home()), "~")]
    return sorted(((p, r) for p, r in pairs if p and p != "/"), key=lambda x: -len(x[0]))


def scrub_paths(data: Any) -> Any:
    """`data` with every path of this machine in its strings replaced (`machine_paths`): a result says what was
    measured, not where the checkout or the temporary files of the machine that measured it lay."""
    if isinstance(data, str):
        for prefix, repl in machine_paths():
            data = data.replace(prefix, repl)
        return data
    if isinstance(data, dict):
        return {scrub_paths(k): scrub_paths(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [scrub_paths(v) for v in data]
    return data


def write_json(path: Path, data: Any) -> None:
    """Write a result (every path of this machine in it scrubbed: `scrub_paths`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(scrub_paths(data), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- phoenixft runs
PROBE_WORKLOAD = "phoenix_probe:workload"


def phoenix_run(run_dir: Path, *, probe: bool = True, **cfg_kw: Any) -> dict[str, Any]:
    """Run one phoenixft job in-process (it starts and tears down its own processes).

    Returns the report plus `metrics` (the per-step records of rank 0) and, with `probe`, the
    replication jobs the background threads ran (`repl_jobs`: per worker pid, step, seconds,
    bytes), recorded by bench/phoenix_probe.py. The workload is the built-in GPT either way.
    """
    from phoenixft.config import RunConfig
    from phoenixft.observe.display import Display
    from phoenixft.runtime.launcher import run_job

    run_dir.mkdir(parents=True, exist_ok=True)
    probe_dir = run_dir / "probe"
    probe_dir.mkdir(exist_ok=True)
    os.environ["PHOENIXFT_BENCH_PROBE"] = str(probe_dir)
    pp = os.environ.get("PYTHONPATH", "")
    if str(BENCH_DIR) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), pp]).rstrip(os.pathsep)
    cfg_kw.setdefault("timeout", 300.0)
    if probe:
        cfg_kw.setdefault("workload", PROBE_WORKLOAD)
    cfg = RunConfig(run_dir=str(run_dir), quiet=True, **cfg_kw)
    cfg.validate()
    rep = run_job(cfg, Display(quiet=True, steps=cfg.steps))
    mpath = run_dir / "metrics.jsonl"
    rep["metrics"] = [json.loads(x) for x in mpath.read_text().splitlines() if x.strip()] if mpath.exists() else []
    jobs = []
    for f in sorted(probe_dir.glob("repl-*.jsonl")):
        jobs += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    rep["repl_jobs"] = jobs
    return rep


def steady(metrics: list[dict[str, Any]], drop: int = 3) -> list[dict[str, Any]]:
    """Per-step records after the warm-up (the first `drop` steps of the run)."""
    return [m for m in metrics if m["step"] > drop]
