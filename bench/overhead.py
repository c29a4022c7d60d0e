"""Failure-free overhead: phoenix vs none vs plain DDP vs DCP save / async_save every step.

    python bench/overhead.py            # full: `small`, DP=2 (replicas 1) and DP=4 (replicas 1, 2)
    python bench/overhead.py --quick    # `tiny`, DP=2 only (well under a minute)
    python bench/overhead.py --model tiny --dp 2 --rounds 1 --steps 6   # the smoke test's size

Method ("same run, interleaved"): one harness invocation runs R rounds; each round runs every
mode once with an identical configuration (`phoenixft run --nodes DP --workers-per-node 1
--spares 0 --steps T --model M --protect none|phoenix --replicas k`), the order reversed every
other round to cancel drift; each DP=2 round also launches the DDP baseline once
(bench/ckpt_restart_train.py under torchrun, cycling plain / dcp.save-every-step /
dcp.async_save-every-step segments inside one process). Per mode the per-step times of all
runs are pooled after dropping the first 3 steps of each phoenixft run (first step of each DDP
segment), and the ratio of medians is reported with a 95% bootstrap interval. The Fig. 9
breakdown comes from the per-step records (compute_s, repl_wait_s) and from
bench/phoenix_probe.py (how long each background replication job took).

Prints a table, writes bench/results/overhead.json and bench/results/overhead.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (
    BENCH_DIR,
    RESULTS,
    TORCHRUN_ENV,
    bootstrap_ratio_ci,
    log,
    machine_info,
    median,
    pct,
    phoenix_run,
    plt,
    ratio,
    run_cmd,
    steady,
    table,
    tail,
    torchrun_cmd,
    write_json,
)

DROP = 3


def model_numel(model: str) -> int:
    import torch

    from phoenixft.train.gpt import GPT, PRESETS

    with torch.device("meta"):
        m = GPT(PRESETS[model])
    return sum(p.numel() for p in m.parameters())


def ddp_round(work: Path, model: str, dp: int, seg: int, timeout_s: float) -> list[dict[str, Any]]:
    """One torchrun launch cycling plain / sync / async segments of `seg` steps; rank 0's step records."""
    work.mkdir(parents=True, exist_ok=True)
    ck = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir="/tmp"))
    steps_log = work / "ddp_steps.jsonl"
    sched = f"plain:{seg},sync:{seg},async:{seg}"
    args = ["--model", model, "--ckpt-dir", str(ck), "--schedule", sched, "--step-log", str(steps_log)]
    try:
        rc = run_cmd(
            torchrun_cmd(dp, BENCH_DIR / "ckpt_restart_train.py", args),
            work / "ddp.log",
            timeout_s,
            env=TORCHRUN_ENV,
        )
    finally:
        shutil.rmtree(ck, ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"DDP baseline failed (rc={rc}):\n{tail(work / 'ddp.log')}")
    recs = [json.loads(x) for x in steps_log.read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "step" in r]
    # drop the first step of every segment (warm-up, first save of a kind)
    return [r for r in steps if (r["step"] - 1) % seg != 0]


def summarize(samples: list[float], per_run: list[float]) -> dict[str, Any]:
    return {
        "median_s": median(samples),
        "p90_s": pct(samples, 0.9),
        "n": len(samples),
        "run_medians_s": [round(x, 5) for x in per_run],
    }


def run(
    quick: bool = False,
    *,
    model: str | None = None,
    dps: list[int] | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    ddp: bool = True,
    out: Path = RESULTS,
) -> dict[str, Any]:
    t_start = time.time()
    machine = machine_info()
    model = model or ("tiny" if quick else "small")
    dps = dps or ([2] if quick else [2, 4])
    rounds = rounds or (2 if quick else 3)
    steps = steps or (12 if quick else 12)
    seg = max(3, steps // 2)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    numel = model_numel(model)
    configs: list[dict[str, Any]] = []
    ddp_samples: dict[str, list[float]] = {"plain": [], "sync": [], "async": []}
    ddp_per_run: dict[str, list[float]] = {"plain": [], "sync": [], "async": []}
    ddp_dp = 2
    ddp_rounds = 1 if quick else min(rounds, 2)  # each launch costs a torchrun start-up
    none_dp2: list[float] = []
    for dp in dps:
        # (protect, k, replica transport); at DP=2 the same protection over TCP too (the default, auto, reads
        # replicas through host shared memory between nodes of one host: every node of these runs)
        modes = [("none", 1, "auto")] + [("phoenix", k, "auto") for k in (1, 2) if k < dp]
        if dp == 2:
            modes.append(("phoenix", 1, "tcp"))
        names = ["none" if m == "none" else f"phoenix_r{k}" + ("_tcp" if t == "tcp" else "") for m, k, t in modes]
        samples: dict[str, list[float]] = {n: [] for n in names}
        per_run: dict[str, list[float]] = {n: [] for n in names}
        compute: dict[str, list[float]] = {n: [] for n in names}
        waits: dict[str, list[float]] = {n: [] for n in names}
        jobs: dict[str, list[float]] = {n: [] for n in names}
        job_bytes: dict[str, list[int]] = {n: [] for n in names}
        protect_cpu: dict[str, list[float]] = {n: [] for n in names}
        protect_bytes: dict[str, list[float]] = {n: [] for n in names}
        n_rounds = rounds if dp == 2 else max(1, rounds - 1)  # DP>2 runs are slower on 2 cores
        n_steps = steps if dp == 2 or quick else max(DROP + 4, steps - 4)
        for r in range(n_rounds):
            order = list(zip(names, modes, strict=True))
            if r % 2:
                order.reverse()
            for name, (protect, k, transport) in order:
                log(f"overhead: DP={dp} {name} round {r + 1}/{n_rounds} ({model}, {n_steps} steps)")
                rep = phoenix_run(
                    work / f"dp{dp}-{name}-{r}",
                    nodes=dp,
                    workers_per_node=1,
                    spares=0,
                    steps=n_steps,
                    model=model,
                    protect=protect,
                    replicas=k,
                    replica_transport=transport,
                )
                if rep.get("state") != "done":
                    raise RuntimeError(f"phoenixft run failed: {rep.get('state')} {rep.get('error', '')}")
                st = steady(rep["metrics"], DROP)
                dts = [m["dt"] for m in st]
                samples[name] += dts
                per_run[name].append(median(dts) or math.nan)
                compute[name] += [m["compute_s"] for m in st]
                waits[name] += [m["repl_wait_s"] for m in st]
                jobs[name] += [j["seconds"] for j in rep["repl_jobs"] if j["step"] > DROP]
                job_bytes[name] += [j["bytes"] for j in rep["repl_jobs"]]
                protect_cpu[name] += [m["protect_cpu_s"] for m in st if m.get("protect_cpu_s") is not None]
                protect_bytes[name] += [m["protect_bytes"] for m in st if m.get("protect_bytes") is not None]
            if ddp and dp == ddp_dp and r < ddp_rounds:
                log(f"overhead: DP={dp} DDP + DCP baseline round {r + 1}/{rounds}")
                recs = ddp_round(work / f"ddp-{r}", model, dp, seg, 300.0)
                for mode in ddp_samples:
                    xs = [x["dt"] for x in recs if x["mode"] == mode]
                    ddp_samples[mode] += xs
                    ddp_per_run[mode].append(median(xs) or math.nan)
        shard = math.ceil(numel / dp)
        cfg: dict[str, Any] = {
            "dp": dp,
            "nodes": dp,
            "workers_per_node": 1,
            "model": model,
            "params": numel,
            "rounds": n_rounds,
            "steps_per_run": n_steps,
            "warmup_dropped": DROP,
            "modes": {n: summarize(samples[n], per_run[n]) for n in names},
            "ratios": {},
            "ci95": {},
            "breakdown": {},
            "bytes_per_step": {},
        }
        base = cfg["modes"]["none"]["median_s"]
        for n, (_, k, _) in zip(names[1:], modes[1:], strict=True):
            cfg["ratios"][n] = ratio(cfg["modes"][n]["median_s"], base)
            pairs = [a / b for a, b in zip(per_run[n], per_run["none"], strict=True) if b]
            cfg.setdefault("paired_round_ratios", {})[n] = [round(x, 4) for x in pairs]
            cfg.setdefault("paired_ratio_median", {})[n] = median(pairs)
            cfg["ci95"][n] = bootstrap_ratio_ci(samples[n], samples["none"])
            repl = median(jobs[n])
            wait = median(waits[n])
            cfg["breakdown"][n] = {
                "step_s": cfg["modes"][n]["median_s"],
                "compute_s": median(compute[n]),
                "local_snapshot_copy_s": 0.0,  # the optimizer writes its result into the staging half
                "replication_s": repl,
                "replication_exposed_s": wait,
                "replication_hidden_s": (max(0.0, repl - wait) if repl is not None and wait is not None else None),
                "hidden_fraction": (1 - wait / repl if repl and wait is not None else None),
            }
            cfg["bytes_per_step"][n] = {
                "local_snapshot_per_worker": 3 * shard * 4,  # param + exp_avg + exp_avg_sq, written in place
                "replicated_per_worker": 2 * shard * 4 * k,  # exp_avg + exp_avg_sq to k peers
                "replicated_total": 2 * shard * 4 * k * dp,
                "replicated_per_worker_measured": (max(job_bytes[n]) if job_bytes[n] else None),
                # as metrics.jsonl reports them (rank 0, the previous step's replication): bytes sent and
                # received, and CPU seconds of the replication thread
                "protect_bytes_per_step": median(protect_bytes[n]),
                "protect_cpu_s_per_step": median(protect_cpu[n]),
            }
        cfg["breakdown"]["none"] = {"step_s": base, "compute_s": median(compute["none"])}
        configs.append(cfg)
        if dp == 2:
            none_dp2 = samples["none"]

    result: dict[str, Any] = {
        "part": "overhead",
        "quick": quick,
        "model": model,
        "machine": machine,
        "configs": configs,
        "method": (
            "interleaved runs in one invocation, order reversed every other round; per-step dt of rank 0 "
            f"pooled after dropping the first {DROP} steps of each run; ratio of medians, 95% bootstrap CI; "
            "also the median over rounds of the per-round ratio of run medians (paired_ratio_median)"
        ),
    }
    c2 = next((c for c in configs if c["dp"] == 2), None)
    result["overhead_ratio_dp2"] = c2["ratios"].get("phoenix_r1") if c2 else None
    result["overhead_ratio_dp2_tcp"] = c2["ratios"].get("phoenix_r1_tcp") if c2 else None
    if ddp and ddp_samples["plain"]:
        plain = median(ddp_samples["plain"])
        d = {
            "dp": ddp_dp,
            "model": model,
            "segment_steps": seg,
            "modes": {m: summarize(ddp_samples[m], ddp_per_run[m]) for m in ddp_samples},
            "ratios_vs_plain_ddp": {
                "dcp_sync_every_step": ratio(median(ddp_samples["sync"]), plain),
                "dcp_async_every_step": ratio(median(ddp_samples["async"]), plain),
            },
        }
        if c2:
            none = c2["modes"]["none"]["median_s"]
            d["ratios_vs_phoenix_none"] = {
                "dcp_sync_every_step": ratio(median(ddp_samples["sync"]), none),
                "dcp_async_every_step": ratio(median(ddp_samples["async"]), none),
            }
            d["ci95_none_vs_ddp"] = bootstrap_ratio_ci(none_dp2, ddp_samples["plain"])
            result["baseline_vs_ddp_dp2"] = ratio(none, plain)
        result["ddp"] = d
    result["commands"] = {
        "harness": "python bench/overhead.py" + (" --quick" if quick else ""),
        "phoenix": f"phoenixft run --nodes DP --workers-per-node 1 --spares 0 --steps {steps} "
        f"--model {model} "
        "--protect phoenix --replicas K --quiet (phoenix_r1_tcp: --replica-transport tcp)",
        "none": f"phoenixft run --nodes DP --workers-per-node 1 --spares 0 --steps {steps} --model {model} "
        "--protect none --quiet",
        "ddp": f"torchrun --nproc-per-node 2 bench/ckpt_restart_train.py --model {model} "
        f"--schedule plain:{seg},sync:{seg},async:{seg} --ckpt-dir DIR --step-log FILE",
    }
    result["elapsed_s"] = round(time.time() - t_start, 1)
    result["loadavg_at_end"] = machine_info()["loadavg_at_start"]
    shutil.rmtree(work, ignore_errors=True)
    report(result, out)
    return result


def report(res: dict[str, Any], out: Path) -> None:
    rows = []
    for c in res["configs"]:
        for n, m in c["modes"].items():
            b = c["breakdown"].get(n, {})
            rows.append(
                [
                    f"DP={c['dp']}",
                    n,
                    m["median_s"],
                    m["p90_s"],
                    m["n"],
                    c["ratios"].get(n, 1.0 if n == "none" else None),
                    str([round(x, 3) for x in c["ci95"][n]]) if c["ci95"].get(n) else "-",
                    b.get("compute_s"),
                    b.get("replication_s"),
                    b.get("replication_exposed_s"),
                    (c["bytes_per_step"].get(n, {}).get("replicated_per_worker") or 0) / 1e6 or None,
                ]
            )
    if "ddp" in res:
        d = res["ddp"]
        for m, s in d["modes"].items():
            r = 1.0 if m == "plain" else d["ratios_vs_plain_ddp"][f"dcp_{m}_every_step"]
            rows.append(
                [
                    f"DP={d['dp']}",
                    {"plain": "ddp", "sync": "ddp+dcp.save/step", "async": "ddp+dcp.async_save/step"}[m],
                    s["median_s"],
                    s["p90_s"],
                    s["n"],
                    r,
                    "(vs ddp)",
                    None,
                    None,
                    None,
                    None,
                ]
            )
    table(
        f"Failure-free step time, model {res['model']} (median over pooled post-warm-up steps)",
        [
            "config",
            "mode",
            "median_s",
            "p90_s",
            "n",
            "ratio",
            "ci95",
            "compute_s",
            "repl_s",
            "repl_wait_s",
            "MB_repl/worker",
        ],
        rows,
    )
    print(
        f"overhead_ratio_dp2 = {res.get('overhead_ratio_dp2')} (over TCP: {res.get('overhead_ratio_dp2_tcp')})   "
        f"baseline_vs_ddp_dp2 = "
        f"{res.get('baseline_vs_ddp_dp2')}",
        flush=True,
    )
    write_json(out / "overhead.json", res)
    try:
        plot(res, out / "overhead.png")
    except Exception as e:  # noqa: BLE001 - a plot is never worth losing the numbers
        log(f"overhead: plot failed: {e}")


def plot(res: dict[str, Any], path: Path) -> None:
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(12, 4.5))
    labels, vals = [], []
    for c in res["configs"]:
        for n, m in c["modes"].items():
            labels.append(f"DP{c['dp']}\n{n}")
            vals.append(m["median_s"])
    if "ddp" in res:
        for m, s in res["ddp"]["modes"].items():
            labels.append(f"DP{res['ddp']['dp']}\nddp{'' if m == 'plain' else '+' + m}")
            vals.append(s["median_s"])
    a1.bar(range(len(vals)), vals, color="tab:blue")
    a1.set_xticks(range(len(vals)), labels, fontsize=7)
    a1.set_ylabel("median step time (s)")
    a1.set_title(f"Failure-free step time ({res['model']})")
    # Fig. 9-like breakdown
    labels, comp, rest, exposed, hidden = [], [], [], [], []
    for c in res["configs"]:
        for n, b in c["breakdown"].items():
            if n == "none":
                continue
            labels.append(f"DP{c['dp']} {n}")
            comp.append(b["compute_s"] or 0)
            exposed.append(b["replication_exposed_s"] or 0)
            rest.append(max(0.0, (b["step_s"] or 0) - (b["compute_s"] or 0) - (b["replication_exposed_s"] or 0)))
            hidden.append(b["replication_hidden_s"] or 0)
    x = range(len(labels))
    a2.bar(x, comp, label="F/B compute", color="tab:green")
    a2.bar(x, rest, bottom=comp, label="grad sync + optimizer + all-gather", color="tab:gray")
    a2.bar(
        x,
        exposed,
        bottom=[c + r for c, r in zip(comp, rest, strict=True)],
        label="replication exposed",
        color="tab:red",
    )
    a2.bar([i + 0.4 for i in x], hidden, width=0.3, label="replication hidden (bg thread)", color="tab:orange")
    a2.set_xticks(list(x), labels, fontsize=7)
    a2.set_ylabel("seconds per step (median)")
    a2.set_title("Where the time goes (cf. paper Fig. 9)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    p.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dp", type=int, action="append", default=None, help="data-parallel sizes (repeatable)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP / DCP baselines")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    run(a.quick, model=a.model, dps=a.dp, rounds=a.rounds, steps=a.steps, ddp=not a.no_ddp, out=Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
