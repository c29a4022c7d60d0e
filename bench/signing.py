"""What sealing the control plane's values with the run key costs: per value, per step, per recovery.

    python bench/signing.py                # model `tiny`, DP=2, 3 before/now pairs
    python bench/signing.py --quick        # 2 pairs, shorter runs
    python bench/signing.py --before REV   # the code to compare with (default: the parent of the commit
                                           # that added controlplane/sealed.py)

Every value a process of the job acts on is sealed (controlplane/sealed.py: an HMAC-SHA256 under the run
key inside the value) and checked when read. Parts, the code before sealing and now alternated in one
invocation (before, now, before, now, ...: the machine is shared, so the ratios come from one run; the
code before is the revision `--before` exported to a temporary directory and run from there):
1. seal + unseal of one value (100 bytes, a 4 KiB descriptor-sized one), and of an event line, in us;
2. failure-free step time, median after the warm-up (`phoenixft run`, 2 nodes, no spare);
3. the CPU seconds all the processes of a failure-free run used (user + system): what a loaded machine
   disturbs least;
4. recovery: a node SIGKILLed at step 6, hot-swapped onto the spare: the report's `recovery_s`.

Prints a table, writes bench/results/signing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, RESULTS, bootstrap_ratio_ci, log, machine_info, median, ratio, steady, table, write_json

sys.path.insert(0, str(REPO / "src"))

SEALS = 20000


def per_value() -> dict[str, float | None]:
    """Median microseconds of one seal + unseal (the MAC computed twice, compared in constant time)."""
    from phoenixft.controlplane import sealed

    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "bench")
    out: dict[str, float | None] = {}
    for name, value in (("value_100B", b"x" * 100), ("value_4KiB", b"x" * 4096)):
        times = []
        for _ in range(SEALS):
            t = time.perf_counter()
            assert sealed.unseal("desc/3/n1.0", sealed.seal("desc/3/n1.0", value)) == value
            times.append(time.perf_counter() - t)
        out[name] = (median(times) or 0.0) * 1e6
    lines = b"".join(sealed.seal("events", json.dumps({"t": time.time(), "kind": "epoch", "nodes": ["n0", "n1"],
                                                        "i": i})) + b"\n" for i in range(10))
    times = []
    for _ in range(SEALS // 10):
        t = time.perf_counter()
        sealed.records("events", lines)
        times.append((time.perf_counter() - t) / 10)
    out["event_line"] = (median(times) or 0.0) * 1e6
    sealed.unbind()
    return out


def before_tree(rev: str, into: Path) -> Path:
    """`rev`'s src/ exported into `into`: the code before sealing, run from there."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "src"


def default_before() -> str:
    added = subprocess.run(["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H", "--",
                            "src/phoenixft/controlplane/sealed.py"], capture_output=True, text=True).stdout.split()
    return f"{added[-1]}^" if added else "HEAD"


def cli_run(src: Path, run_dir: Path, *args: str) -> dict[str, Any]:
    """One `phoenixft run` of the code in `src`; its report with `metrics` (rank 0's step records) and
    `cpu_s`, the CPU seconds its processes used (user + system, all of them: less sensitive to a loaded
    machine than the wall time)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("PHOENIXFT_TOKEN", None)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-m", "phoenixft", "run", "--model", "tiny", "--nodes", "2", "--quiet",
                        "--run-dir", str(run_dir), "--timeout", "300", *args], capture_output=True, text=True,
                       env=env, timeout=600)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rep: dict[str, Any] = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() \
        else {"state": f"no report (exit {p.returncode}): {p.stderr[-500:]}"}
    m = run_dir / "metrics.jsonl"
    rep["metrics"] = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.exists() else []
    rep["cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer pairs, shorter runs")
    ap.add_argument("--rounds", type=int, default=0, help="before/now pairs (default: 3, --quick 2)")
    ap.add_argument("--before", default="", help="git revision of the code to compare with")
    a = ap.parse_args()
    return 0 if run(a.quick, rounds=a.rounds, before=a.before) else 1


def run(quick: bool = False, out: Path = RESULTS, rounds: int = 0, before: str = "") -> dict[str, Any]:
    rounds, steps = rounds or (2 if quick else 3), (14 if quick else 24)
    before = before or default_before()
    res: dict[str, Any] = {"machine": machine_info(), "model": "tiny", "rounds": rounds, "steps": steps,
                           "before": before}
    log(f"signing: seal + unseal, {SEALS} values each")
    res["seal_unseal_us"] = per_value()
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-signing-") as tmp:
        work = Path(tmp)
        trees = {"before": before_tree(before, work), "now": REPO / "src"}
        dts: dict[str, list[float]] = {k: [] for k in trees}
        per_round: dict[str, list[float | None]] = {k: [] for k in trees}  # each run's median step
        cpu: dict[str, list[float]] = {k: [] for k in trees}  # each failure-free run's CPU seconds
        recs: dict[str, list[float]] = {k: [] for k in trees}
        for i in range(rounds):
            for name, src in trees.items():
                log(f"signing: failure-free {name} round {i + 1}/{rounds} (tiny, DP=2)")
                rep = cli_run(src, work / f"ff-{name}-{i}", "--spares", "0", "--steps", str(steps))
                if rep.get("state") != "done":
                    raise RuntimeError(f"{name}: {rep.get('state')} {rep.get('error')}")
                dts[name] += [m["dt"] for m in steady(rep["metrics"])]
                per_round[name].append(median([m["dt"] for m in steady(rep["metrics"])]))
                cpu[name].append(rep["cpu_s"])
                log(f"signing: kill:node=1@step=6 {name} round {i + 1}/{rounds}")
                rep = cli_run(src, work / f"kill-{name}-{i}", "--spares", "1", "--steps", "10",
                              "--inject", "kill:node=1@step=6,wait=60")
                rec = (rep.get("recoveries") or [{}])[0]
                if rep.get("state") != "done" or rec.get("action") != "hotswap":
                    raise RuntimeError(f"{name} kill: {rep.get('state')} {rep.get('error')} {rec}")
                recs[name].append(float(rec["recovery_s"]))
    res["step_time_s"] = {k: median(v) for k, v in dts.items()}
    res["step_time_ratio_now_vs_before"] = ratio(res["step_time_s"]["now"], res["step_time_s"]["before"])
    res["step_time_ratio_ci95"] = bootstrap_ratio_ci(dts["now"], dts["before"])  # (over the steps of every run)
    res["step_time_s_per_run"] = per_round
    res["run_cpu_s"] = {k: median(v) for k, v in cpu.items()}
    res["run_cpu_s_all"] = cpu
    res["run_cpu_ratio_now_vs_before"] = ratio(res["run_cpu_s"]["now"], res["run_cpu_s"]["before"])
    res["recovery_s"] = {k: median(v) for k, v in recs.items()}
    res["recovery_s_all"] = recs
    res["recovery_ratio_now_vs_before"] = ratio(res["recovery_s"]["now"], res["recovery_s"]["before"])
    su, st, rc = res["seal_unseal_us"], res["step_time_s"], res["recovery_s"]
    table("control-plane values sealed with the run key", ["figure", "before", "now", "ratio"],
          [["seal + unseal, 100 B value, us", None, su["value_100B"], None],
           ["seal + unseal, 4 KiB value, us", None, su["value_4KiB"], None],
           ["check of one event line, us", None, su["event_line"], None],
           ["failure-free step, s (tiny, DP=2)", st["before"], st["now"], res["step_time_ratio_now_vs_before"]],
           [f"CPU of a failure-free run, s ({steps} steps)", res["run_cpu_s"]["before"], res["run_cpu_s"]["now"],
            res["run_cpu_ratio_now_vs_before"]],
           ["hot-swap recovery, s (kill at step 6)", rc["before"], rc["now"], res["recovery_ratio_now_vs_before"]]])
    res["elapsed_note"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(out / "signing.json", res)
    return res


if __name__ == "__main__":
    sys.exit(main())
