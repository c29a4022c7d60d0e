"""Failure-free cost of each training-recipe feature on the step time, in one invocation.

    python bench/recipe.py            # full: `small`, DP=2, 3 rounds of 10 steps per mode
    python bench/recipe.py --quick    # `tiny`, DP=2, 2 rounds of 8 steps (about a minute idle)
    python bench/recipe.py --model tiny --rounds 1 --steps 5     # any size by hand

Modes (each `phoenixft run --nodes 2 --workers-per-node 1 --spares 0 --protect phoenix
--replicas 1 --steps T --model M` plus):

    baseline   (nothing: fp32, adamw, constant lr, no clipping)
    bf16       --precision bf16
    clip       --clip-grad-norm 1.0
    sgd        --optimizer sgd
    lion       --optimizer lion
    cosine     --lr-schedule cosine --warmup-steps 2

Method, as bench/overhead.py ("same run, interleaved"): R rounds; each round runs every mode
once with otherwise identical configuration, in reversed order every other round to cancel
drift. Per mode the per-step times (`dt` of rank 0 in metrics.jsonl) of all its runs are
pooled after dropping the first 3 steps of each run (warm-up); the figure is the ratio of the
mode's pooled median to the baseline's, with a 95% bootstrap interval, and next to it the
median over rounds of the per-round ratio of run medians (`paired_ratio_median`).

Caveat: on a CPU without bf16 matrix units (the 2-core Intel Xeon this was measured on has no
AMX tiles, only AVX-512 BF16 dot-product instructions) bf16 steps are slower than fp32; the bf16
ratio here says nothing about a GPU.

Prints a table, writes bench/results/recipe.json and bench/results/recipe.png.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (
    RESULTS,
    bootstrap_ratio_ci,
    log,
    machine_info,
    median,
    pct,
    phoenix_run,
    plt,
    ratio,
    steady,
    table,
    write_json,
)

DROP = 3

#: mode name -> (RunConfig overrides, the command-line flags they stand for)
MODES: dict[str, tuple[dict[str, Any], str]] = {
    "baseline": ({}, ""),
    "bf16": ({"precision": "bf16"}, "--precision bf16"),
    "clip": ({"clip_grad_norm": 1.0}, "--clip-grad-norm 1.0"),
    "sgd": ({"optimizer": "sgd"}, "--optimizer sgd"),
    "lion": ({"optimizer": "lion"}, "--optimizer lion"),
    "cosine": ({"lr_schedule": "cosine", "warmup_steps": 2}, "--lr-schedule cosine --warmup-steps 2"),
}


def run(
    quick: bool = False,
    *,
    model: str | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    modes: list[str] | None = None,
    out: Path = RESULTS,
) -> dict[str, Any]:
    """Run the interleaved rounds and return (and write) the result."""
    t_start = time.time()
    machine = machine_info()
    model = model or ("tiny" if quick else "small")
    rounds = rounds or (2 if quick else 3)
    steps = steps or (8 if quick else 10)
    names = modes or list(MODES)
    if names[0] != "baseline":
        names = ["baseline", *[n for n in names if n != "baseline"]]
    work = Path(tempfile.mkdtemp(prefix="bench-recipe-"))
    samples: dict[str, list[float]] = {n: [] for n in names}
    per_run: dict[str, list[float]] = {n: [] for n in names}
    compute: dict[str, list[float]] = {n: [] for n in names}
    try:
        for r in range(rounds):
            order = names[::-1] if r % 2 else names
            for name in order:
                log(f"recipe: {name} round {r + 1}/{rounds} ({model}, {steps} steps)")
                rep = phoenix_run(
                    work / f"{name}-{r}",
                    probe=False,
                    nodes=2,
                    workers_per_node=1,
                    spares=0,
                    steps=steps,
                    model=model,
                    protect="phoenix",
                    replicas=1,
                    **MODES[name][0],
                )
                if rep.get("state") != "done":
                    raise RuntimeError(f"phoenixft run ({name}) failed: {rep.get('state')} {rep.get('error', '')}")
                st = steady(rep["metrics"], DROP)
                dts = [m["dt"] for m in st]
                samples[name] += dts
                per_run[name].append(median(dts) or math.nan)
                compute[name] += [m["compute_s"] for m in st if "compute_s" in m]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = median(samples["baseline"])
    res_modes: dict[str, Any] = {}
    for n in names:
        pairs = [a / b for a, b in zip(per_run[n], per_run["baseline"], strict=True) if b]
        res_modes[n] = {
            "flags": MODES[n][1],
            "median_s": median(samples[n]),
            "p90_s": pct(samples[n], 0.9),
            "compute_median_s": median(compute[n]),
            "n": len(samples[n]),
            "run_medians_s": [round(x, 5) for x in per_run[n]],
            "ratio": 1.0 if n == "baseline" else ratio(median(samples[n]), base),
            "ci95": None if n == "baseline" else bootstrap_ratio_ci(samples[n], samples["baseline"]),
            "paired_round_ratios": [round(x, 4) for x in pairs],
            "paired_ratio_median": median(pairs),
        }
    cmd = (
        f"phoenixft run --nodes 2 --workers-per-node 1 --spares 0 --protect phoenix --replicas 1 "
        f"--steps {steps} --model {model} --quiet"
    )
    result: dict[str, Any] = {
        "part": "recipe",
        "quick": quick,
        "model": model,
        "dp": 2,
        "rounds": rounds,
        "steps_per_run": steps,
        "warmup_dropped": DROP,
        "machine": machine,
        "modes": res_modes,
        "method": (
            "interleaved runs in one invocation, order reversed every other round; per-step dt of rank 0 "
            f"pooled after dropping the first {DROP} steps of each run; ratio of medians to the baseline "
            "(fp32 adamw, constant lr, no clipping), 95% bootstrap CI; also the median over rounds of the "
            "per-round ratio of run medians (paired_ratio_median)"
        ),
        "caveat": (
            "bf16 on a CPU without bf16 matrix units (no AMX tiles) is slower than fp32: its ratio here says "
            "nothing about a GPU"
        ),
        "commands": {
            "harness": "python bench/recipe.py" + (" --quick" if quick else ""),
            **{n: f"{cmd} {MODES[n][1]}".rstrip() for n in names},
        },
    }
    result["elapsed_s"] = round(time.time() - t_start, 1)
    result["loadavg_at_end"] = machine_info()["loadavg_at_start"]
    report(result, out)
    return result


def report(res: dict[str, Any], out: Path) -> None:
    rows = [
        [
            n,
            m["flags"] or "(fp32 adamw)",
            m["median_s"],
            m["p90_s"],
            m["n"],
            m["ratio"],
            str([round(x, 3) for x in m["ci95"]]) if m["ci95"] else "-",
            m["paired_ratio_median"],
        ]
        for n, m in res["modes"].items()
    ]
    table(
        f"Recipe features, failure-free step time, model {res['model']}, DP=2, --protect phoenix "
        f"(median over pooled post-warm-up steps; {res['rounds']} interleaved rounds)",
        ["mode", "flags", "median_s", "p90_s", "n", "ratio", "ci95", "paired"],
        rows,
    )
    print(f"note: {res['caveat']}", flush=True)
    write_json(out / "recipe.json", res)
    try:
        plot(res, out / "recipe.png")
    except Exception as e:  # noqa: BLE001 - a plot is never worth losing the numbers
        log(f"recipe: plot failed: {e}")


def plot(res: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    names = [n for n in res["modes"] if n != "baseline"]
    ratios = [res["modes"][n]["ratio"] or math.nan for n in names]
    lo = [r - (res["modes"][n]["ci95"] or [r, r])[0] for n, r in zip(names, ratios, strict=True)]
    hi = [(res["modes"][n]["ci95"] or [r, r])[1] - r for n, r in zip(names, ratios, strict=True)]
    fig, ax = pyplot.subplots(figsize=(6, 3.2))
    ax.bar(names, ratios, yerr=[lo, hi], capsize=4, color="#4a7fb5")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("median step time / baseline")
    ax.set_title(f"Recipe features, {res['model']}, DP=2 (95% bootstrap CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 rounds of 8 steps")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--modes", default="", help=f"comma-separated subset of {', '.join(MODES)} (baseline always runs)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m] or None
    for m in modes or []:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; one of {', '.join(MODES)}")
    run(a.quick, model=a.model, rounds=a.rounds, steps=a.steps, modes=modes, out=Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
