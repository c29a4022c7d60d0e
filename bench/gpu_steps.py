"""The GPU check's steps (bench/gpu_check.py runs them in this order, each within its share of the time):

- hotswap-dp2, the most informative, first: 2 data-parallel nodes on NCCL, node 1 SIGKILLed as its
  backward begins (its peer's gradient reductions in flight), a spare promoted;
- probe: the device, driver, CUDA, NCCL (build and run time), a one-rank NCCL group waited as a worker
  waits, a pinned snapshot half and the copy/compute overlap of the copy stream (bench/gpu_probe.py);
- the hot-swap again with tensor-parallel 2, pipeline-parallel 2, 4 data-parallel ranks (the reduction
  order after a swap), 256-token sequences in bf16 (and, last, ec:2+2, which needs zfec).
  Each hot-swap runs a failure-free reference (`--protect none --spares 0`) beside the killed run, and
  must end bitwise equal to it after exactly one hot-swap with every invariant true. NCCL writes its
  initialisation to files (the transport used); the killed run of hotswap-dp2 times its snapshot copies
  with CUDA events (pinned, overlap);
- cuda-tests: tests/test_cuda.py (a skipped test fails the step);
- overhead: `--protect none` against `--protect phoenix`, interleaved rounds, the ratio of median step
  times (target <= 1.01x), every run's final state bitwise equal, the copies timed.

Every run gets the step's cap as its own `--timeout` and is killed with its whole process group past it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpu_evidence

__all__ = ["Step", "STEPS", "Ctx", "run_step", "phoenixft_cmd", "commands", "KILL_WAIT_S"]

ROOT = Path(__file__).resolve().parent.parent
TINY = ("--model", "tiny", "--steps", "12")
KILL_WAIT_S = 90  # a kill waits (bounded) until the spare is warm: the step checks a hot-swap, not a start-up race
DROP = 3  # overhead: steps dropped from each run (warm-up)


@dataclass(frozen=True)
class Step:
    """One step: `est_s` is what it is expected to take on one GPU (the plan's budget); `min_s` the least
    time worth starting it with."""

    name: str
    kind: str  # probe | hotswap | tests | overhead
    what: str
    est_s: float
    args: tuple[str, ...] = ()
    kill: str = ""
    needs: tuple[str, ...] = ()  # modules without which it is left out (besides the fatal ones)
    cuda_only: bool = False  # nothing to run on a CPU rehearsal

    @property
    def min_s(self) -> float:
        return 0.6 * self.est_s


def _hotswap(name: str, what: str, est_s: float, args: tuple[str, ...], node: int = 1, step: int = 6,
             needs: tuple[str, ...] = ()) -> Step:
    kill = f"kill:node={node}@step={step},phase=backward,wait={KILL_WAIT_S}"
    return Step(name, "hotswap", what, est_s, args, kill, needs)


STEPS: list[Step] = [
    _hotswap("hotswap-dp2", "data-parallel 2 on NCCL, node 1 killed in backward", 40,
             ("--nodes", "2", "--workers-per-node", "1", *TINY)),
    Step("probe", "probe", "device, driver, CUDA, NCCL; a one-rank NCCL group; pinned half, copy/compute overlap", 25,
         cuda_only=True),
    _hotswap("hotswap-tp2", "tensor-parallel 2 (2 nodes x 2), node 1 killed in backward", 45,
             ("--nodes", "2", "--workers-per-node", "2", "--tp", "2", *TINY)),
    _hotswap("hotswap-pp2", "pipeline-parallel 2 (4 nodes), node 1 killed in backward", 45,
             ("--nodes", "4", "--workers-per-node", "1", "--pp", "2", *TINY)),
    _hotswap("hotswap-dp4", "data-parallel 4: the reduction order after a swap, node 2 killed in backward", 45,
             ("--nodes", "4", "--workers-per-node", "1", *TINY), node=2),
    _hotswap("bf16-256", "256-token sequences in bf16 (medium), node 1 killed in backward", 50,
             ("--nodes", "2", "--workers-per-node", "1", "--model", "medium", "--precision", "bf16", "--micro-batch",
              "4", "--steps", "10"), step=5),
    Step("cuda-tests", "tests", "tests/test_cuda.py (a skipped test fails the step)", 100, needs=("pytest",)),
    Step("overhead", "overhead", "failure-free overhead of protection (copy stream + replication)", 70),
    _hotswap("erasure-code", "Reed-Solomon parity ec:2+2 (4 nodes), node 1 killed in backward", 45,
             ("--nodes", "4", "--workers-per-node", "1", "--redundancy", "ec:2+2", *TINY), needs=("zfec",)),
]


@dataclass
class Ctx:
    """What every step needs: the device, the work folder, the overhead settings, a log function."""

    device: str
    work: Path
    log: Callable[[str], None]
    quick: bool = False
    model: str = "small"
    steps: int = 30
    rounds: int = 2
    target: float = 1.01
    parallel: int = 2
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _quick(args: tuple[str, ...]) -> tuple[str, ...]:
    """A CPU rehearsal's version of a run's flags: the medium model (minutes on a CPU) becomes tiny."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--model" and out[i + 1] == "medium":
            out[i + 1] = "tiny"
    return tuple(out)


def rel(path: Path) -> str:
    """`path` relative to the repository (every process runs there), so that no machine path is shown."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def phoenixft_cmd(device: str, args: list[str], run_dir: Path, timeout_s: float) -> list[str]:
    return [sys.executable, "-m", "phoenixft", "run", "--device", device, "--quiet", "--run-dir", rel(run_dir),
            "--report", rel(run_dir / "report.json"), "--timeout", str(int(timeout_s)), *args]


def pytest_cmd(junit: Path, timeout_s: float) -> list[str]:
    """pytest over tests/test_cuda.py; each test bounded (pytest-timeout, where installed) within the step's cap."""
    import importlib.util

    bound = [f"--timeout={int(min(90, timeout_s))}"] if importlib.util.find_spec("pytest_timeout") else []
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", *bound,
            f"--junitxml={rel(junit)}", "tests/test_cuda.py"]


def overhead_runs(c: Ctx) -> list[tuple[str, list[str]]]:
    model, steps, rounds = ("tiny", 12, 1) if c.quick else (c.model, c.steps, c.rounds)
    base = ["--nodes", "2", "--workers-per-node", "1", "--model", model, "--steps", str(steps), "--spares", "0"]
    out = []
    for r in range(rounds):
        for mode in (["none", "phoenix"] if r % 2 == 0 else ["phoenix", "none"]):
            out.append((f"{r}-{mode}", [*base, "--protect", mode]))
    return out


def hotswap_runs(s: Step, c: Ctx) -> list[tuple[str, list[str]]]:
    args = list(_quick(s.args) if c.quick else s.args)
    return [("reference", [*args, "--protect", "none", "--spares", "0"]),
            ("kill", [*args, "--spares", "1", "--inject", s.kill])]


def commands(s: Step, c: Ctx, cap_s: float) -> list[tuple[str, list[str]]]:
    """(label, command) of every process the step starts (the dry run prints them)."""
    d = c.work / s.name
    if s.kind == "probe":
        return [("", [sys.executable, "bench/gpu_probe.py"])]
    if s.kind == "tests":
        return [("", pytest_cmd(d / "junit.xml", cap_s))]
    runs = overhead_runs(c) if s.kind == "overhead" else hotswap_runs(s, c)
    return [(label, phoenixft_cmd(c.device, args, d / label, cap_s - 10)) for label, args in runs]


# ---------------------------------------------------------------------------------------------- processes
def _start(c: Ctx, cmd: list[str], log_file: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                             env={**os.environ, **env}, start_new_session=True)
    c.children.append(p)
    return p


def stop(p: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """End `p`'s whole process group (its coordinator, agents and workers too): SIGTERM (a launcher tears
    its run down), SIGKILL after `grace_s`; then the shared memory of runs no process owns any more."""
    if p.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)  # (the group outlives its leader: what the launcher left is killed too)
        except ProcessLookupError:
            break
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
    subprocess.run([sys.executable, "-m", "phoenixft", "gc"], cwd=ROOT, capture_output=True, timeout=60, check=False)


def _wait_all(c: Ctx, procs: list[subprocess.Popen[bytes]], deadline: float) -> bool:
    """Wait for `procs` until `deadline`; past it, kill them. True if all exited by themselves."""
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        stop(p)
    for p in procs:
        if p in c.children:
            c.children.remove(p)
    return not late


def _report(run_dir: Path, rc: int | None) -> dict[str, Any]:
    rep: dict[str, Any] = {}
    if (run_dir / "report.json").exists():
        try:
            rep = json.loads((run_dir / "report.json").read_text())
        except ValueError:
            rep = {}
    rep["_rc"] = rc
    return rep


def _tail(path: Path, n: int = 4) -> str:
    if not path.exists():
        return ""
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-500:]


def run_group(c: Ctx, step_dir: Path, runs: list[tuple[str, list[str]]], cap_s: float,
              env: Callable[[str], dict[str, str]], parallel: int) -> dict[str, dict[str, Any]]:
    """Run `runs` (label, flags) `parallel` at a time, each within the step's cap; their reports."""
    deadline = time.monotonic() + cap_s
    reps: dict[str, dict[str, Any]] = {}
    todo = list(runs)
    while todo:
        batch, todo = todo[: max(1, parallel)], todo[max(1, parallel):]
        procs = []
        for label, args in batch:
            run_dir = step_dir / label
            cmd = phoenixft_cmd(c.device, args, run_dir, max(10.0, deadline - time.monotonic() - 10))
            c.log(f"  {label}: {shlex.join(['python', *cmd[1:]])}")
            procs.append((label, run_dir, _start(c, cmd, step_dir / f"{label}.log", env(label))))
        _wait_all(c, [p for _, _, p in procs], deadline)
        for label, run_dir, p in procs:
            reps[label] = _report(run_dir, p.returncode)
            reps[label]["_log"] = _tail(step_dir / f"{label}.log")
    return reps


# ---------------------------------------------------------------------------------------------- the steps
def _why(label: str, rep: dict[str, Any]) -> str:
    rc = rep["_rc"]
    rcs = "killed at the step's cap" if rc is not None and rc < 0 else f"exit {rc}"
    return f"the {label} run failed ({rcs}, state {rep.get('state')!r}, error {rep.get('error')!r}): {rep['_log']}"


def hotswap(s: Step, c: Ctx, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
    d = c.work / s.name
    (d / "nccl").mkdir(parents=True, exist_ok=True)
    timing = d / "timing.jsonl"

    def env(label: str) -> dict[str, str]:
        (d / "nccl" / label).mkdir(parents=True, exist_ok=True)
        e = gpu_evidence.nccl_env(d / "nccl" / label)
        if label == "kill" and s.name == "hotswap-dp2":
            e["PHOENIXFT_CUDA_TIMING"] = str(timing)
        return e

    reps = run_group(c, d, hotswap_runs(s, c), cap_s, env, c.parallel)
    data: dict[str, Any] = {"nccl": gpu_evidence.nccl_summary(d / "nccl")}
    if s.name == "hotswap-dp2":
        data["snapshot_copy"] = gpu_evidence.timing_summary(timing)
    bad = [label for label, rep in reps.items() if rep["_rc"] != 0 or rep.get("state") != "done"]
    if bad:
        return False, "; ".join(_why(label, reps[label]) for label in bad), data
    ref, hot = reps["reference"], reps["kill"]
    recs = hot.get("recoveries", [])
    same = hot.get("final_state_sha256") == ref.get("final_state_sha256")
    dev_ok = all(r.get("config", {}).get("device") == c.device for r in (ref, hot))
    rec_ok = (len(recs) == 1 and recs[0].get("action") == "hotswap" and recs[0].get("promoted") == ["s0"]
              and bool(recs[0].get("invariants")) and all(recs[0].get("invariants", {}).values()))
    detail = (f"{s.what}: final state {str(hot.get('final_state_sha256'))[:16]} vs failure-free "
              f"{str(ref.get('final_state_sha256'))[:16]} ({'bitwise equal' if same else 'DIFFERENT'}); "
              f"recoveries {[(r.get('action'), r.get('promoted')) for r in recs]}")
    if not dev_ok:
        detail += f"; device in the reports: {[r.get('config', {}).get('device') for r in (ref, hot)]}"
    if recs:
        detail += (f", recovery {recs[0].get('recovery_s', float('nan')):.2f} s, lost steps "
                   f"{recs[0].get('lost_steps')}, invariants {recs[0].get('invariants')}")
    detail += f"; NCCL: {data['nccl']['verdict']}"
    data.update(final_sha=hot.get("final_state_sha256"), reference_sha=ref.get("final_state_sha256"), recoveries=recs,
                faults=hot.get("faults"), faults_not_fired=hot.get("faults_not_fired"))
    return same and rec_ok and dev_ok, detail, data


def _step_times(run_dir: Path) -> list[float]:
    dts = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "dt" in rec:
                dts.append((int(rec["step"]), float(rec["dt"])))
    return [dt for _, dt in sorted(dts)]


def overhead(s: Step, c: Ctx, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
    d = c.work / s.name
    timing = d / "timing.jsonl"
    runs = overhead_runs(c)
    reps = run_group(c, d, runs, cap_s, lambda label: {"PHOENIXFT_CUDA_TIMING": str(timing)} if "phoenix" in label
                     else {}, 1)  # (one at a time: step times are compared)
    data: dict[str, Any] = {"snapshot_copy": gpu_evidence.timing_summary(timing)}
    bad = [label for label, rep in reps.items() if rep["_rc"] != 0 or rep.get("state") != "done"]
    if bad:
        return False, "; ".join(_why(label, reps[label]) for label in bad), data
    dts: dict[str, list[float]] = {"none": [], "phoenix": []}
    for label, _ in runs:
        dts[label.split("-")[1]] += _step_times(d / label)[DROP:]
    if not dts["none"] or not dts["phoenix"]:
        return False, "no per-step times in the runs' metrics.jsonl", data
    m_none, m_ph = statistics.median(dts["none"]), statistics.median(dts["phoenix"])
    ratio = m_ph / m_none
    hashes = {label: reps[label].get("final_state_sha256") for label, _ in runs}
    same = len(set(hashes.values())) == 1
    data.update(ratio=ratio, median_s={"none": m_none, "phoenix": m_ph}, samples=len(dts["none"]), final_sha=hashes)
    detail = (f"median step {m_ph * 1e3:.2f} ms protected vs {m_none * 1e3:.2f} ms unprotected: {ratio:.4f}x "
              f"(target <= {c.target}x; {len(runs)} runs, first {DROP} steps of each dropped); final states "
              f"{'bitwise equal' if same else 'DIFFERENT'}; copies: {data['snapshot_copy']['verdict']}")
    return ratio <= c.target and same, detail, data


def cuda_tests(s: Step, c: Ctx, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
    d = c.work / s.name
    cmd = pytest_cmd(d / "junit.xml", cap_s)
    c.log(f"  {shlex.join(['python', *cmd[1:]])}")
    p = _start(c, cmd, d / "pytest.log", {})
    _wait_all(c, [p], time.monotonic() + cap_s)
    out = (d / "pytest.log").read_text(errors="replace") if (d / "pytest.log").exists() else ""
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    data = {"summary": summary, "skipped": skipped[:20]}
    if p.returncode is not None and p.returncode < 0:
        return False, f"pytest killed at the step's cap ({cap_s:.0f} s): {summary}", data
    if p.returncode != 0:
        fails = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return False, f"pytest exit {p.returncode}: {summary}; {' | '.join(fails)[:800]}", data
    if skipped and c.device == "cpu":
        return True, f"{summary} (a CPU rehearsal: every CUDA test skips without CUDA)", data
    if skipped:
        return False, f"CUDA tests were skipped: {summary}", data
    return True, summary, data


def probe(s: Step, c: Ctx, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
    d = c.work / s.name
    p = _start(c, [sys.executable, "bench/gpu_probe.py"], d / "probe.log", {})
    _wait_all(c, [p], time.monotonic() + cap_s)
    lines = (d / "probe.log").read_text(errors="replace").splitlines() if (d / "probe.log").exists() else []
    got = next((json.loads(x) for x in reversed(lines) if x.startswith("{")), None)
    if got is None:
        return False, f"the probe printed no result (exit {p.returncode}): {_tail(d / 'probe.log')}", {}
    f = got["facts"]
    if not f.get("gpus"):
        return c.device == "cpu", f"no CUDA device (torch {f.get('torch')})", got
    dev = f["devices"][0]
    nccl, copy = got.get("nccl", {}), got.get("snapshot_copy", {})
    ok = bool(nccl.get("ok")) and bool(copy.get("pinned"))
    detail = (f"{f['gpus']} x {dev['name']} ({dev['memory_gib']} GiB, sm {dev['capability']}), "
              f"driver {f.get('driver')}, "
              f"CUDA {f.get('cuda')}, NCCL {f.get('nccl_build')} (run time {nccl.get('runtime_nccl')}), torch "
              f"{f.get('torch')}, python {f.get('python')}, {f.get('cpus')} cores; one-rank NCCL all-reduce "
              f"{'ok' if nccl.get('ok') else nccl}; snapshot half pinned {copy.get('pinned')}, copy "
              f"{copy.get('copy_ms')} ms ({copy.get('copy_gb_per_s')} GB/s) beside compute {copy.get('compute_ms')} "
              f"ms: together {copy.get('both_ms')} ms, overlap {copy.get('overlap')}")
    return ok, detail, got


RUNNERS = {"probe": probe, "hotswap": hotswap, "tests": cuda_tests, "overhead": overhead}


def run_step(s: Step, c: Ctx, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
    return RUNNERS[s.kind](s, c, cap_s)
