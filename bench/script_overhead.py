"""A user's own training script under `phoenixft launch` against the same script under torchrun, unprotected.

    python bench/script_overhead.py                # 3 interleaved rounds of 60 steps, DP=2; a hot-swap's resume time
    python bench/script_overhead.py --quick        # 1 round of 30 steps

The script is bench/script_train.py: the DDP loop of examples/ddp_script_phoenixft.py (AdamW, a cosine
schedule, clipping, a DataLoader) on a wider MLP (3.4M parameters, 512 samples a rank a step by default:
as much compute per parameter as a few hundred tokens of a language model), timing each whole step
(`with job.step(...)`, its snapshot included) on rank 0. Each round runs, in an order reversed every other
round to cancel drift:

- `torchrun --nproc-per-node DP script` (phoenixft.init() gives an unprotected job: plain DDP);
- `phoenixft launch --nodes DP --protect none script` (the job without snapshots: its groups, its DDP hook);
- `phoenixft launch --nodes DP script` (every step protected: snapshot, replication, the default scrubbing).

Per mode the step times of all rounds are pooled after dropping each run's first 5 steps; the ratios of
medians are reported with 95% bootstrap intervals. Then one `phoenixft launch --nodes DP --spares 1` run with
a node SIGKILLed mid-backward gives the time from the kill to the first step after it, by stage.

Prints a table and writes bench/results/script.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import (
    BENCH_DIR,
    RESULTS,
    TORCHRUN_ENV,
    VENV_BIN,
    bootstrap_ratio_ci,
    log,
    machine_info,
    median,
    ratio,
    run_cmd,
    table,
    tail,
    torchrun_cmd,
    write_json,
)

SCRIPT = BENCH_DIR / "script_train.py"
DROP = 5


def _times(path: Path) -> list[float]:
    try:
        return [float(x) for x in json.loads(path.read_text())["times"]][DROP:]
    except (OSError, ValueError, KeyError):
        return []


def run_mode(mode: str, dp: int, steps: int, work: Path, args: list[str]) -> list[float]:
    out = work / f"{mode}.json"
    out.unlink(missing_ok=True)
    script_args = ["--steps", str(steps), "--times", str(out), *args]
    if mode == "torchrun":
        cmd = torchrun_cmd(dp, SCRIPT, script_args)
        env = TORCHRUN_ENV
    else:
        protect = "none" if mode == "launch-none" else "phoenix"
        cmd = [str(VENV_BIN / "phoenixft"), "launch", "--nodes", str(dp), "--spares", "0", "--protect", protect,
               "--run-dir", str(work / f"run-{mode}"), "--quiet", str(SCRIPT), *script_args]
        env = {}
    log_path = work / f"{mode}.log"
    rc = run_cmd(cmd, log_path, 900.0, env=env)
    if rc != 0:
        log(f"{mode} exited {rc}:\n{tail(log_path)}")
    return _times(out)


def resume(dp: int, steps: int, work: Path, args: list[str]) -> dict[str, Any]:
    """One hot-swap: node 1 SIGKILLed mid-backward at step steps/2, a warm spare promoted."""
    report = work / "resume.json"
    kill_at = steps // 2
    cmd = [str(VENV_BIN / "phoenixft"), "launch", "--nodes", str(dp), "--spares", "1", "--quiet",
           "--inject", f"kill:node=1@step={kill_at},phase=backward,wait=60", "--report", str(report),
           "--run-dir", str(work / "run-resume"), str(SCRIPT), "--steps", str(steps), *args]
    rc = run_cmd(cmd, work / "resume.log", 900.0)
    try:
        rep = json.loads(report.read_text())
    except (OSError, ValueError):
        log(f"the resume run left no report (exit {rc}):\n{tail(work / 'resume.log')}")
        return {}
    recs = rep.get("recoveries") or [{}]
    r = recs[0]
    return {"state": rep.get("state"), "action": r.get("action"), "recovery_s": r.get("recovery_s"),
            "lost_steps": r.get("lost_steps"), "stages": r.get("stages"), "fault_step": kill_at}


def run(quick: bool = False, out: Path = RESULTS, dp: int = 2, rounds: int = 0, steps: int = 0,
        hidden: int = 1024) -> dict[str, Any]:
    """The interleaved rounds and the resume run; prints a table, writes `out`/script.json, returns the result."""
    rounds = rounds or (1 if quick else 3)
    steps = steps or (30 if quick else 60)
    args = ["--hidden", str(hidden)]
    modes = ["torchrun", "launch-none", "launch"]
    pooled: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="phoenixft-script-bench-") as tmp:
        work = Path(tmp)
        for r in range(rounds):
            for m in (modes if r % 2 == 0 else list(reversed(modes))):
                log(f"round {r + 1}/{rounds}: {m}")
                pooled[m] += run_mode(m, dp, steps, work, args)
        res = resume(dp, steps, work, args)
    med = {m: median(xs) for m, xs in pooled.items()}
    result: dict[str, Any] = {
        "machine": machine_info(), "dp": dp, "rounds": rounds, "steps": steps, "hidden": hidden,
        "step_s": med, "samples": {m: len(xs) for m, xs in pooled.items()},
        "overhead_vs_torchrun": ratio(med["launch"], med["torchrun"]),
        "overhead_vs_torchrun_ci95": bootstrap_ratio_ci(pooled["launch"], pooled["torchrun"]),
        "protection_vs_none": ratio(med["launch"], med["launch-none"]),
        "protection_vs_none_ci95": bootstrap_ratio_ci(pooled["launch"], pooled["launch-none"]),
        "none_vs_torchrun": ratio(med["launch-none"], med["torchrun"]),
        "resume": res,
        "command": "python bench/script_overhead.py" + (" --quick" if quick else ""),
    }
    table(f"a script's step, DP={dp} ({steps} steps x {rounds} rounds, median)", ["mode", "step s", "ratio"],
          [[m, med[m], ratio(med[m], med["torchrun"])] for m in modes])
    print(f"resume after a kill: {res.get('recovery_s')} s, lost {res.get('lost_steps')} step(s) "
          f"({res.get('action')}); stages {res.get('stages')}")
    write_json(out / "script.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 3, 1 with --quick)")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default 60, 30 with --quick)")
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args(argv)
    run(a.quick, RESULTS, a.dp, a.rounds, a.steps, a.hidden)
    return 0


if __name__ == "__main__":
    sys.exit(main())
