"""The GPU check's end-to-end part (bench/gpu_check.sh runs it after the CUDA tests).

    python bench/gpu_check.py                      # on a GPU machine: --device cuda
    python bench/gpu_check.py --device cpu --quick # the harness itself, on CPU (not a GPU result)

1. hot-swap on NCCL: a failure-free reference (`--protect none --spares 0`), then the same job
   with a spare and node 1 SIGKILLed inside its optimizer step; the run must finish, recover by a
   hot-swap with every invariant true, and end with a final state hash bitwise equal to the
   reference's;
2. failure-free overhead of protection with the copy stream: R rounds, each running the same job
   with `--protect none` and `--protect phoenix` (order reversed every other round); per mode the
   per-step times (metrics.jsonl `dt`) of all runs are pooled after dropping each run's first 3
   steps; the ratio of the medians must be <= --target (1.01).

One host, one or more GPUs: the emulated nodes are spread over the GPUs
(`PHOENIXFT_GPU_PLACEMENT=spread`); when there are fewer GPUs than workers, each worker gets its
own `NCCL_HOSTID` (`PHOENIXFT_NCCL_HOSTID=worker`) so that NCCL accepts several ranks per GPU (its
network transport over loopback then carries them). Every check prints PASS or FAIL with the
reason; the exit code is 0 only if every check passed. Writes --out (bench/results/gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DROP = 3


def log(msg: str) -> None:
    print(msg, flush=True)


def run(run_dir: Path, device: str, args: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """One `phoenixft run`; its report (with `_rc`, `_wall_s`, `_dt`: the per-step times of rank 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "phoenixft", "run", "--device", device, "--quiet", "--run-dir", str(run_dir),
           "--report", str(run_dir / "report.json"), *args]
    t0 = time.monotonic()
    with open(run_dir / "launcher.log", "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    rep: dict[str, Any] = {}
    if (run_dir / "report.json").exists():
        rep = json.loads((run_dir / "report.json").read_text())
    rep["_rc"], rep["_wall_s"], rep["_cmd"] = rc, time.monotonic() - t0, " ".join(cmd)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (the GPU check); cpu only exercises this harness")
    ap.add_argument("--model", default="small", help="model of the overhead runs (default small, ~11M)")
    ap.add_argument("--steps", type=int, default=40, help="steps per overhead run")
    ap.add_argument("--rounds", type=int, default=3, help="overhead rounds (each: none + phoenix)")
    ap.add_argument("--target", type=float, default=1.01, help="largest acceptable overhead ratio")
    ap.add_argument("--nodes", type=int, default=2, help="nodes of every job (one worker each)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 12 steps, 1 round (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    ap.add_argument("--work", default="", help="run directories (default: a fresh runs/gpu_check-<time>)")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.steps, a.rounds = "tiny", 12, 1
    work = Path(a.work or ROOT / "runs" / time.strftime("gpu_check-%Y%m%d-%H%M%S"))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    info: dict[str, Any] = {"device": a.device, "nodes": a.nodes}
    results: dict[str, Any] = {"info": info, "checks": {}}
    ok = True

    def verdict(name: str, passed: bool, detail: str, **data: Any) -> None:
        nonlocal ok
        ok = ok and passed
        results["checks"][name] = {"pass": passed, "detail": detail, **data}
        log(f"{'PASS' if passed else 'FAIL'}: {name}: {detail}")

    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            verdict("environment", False, f"no CUDA device (torch {torch.__version__}): this is not a GPU run")
            return finish(results, a.out, ok)
        gpus = torch.cuda.device_count()
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        info.update(gpus=gpus, gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                    nccl=nccl)
        env.setdefault("PHOENIXFT_GPU_PLACEMENT", "spread")
        if gpus < a.nodes + 1:  # nodes + the spare, one worker each
            env.setdefault("PHOENIXFT_NCCL_HOSTID", "worker")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_IB_DISABLE", "1")
        info["env"] = {k: env[k] for k in sorted(env) if k.startswith(("PHOENIXFT_", "NCCL_", "TORCH_NCCL"))}
        log(f"environment: {gpus} x {info['gpu']}, torch {info['torch']}, CUDA {info['cuda']}, NCCL {nccl}; "
            f"{info['env']}")
    base = ["--nodes", str(a.nodes), "--workers-per-node", "1"]

    # 1. hot-swap with a SIGKILLed worker
    hs = ["--model", "tiny", "--steps", "12"]
    log("hot-swap: reference run (no protection, no spare) ...")
    ref = run(work / "hotswap-reference", a.device, [*base, *hs, "--protect", "none", "--spares", "0"], env, 600)
    log("hot-swap: node 1 SIGKILLed in its optimizer step 6, spare s0 promoted ...")
    hot = run(work / "hotswap-kill", a.device, [*base, *hs, "--spares", "1", "--inject",
                                                "kill:node=1@step=6,phase=optimizer,wait=120"], env, 600)
    if ref["_rc"] != 0 or ref.get("state") != "done":
        verdict("hotswap", False, "the reference run failed: " + why_failed(ref, work / "hotswap-reference"))
    elif hot["_rc"] != 0 or hot.get("state") != "done":
        verdict("hotswap", False, "the run with the kill failed: " + why_failed(hot, work / "hotswap-kill"))
    else:
        recs = hot.get("recoveries", [])
        same = hot.get("final_state_sha256") == ref.get("final_state_sha256")
        dev_ok = hot.get("config", {}).get("device") == a.device == ref.get("config", {}).get("device")
        rec_ok = (len(recs) == 1 and recs[0].get("action") == "hotswap" and recs[0].get("promoted") == ["s0"]
                  and all(recs[0].get("invariants", {}).values()) and bool(recs[0].get("invariants")))
        detail = (f"final state {str(hot.get('final_state_sha256'))[:16]} vs reference "
                  f"{str(ref.get('final_state_sha256'))[:16]} ({'bitwise equal' if same else 'DIFFERENT'}); "
                  f"recoveries {[(r.get('action'), r.get('promoted')) for r in recs]}")
        if recs:
            r0 = recs[0]
            detail += f", recovery {r0.get('recovery_s', float('nan')):.2f} s, lost steps {r0.get('lost_steps')}"
        if not dev_ok:
            detail += f"; device in the reports: {hot.get('config', {}).get('device')!r}"
        verdict("hotswap", same and rec_ok and dev_ok, detail, final_sha=hot.get("final_state_sha256"),
                reference_sha=ref.get("final_state_sha256"), recoveries=recs)

    # 2. failure-free overhead of protection (copy stream + replication from host memory)
    ov = ["--model", a.model, "--steps", str(a.steps), "--spares", "0"]
    dts: dict[str, list[float]] = {"none": [], "phoenix": []}
    failed = ""
    for r in range(a.rounds):
        order = ["none", "phoenix"] if r % 2 == 0 else ["phoenix", "none"]
        for mode in order:
            log(f"overhead: round {r + 1}/{a.rounds}, --protect {mode} ...")
            d = work / f"overhead-{r}-{mode}"
            rep = run(d, a.device, [*base, *ov, "--protect", mode], env, 900)
            if rep["_rc"] != 0 or rep.get("state") != "done":
                failed = f"--protect {mode} round {r + 1} failed: " + why_failed(rep, d)
                break
            if len(rep["_dt"]) < a.steps:
                failed = f"--protect {mode} round {r + 1}: {len(rep['_dt'])} step records for {a.steps} steps"
                break
            dts[mode] += rep["_dt"][DROP:]
        if failed:
            break
    if failed:
        verdict("overhead", False, failed)
    else:
        m_none, m_ph = statistics.median(dts["none"]), statistics.median(dts["phoenix"])
        ratio = m_ph / m_none
        verdict("overhead", ratio <= a.target,
                f"median step {m_ph * 1e3:.2f} ms protected vs {m_none * 1e3:.2f} ms unprotected: {ratio:.4f}x "
                f"(target <= {a.target}x; {a.model}, {a.rounds} rounds x {a.steps} steps, first {DROP} dropped)",
                ratio=ratio, median_s={"none": m_none, "phoenix": m_ph}, samples=len(dts["none"]))
    return finish(results, a.out, ok)


def finish(results: dict[str, Any], out: str, ok: bool) -> int:
    results["pass"] = ok
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2, default=str))
    what = "gpu_check" if results["info"]["device"] == "cuda" else "gpu_check harness on CPU (NOT a GPU result)"
    log(f"{what}: {'PASS' if ok else 'FAIL'} (summary in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
