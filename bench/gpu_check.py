"""The GPU check (bench/gpu_check.sh runs it with the machine's own Python; docs/gpu.md says how to run it).

    bench/gpu_check.sh --out DIR                 # on a GPU machine: everything under DIR
    bench/gpu_check.sh --dry-run                 # anywhere: the plan, its time budget, every command
    bench/gpu_check.sh --rehearse --out DIR      # this harness end to end on CPU (NOT a GPU result)

The steps (bench/gpu_steps.py) run in order, most informative first, each within its share of a global
deadline (`--deadline`, seconds from the start of gpu_check.sh) and at most `--step-cap`; a step that no
longer fits is left out, saying so. After every step DIR/gpu_check.json is rewritten (the results so far,
the step running now marked `running`) and every run's directory and logs are packed into
DIR/runs.tar.gz, so a run cut off by the machine's time limit still returns what it had; DIR/gpu_check.log
is this console output. Exit 0 only if every step that ran passed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_deps  # noqa: E402
import gpu_evidence  # noqa: E402
import gpu_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESERVE_S = 20.0  # kept back from the deadline: the last packing and the summary
DEADLINE_S = 480.0  # 8 minutes from the start of gpu_check.sh (the device machine's cap is 10 per command)
STEP_CAP_S = 150.0


class Log:
    """Lines to the console and to DIR/gpu_check.log (written as they come)."""

    def __init__(self, path: Path | None) -> None:
        self.f = open(path, "a", buffering=1) if path is not None else None  # noqa: SIM115 - closed at exit

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        if self.f is not None:
            self.f.write(msg + "\n")


class Results:
    """DIR/gpu_check.json, rewritten atomically whenever it changes; DIR/runs.tar.gz after each step."""

    def __init__(self, out: Path, work: Path, data: dict[str, Any]) -> None:
        self.out, self.work, self.data = out, work, data

    def save(self, pack: bool = False) -> None:
        self.data["elapsed_s"] = round(time.time() - self.data["_t0"], 1)
        if pack and self.work.exists():
            try:
                self.data["archive"] = gpu_evidence.pack(self.work, self.out)
            except OSError as e:
                self.data["archive"] = {"error": f"{type(e).__name__}: {e}"}
        gpu_evidence.write_json(self.out / "gpu_check.json", {k: v for k, v in self.data.items() if k != "_t0"})


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="folder for gpu_check.json, gpu_check.log and runs.tar.gz "
                                              "(default: runs/gpu_check/<time>)")
    ap.add_argument("--work", default="", help="folder of the runs (default: a fresh runs/gpu_check/<time>-work)")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help=f"seconds from the start (--t0) by which everything is done (default {DEADLINE_S:.0f})")
    ap.add_argument("--step-cap", type=float, default=STEP_CAP_S, help=f"most seconds one step may take "
                                                                       f"(default {STEP_CAP_S:.0f})")
    ap.add_argument("--t0", type=float, default=0.0, help="when the check started (epoch seconds; gpu_check.sh "
                                                          "passes its own start)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda; cpu rehearses this harness")
    ap.add_argument("--dry-run", action="store_true", help="the plan with its time budget and commands; run nothing")
    ap.add_argument("--quick", action="store_true", help="smaller runs (a CPU rehearsal)")
    ap.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    ap.add_argument("--wheels", default="", help="a folder of wheels for missing modules (torch is never installed)")
    ap.add_argument("--parallel", type=int, default=2, help="runs of one step at a time (default 2: the failure-free "
                                                            "reference beside the killed run)")
    ap.add_argument("--model", default="small", help="model of the overhead runs (default small)")
    ap.add_argument("--steps", type=int, default=30, help="steps per overhead run")
    ap.add_argument("--rounds", type=int, default=2, help="overhead rounds (each: none + phoenix)")
    ap.add_argument("--target", type=float, default=1.01, help="largest acceptable overhead ratio")
    a = ap.parse_args(argv)
    if a.deadline <= RESERVE_S or a.step_cap <= 0:
        ap.error(f"--deadline must exceed {RESERVE_S:.0f} s and --step-cap be positive")
    known = {s.name for s in gpu_steps.STEPS}
    bad = [n for n in a.only.split(",") if n and n not in known]
    if bad:
        ap.error(f"--only={','.join(bad)} is invalid: the steps are {', '.join(sorted(known))}")
    return a


def plan(a: argparse.Namespace, deps: gpu_deps.Deps) -> list[tuple[gpu_steps.Step, str]]:
    """Every step, with why it is left out ('' if it runs)."""
    out = []
    for s in gpu_steps.STEPS:
        why = ""
        if a.only and s.name not in a.only.split(","):
            why = "not asked for (--only)"
        elif missing := [m for m in s.needs if m in deps.missing]:
            why = "; ".join(f"{m} is missing ({gpu_deps.NEEDED[m][1]})" for m in missing)
        out.append((s, why))
    return out


def dry_run(a: argparse.Namespace, steps: list[tuple[gpu_steps.Step, str]], c: gpu_steps.Ctx) -> int:
    """Print every step with its time budget and exact commands, after checking each run's flags; run nothing."""
    from phoenixft.cli.main import build_parser
    from phoenixft.config import config_from_args
    from phoenixft.errors import UserError

    bad, total = 0, 0.0
    for i, (s, why) in enumerate(steps, 1):
        if why:
            c.log(f"step {i} {s.name}: left out: {why}")
            continue
        total += s.est_s
        c.log(f"step {i} {s.name}: budget {s.est_s:.0f} s (cap {a.step_cap:.0f} s): {s.what}")
        for label, cmd in gpu_steps.commands(s, c, a.step_cap):
            note = f"  # {label}" if label else ""
            c.log(f"step {i} {s.name}: would run: {shlex.join(['python', *cmd[1:]])}{note}")
            if cmd[1:3] == ["-m", "phoenixft"]:  # the flags are valid (CUDA itself is checked where workers run)
                try:
                    config_from_args(build_parser().parse_args(cmd[3:]))
                except (UserError, SystemExit) as e:
                    bad += 1
                    c.log(f"step {i} {s.name}: INVALID flags: {e}")
    fits = total + RESERVE_S <= a.deadline
    c.log(f"gpu_check --dry-run: {sum(1 for _, w in steps if not w)} step(s) planned, {total:.0f} s of budget + "
          f"{RESERVE_S:.0f} s reserve against a deadline of {a.deadline:.0f} s ({'fits' if fits else 'does NOT fit'}: "
          "steps that no longer fit are left out at run time); nothing was run")
    return 1 if bad or not fits else 0


def environment(a: argparse.Namespace, deps: gpu_deps.Deps) -> dict[str, Any]:
    return {"device": a.device, "python": sys.version.split()[0], "torch": deps.torch, "dependencies": deps.versions,
            "missing": deps.missing, "cores": os.cpu_count(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("PHOENIXFT_", "NCCL_", "TORCH_NCCL",
                                                                                 "CUDA_VISIBLE"))}}


def run_steps(a: argparse.Namespace, steps: list[tuple[gpu_steps.Step, str]], c: gpu_steps.Ctx, res: Results,
              deadline: float) -> bool:
    ok = True
    for s, why in steps:
        entry: dict[str, Any] = {"name": s.name, "what": s.what, "budget_s": s.est_s}
        res.data["steps"].append(entry)
        left = deadline - time.time() - RESERVE_S
        if not why and s.cuda_only and a.device == "cpu":
            why = "needs CUDA (a CPU rehearsal)"
        if not why and left < s.min_s:
            why = f"out of time: {max(0.0, left):.0f} s left before the deadline, it needs about {s.est_s:.0f} s"
        if why:
            entry.update(status="left out", detail=why)
            c.log(f"LEFT OUT: {s.name}: {why}")
            res.save()
            continue
        cap = min(a.step_cap, left)
        entry.update(status="running", cap_s=round(cap))
        res.save()
        c.log(f"{s.name}: {s.what} (cap {cap:.0f} s)")
        t0 = time.monotonic()
        try:
            passed, detail, data = gpu_steps.run_step(s, c, cap)
        except Exception as e:  # noqa: BLE001 - the harness's own failure: reported as this step's
            passed, detail = False, f"harness error: {type(e).__name__}: {e}"
            data = {"traceback": traceback.format_exc()}
        status = ("pass" if passed else "fail") if a.device == "cuda" else ("rehearsed" if passed else "fail")
        entry.update(status=status, detail=detail, wall_s=round(time.monotonic() - t0, 1), **data)
        ok = ok and passed
        c.log(f"{status.upper()}: {s.name}: {detail} ({entry['wall_s']} s)")
        res.save(pack=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = a.t0 or time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else ROOT / "runs" / "gpu_check" / stamp
    work = Path(a.work) if a.work else ROOT / "runs" / "gpu_check" / f"{stamp}-work"  # (packed into `out`)
    if not a.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    log = Log(None if a.dry_run else out / "gpu_check.log")
    src = str(ROOT / "src")  # the project as it is here, for this process and every run (nothing installed)
    if src not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    sys.path.insert(0, src)
    deps = gpu_deps.check()
    if deps.missing and a.wheels and not a.dry_run:
        deps = gpu_deps.install_missing(deps, a.wheels)
    for line in deps.lines():
        log(line)
    c = gpu_steps.Ctx(a.device, work, log, a.quick, a.model, a.steps, a.rounds, a.target, a.parallel)
    steps = plan(a, deps)
    if a.dry_run:
        return dry_run(a, steps, c) if not deps.fatal else 1
    kind = "GPU check" if a.device == "cuda" else "CPU rehearsal of the GPU check (NOT a GPU result)"
    res = Results(out, work, {"_t0": t0, "kind": kind, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                              "deadline_s": a.deadline, "step_cap_s": a.step_cap,
                              "environment": environment(a, deps), "steps": [], "pass": None, "complete": False})
    res.save()

    def cut_off(signum: int, _frame: Any) -> None:
        for p in list(c.children):
            gpu_steps.stop(p)
        res.data.update({"pass": False, "complete": False, "cut_off": f"signal {signum}"})
        res.save(pack=True)
        log(f"gpu_check: CUT OFF by signal {signum}; results so far in {out}")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, cut_off)
    signal.signal(signal.SIGINT, cut_off)
    if deps.fatal or (a.device == "cuda" and not deps.has_cuda):
        why = f"missing {', '.join(deps.fatal)}" if deps.fatal else "no CUDA device visible to this torch"
        log(f"FAIL: environment: {why}: this is not a GPU run")
        res.data.update({"pass": False, "complete": True, "environment_error": why})
        res.save()
        log(f"gpu_check: FAIL (results in {out})")
        return 1
    ok = run_steps(a, steps, c, res, t0 + a.deadline)
    ran = [e for e in res.data["steps"] if e["status"] not in ("left out",)]
    res.data.update({"pass": ok and bool(ran), "complete": True})
    res.save(pack=True)
    left = [e["name"] for e in res.data["steps"] if e["status"] == "left out"]
    what = "gpu_check" if a.device == "cuda" else "gpu_check rehearsal on CPU (NOT a GPU result)"
    log(f"{what}: {'PASS' if res.data['pass'] else 'FAIL'}" + (f" (left out: {', '.join(left)})" if left else "")
        + f" (results in {out})")
    return 0 if res.data["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
