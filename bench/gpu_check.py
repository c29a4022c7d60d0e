"""The GPU check (bench/gpu_check.sh runs it with the machine's own Python; see docs/gpu.md).

    python bench/gpu_check.py [--out runs/gpu_check.json] [--wheels DIR]   # on a GPU machine
    python bench/gpu_check.py --dry-run                                    # anywhere: what it would run
    python bench/gpu_check.py --device cpu --quick                         # this harness on CPU (no GPU result)

Steps, each PASS, FAIL or left out (with the reason), in this order:

- cuda-tests: tests/test_cuda.py (a skipped CUDA test fails the step), the device seam's tests;
- hotswap, hotswap-tp2, hotswap-pp2, bf16-256, erasure-code: a failure-free reference
  (`--protect none --spares 0`), then the same job with a spare and node 1 SIGKILLed inside its
  optimizer step; the run must recover by a hot-swap (the spare promoted, every invariant true) and end
  with a final state hash bitwise equal to the reference's. Data-parallel on NCCL; tensor-parallel 2;
  pipeline-parallel 2; 256-token sequences in bf16 (the `medium` preset); `--redundancy ec:2+2`
  (left out without zfec);
- overhead: the failure-free overhead of protection with the copy stream: R rounds of the same job with
  `--protect none` and `--protect phoenix` (order reversed every other round); the per-step times of
  every run pooled after its first 3 steps; the ratio of the medians must be <= --target.

One host: `phoenixft run` spreads the nodes over the GPUs, and workers beyond the GPUs get an NCCL
host identity of their own (docs/gpu.md). Writes the results as JSON to --out; exit 0 only if every
step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_deps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DROP = 3
TESTS = ["tests/test_cuda.py", "tests/test_device.py", "tests/test_gpu_setup.py"]


@dataclass(frozen=True)
class HotSwap:
    """A hot-swap check: the job's flags, and the step whose optimizer phase node 1 is killed in."""

    name: str
    args: tuple[str, ...]
    kill_step: int
    what: str

    def runs(self) -> list[tuple[str, list[str]]]:
        ref = [*self.args, "--protect", "none", "--spares", "0"]
        kill = [*self.args, "--spares", "1", "--inject", f"kill:node=1@step={self.kill_step},phase=optimizer,wait=120"]
        return [("reference", ref), ("kill", kill)]


TINY = ("--model", "tiny", "--steps", "12")
HOTSWAPS = [
    HotSwap("hotswap", ("--nodes", "2", "--workers-per-node", "1", *TINY), 6, "data-parallel"),
    HotSwap("hotswap-tp2", ("--nodes", "2", "--workers-per-node", "2", "--tp", "2", *TINY), 6, "tensor-parallel 2"),
    HotSwap("hotswap-pp2", ("--nodes", "4", "--workers-per-node", "1", "--pp", "2", *TINY), 6,
            "pipeline-parallel 2"),
    HotSwap("bf16-256", ("--nodes", "2", "--workers-per-node", "1", "--model", "medium", "--precision", "bf16",
                         "--micro-batch", "4", "--steps", "10"), 5, "256-token sequences in bf16"),
    HotSwap("erasure-code", ("--nodes", "4", "--workers-per-node", "1", "--redundancy", "ec:2+2", *TINY), 6,
            "Reed-Solomon parity, ec:2+2"),
]


def log(msg: str) -> None:
    print(msg, flush=True)


def phoenixft_cmd(device: str, args: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "phoenixft", "run", "--device", device, "--quiet", "--run-dir", str(run_dir),
            "--report", str(run_dir / "report.json"), *args]


def pytest_cmd() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow", *TESTS]


def run(run_dir: Path, device: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    """One `phoenixft run`; its report (with `_rc`, `_wall_s`, `_dt`: the per-step times of rank 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = phoenixft_cmd(device, args, run_dir)
    t0 = time.monotonic()
    with open(run_dir / "launcher.log", "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    rep: dict[str, Any] = {}
    if (run_dir / "report.json").exists():
        rep = json.loads((run_dir / "report.json").read_text())
    rep["_rc"], rep["_wall_s"], rep["_cmd"] = rc, time.monotonic() - t0, shlex.join(cmd)
    dts = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "dt" in rec:
                dts.append((int(rec["step"]), float(rec["dt"])))
    rep["_dt"] = [dt for _, dt in sorted(dts)]
    return rep


def why_failed(rep: dict[str, Any], run_dir: Path) -> str:
    tail = ""
    log_file = run_dir / "launcher.log"
    if log_file.exists():
        tail = " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
    return f"exit {rep['_rc']}, state {rep.get('state')!r}, error {rep.get('error')!r}; launcher: {tail[-400:]}"


def cuda_tests() -> tuple[bool, str]:
    """The CUDA tests: pass only if pytest passed and no test of tests/test_cuda.py was skipped."""
    p = subprocess.run(pytest_cmd(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = p.stdout + p.stderr
    log(out.strip()[-3000:])
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if p.returncode != 0:
        return False, f"pytest exit {p.returncode}: {summary}"
    if any("SKIPPED" in line and "test_cuda" in line for line in out.splitlines()):
        return False, f"CUDA tests were skipped on a GPU machine: {summary}"
    return True, summary


def hotswap(spec: HotSwap, device: str, work: Path) -> tuple[bool, str, dict[str, Any]]:
    """A reference run and a run with node 1 SIGKILLed: recovered by a hot-swap, bitwise equal."""
    reps = {}
    for label, args in spec.runs():
        log(f"{spec.name}: {label} run ...")
        reps[label] = rep = run(work / f"{spec.name}-{label}", device, args, 420)
        if rep["_rc"] != 0 or rep.get("state") != "done":
            return False, f"the {label} run failed: " + why_failed(rep, work / f"{spec.name}-{label}"), {}
    ref, hot = reps["reference"], reps["kill"]
    recs = hot.get("recoveries", [])
    same = hot.get("final_state_sha256") == ref.get("final_state_sha256")
    dev_ok = hot.get("config", {}).get("device") == device == ref.get("config", {}).get("device")
    rec_ok = (len(recs) == 1 and recs[0].get("action") == "hotswap" and recs[0].get("promoted") == ["s0"]
              and bool(recs[0].get("invariants")) and all(recs[0].get("invariants", {}).values()))
    detail = (f"{spec.what}: final state {str(hot.get('final_state_sha256'))[:16]} vs reference "
              f"{str(ref.get('final_state_sha256'))[:16]} ({'bitwise equal' if same else 'DIFFERENT'}); "
              f"recoveries {[(r.get('action'), r.get('promoted')) for r in recs]}")
    if recs:
        detail += f", recovery {recs[0].get('recovery_s', float('nan')):.2f} s, lost steps {recs[0].get('lost_steps')}"
    if not dev_ok:
        detail += f"; device in the reports: {hot.get('config', {}).get('device')!r}"
    return same and rec_ok and dev_ok, detail, {"final_sha": hot.get("final_state_sha256"),
                                                 "reference_sha": ref.get("final_state_sha256"), "recoveries": recs}


def overhead_runs(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    base = ["--nodes", "2", "--workers-per-node", "1", "--model", a.model, "--steps", str(a.steps), "--spares", "0"]
    out = []
    for r in range(a.rounds):
        for mode in (["none", "phoenix"] if r % 2 == 0 else ["phoenix", "none"]):
            out.append((f"{r}-{mode}", [*base, "--protect", mode]))
    return out


def overhead(a: argparse.Namespace, work: Path) -> tuple[bool, str, dict[str, Any]]:
    dts: dict[str, list[float]] = {"none": [], "phoenix": []}
    for label, args in overhead_runs(a):
        log(f"overhead: {label} ...")
        d = work / f"overhead-{label}"
        rep = run(d, a.device, args, 900)
        if rep["_rc"] != 0 or rep.get("state") != "done":
            return False, f"{label} failed: " + why_failed(rep, d), {}
        if len(rep["_dt"]) < a.steps:
            return False, f"{label}: {len(rep['_dt'])} step records for {a.steps} steps", {}
        dts[label.split("-")[1]] += rep["_dt"][DROP:]
    m_none, m_ph = statistics.median(dts["none"]), statistics.median(dts["phoenix"])
    ratio = m_ph / m_none
    return ratio <= a.target, (f"median step {m_ph * 1e3:.2f} ms protected vs {m_none * 1e3:.2f} ms unprotected: "
                               f"{ratio:.4f}x (target <= {a.target}x; {a.model}, {a.rounds} rounds x {a.steps} "
                               f"steps, first {DROP} dropped)"), {"ratio": ratio, "samples": len(dts["none"]),
                                                                  "median_s": {"none": m_none, "phoenix": m_ph}}


def selected(a: argparse.Namespace) -> list[str]:
    names = ["cuda-tests", *(h.name for h in HOTSWAPS), "overhead"]
    if a.quick:
        names = ["hotswap", "overhead"]
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    return names


def dry_run(a: argparse.Namespace, names: list[str], left_out: dict[str, str], work: Path) -> int:
    """List every step with its exact commands, after checking each run's flags here; run nothing."""
    from phoenixft.cli.main import build_parser
    from phoenixft.config import config_from_args
    from phoenixft.errors import UserError

    bad = 0
    for i, name in enumerate(names, 1):
        if name in left_out:
            log(f"step {i} {name}: left out: {left_out[name]}")
            continue
        if name == "cuda-tests":
            cmds = [("", pytest_cmd())]
        elif name == "overhead":
            cmds = [(label, phoenixft_cmd(a.device, args, work / f"overhead-{label}"))
                    for label, args in overhead_runs(a)]
        else:
            spec = next(h for h in HOTSWAPS if h.name == name)
            cmds = [(label, phoenixft_cmd(a.device, args, work / f"{name}-{label}")) for label, args in spec.runs()]
        for label, cmd in cmds:
            log(f"step {i} {name}: would run: {shlex.join(cmd)}" + (f"  # {label}" if label else ""))
            if cmd[2] == "phoenixft":  # the flags are valid (a CUDA-only check aside: made where workers run)
                try:
                    config_from_args(build_parser().parse_args(cmd[3:]))
                except (UserError, SystemExit) as e:
                    bad += 1
                    log(f"step {i} {name}: INVALID flags: {e}")
    log(f"gpu_check --dry-run: {len(names) - len(left_out.keys() & set(names))} step(s) listed; nothing was run")
    return 1 if bad else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (the GPU check); cpu only exercises this harness")
    ap.add_argument("--dry-run", action="store_true", help="check the dependencies, list the steps, run nothing")
    ap.add_argument("--wheels", default="", help="a folder of wheels for missing modules (zfec, pytest, ...); "
                                                 "torch is never installed")
    ap.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    ap.add_argument("--model", default="small", help="model of the overhead runs (default small, ~11M)")
    ap.add_argument("--steps", type=int, default=30, help="steps per overhead run")
    ap.add_argument("--rounds", type=int, default=2, help="overhead rounds (each: none + phoenix)")
    ap.add_argument("--target", type=float, default=1.01, help="largest acceptable overhead ratio")
    ap.add_argument("--quick", action="store_true", help="hotswap and a tiny overhead run only (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check.json"))
    ap.add_argument("--work", default="", help="run directories (default: a fresh runs/gpu_check-<time>)")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.steps, a.rounds = "tiny", 12, 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    src = str(ROOT / "src")  # the project as it is here, for this process and the runs (nothing installed)
    if src not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = src + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if src not in sys.path:
        sys.path.insert(0, src)
    work = Path(a.work or ROOT / "runs" / time.strftime("gpu_check-%Y%m%d-%H%M%S"))
    deps = gpu_deps.check()
    if deps.missing and a.wheels and not a.dry_run:
        deps = gpu_deps.install_missing(deps, a.wheels)
    for line in deps.lines():
        log(line)
    names, left_out = selected(a), deps.left_out
    if a.dry_run:
        if a.wheels:
            for m in deps.missing:
                cmd = gpu_deps.install_command(sys.executable, a.wheels, m)
                log(f"setup: would run: {shlex.join(cmd)}" if cmd else f"setup: {m} is never installed here")
        log(f"setup: the project from {ROOT / 'src'} on PYTHONPATH (the machine's torch untouched); NCCL for one "
            f"host: {', '.join(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('NCCL_')) or '-'}")
        return dry_run(a, names, left_out, work) if not deps.fatal else 1
    results: dict[str, Any] = {"info": {"device": a.device, "dependencies": deps.versions, "torch": deps.torch,
                                        "env": {k: v for k, v in sorted(os.environ.items())
                                                if k.startswith(("PHOENIXFT_", "NCCL_", "TORCH_NCCL"))}},
                               "checks": {}, "left_out": {}}
    if deps.fatal or (a.device == "cuda" and not deps.has_cuda):
        why = f"missing {', '.join(deps.fatal)}" if deps.fatal else "no CUDA device visible to this torch"
        log(f"FAIL: environment: {why}: this is not a GPU run")
        results["checks"]["environment"] = {"pass": False, "detail": why}
        return finish(results, a.out, False)
    return finish(results, a.out, run_steps(a, names, left_out, work, results))


def run_steps(a: argparse.Namespace, names: list[str], left_out: dict[str, str], work: Path,
              results: dict[str, Any]) -> bool:
    ok = True
    for name in names:
        t0 = time.monotonic()
        if name in left_out:
            log(f"LEFT OUT: {name}: {left_out[name]}")
            results["left_out"][name] = left_out[name]
            continue
        if name == "cuda-tests":
            passed, detail, data = (*cuda_tests(), {})
        elif name == "overhead":
            passed, detail, data = overhead(a, work)
        else:
            passed, detail, data = hotswap(next(h for h in HOTSWAPS if h.name == name), a.device, work)
        ok = ok and passed
        results["checks"][name] = {"pass": passed, "detail": detail, "wall_s": round(time.monotonic() - t0, 1), **data}
        log(f"{'PASS' if passed else 'FAIL'}: {name}: {detail}")
    return ok


def finish(results: dict[str, Any], out: str, ok: bool) -> int:
    results["pass"] = ok
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2, default=str))
    what = "gpu_check" if results["info"]["device"] == "cuda" else "gpu_check harness on CPU (NOT a GPU result)"
    left = f" (left out: {', '.join(results['left_out'])})" if results.get("left_out") else ""
    log(f"{what}: {'PASS' if ok else 'FAIL'}{left} (results in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
