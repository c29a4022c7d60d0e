"""Recovery scaling, as the paper's Fig. 10-11: recovery stages against world size and model size.

    python bench/scaling.py            # full: world 2, 4, 8, 16 (`tiny`); models tiny..medium at world 2
    python bench/scaling.py --quick    # world 2, 4, 8 (`tiny`); model sweep tiny, small
    python bench/scaling.py --worlds 2,4 --models tiny

Each point is one `phoenixft run --nodes W --workers-per-node 1 --spares 1 --micro-batch 1
--inject kill:node=1@step=4,phase=backward` (one node = one worker = one failure domain; a warm
spare node is promoted). From the report: detect / decide / reconfigure communicators /
restore parameters / restore optimizer / join (barrier + invariants) / first step. Two totals:
`hotswap_s` = fault until every member joined the new epoch (ready to train: detect + decide +
join), and `recovery_s` = fault until the first step after it completed (adds one step, whose
compute on this 2-core machine grows linearly with W because all W workers share two cores).
Both are fitted against W with a power law (y = a W^b, least squares in log-log; b < 1 is
sub-linear) and a log fit (y = a + b log2 W). `--micro-batch 1` keeps the per-step compute small.

Prints a table, writes bench/results/scaling.json and bench/results/scaling.png.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, plt, table, write_json
from recovery import phoenix_recovery

KILL_STEP = 4


def fit_power(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    lx = [math.log(x) for x, _ in pts]
    ly = [math.log(y) for _, y in pts]
    n = len(pts)
    mx, my = sum(lx) / n, sum(ly) / n
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ly, strict=True)) / sum((u - mx) ** 2 for u in lx)
    a = math.exp(my - b * mx)
    resid = [y - a * x**b for x, y in pts]
    return {
        "model": "y = a * W^b",
        "a": a,
        "b": b,
        "sublinear": b < 1.0,
        "rmse_s": math.sqrt(sum(r * r for r in resid) / n),
    }


def fit_log2(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    pts = [(math.log2(x), y) for x, y in zip(xs, ys, strict=True) if x > 0 and y is not None]
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    resid = [y - (a + b * x) for x, y in pts]
    return {
        "model": "y = a + b * log2(W)",
        "a": a,
        "b": b,
        "rmse_s": math.sqrt(sum(r * r for r in resid) / n),
    }


def point(work: Path, model: str, world: int) -> dict[str, Any]:
    e = phoenix_recovery(work, model=model, nodes=world, kill_step=KILL_STEP, extra_steps=1, micro_batch=1)
    st = e["stages"]
    e["hotswap_s"] = st["detect_s"] + st["decide_s"] + st["join_s"]
    return e


def run(
    quick: bool = False,
    *,
    worlds: list[int] | None = None,
    models: list[str] | None = None,
    deadline: float | None = None,
    out: Path = RESULTS,
) -> dict[str, Any]:
    """`deadline` (time.time()) makes the sweeps stop early rather than overrun (quick mode); the world
    sweep always measures at least two world sizes so that a fit exists."""
    t_start = time.time()
    machine = machine_info()
    worlds = worlds or ([2, 4, 8] if quick else [2, 4, 8, 16])
    models = models or (["tiny", "small"] if quick else ["tiny", "small", "medium"])
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    by_world: list[dict[str, Any]] = []
    by_model: list[dict[str, Any]] = []
    skipped: list[str] = []
    last = 0.0
    for w in worlds:
        if deadline is not None and len(by_world) >= 2 and time.time() + 2.2 * last > deadline:
            skipped.append(f"world {w} (quick-mode time budget)")
            continue
        log(f"scaling: world {w} (tiny, one worker per node, kill node 1)")
        t0 = time.time()
        by_world.append(point(work / f"w{w}", "tiny", w))
        last = time.time() - t0
    for m in models:
        prev = next((e for e in by_world if e["world_size"] == 2), None) if m == "tiny" else None
        if prev is not None:
            by_model.append(prev)
            continue
        if deadline is not None and time.time() + 20 > deadline:
            skipped.append(f"model {m} (quick-mode time budget)")
            continue
        log(f"scaling: model {m} (world 2)")
        by_model.append(point(work / f"m{m}", m, 2))
    ws = [float(e["world_size"]) for e in by_world]
    fits = {
        "recovery_s": {
            "power": fit_power(ws, [e["recovery_s"] for e in by_world]),
            "log2": fit_log2(ws, [e["recovery_s"] for e in by_world]),
        },
        "hotswap_s": {
            "power": fit_power(ws, [e["hotswap_s"] for e in by_world]),
            "log2": fit_log2(ws, [e["hotswap_s"] for e in by_world]),
        },
    }
    # context only (the verdict uses every W): the same fits over W <= 8, i.e. at most 4 workers per core
    small = [e for e in by_world if e["world_size"] <= 8]
    if len(small) < len(by_world) and len(small) >= 2:
        wss = [float(e["world_size"]) for e in small]
        fits["w_le_8"] = {
            "recovery_s_power": fit_power(wss, [e["recovery_s"] for e in small]),
            "hotswap_s_power": fit_power(wss, [e["hotswap_s"] for e in small]),
        }
    res: dict[str, Any] = {
        "part": "scaling",
        "quick": quick,
        "machine": machine,
        "by_world": by_world,
        "by_model": by_model,
        "fits": fits,
        "skipped": skipped,
        "recovery_sublinear": (fits["recovery_s"]["power"] or {}).get("sublinear"),
        "hotswap_sublinear": (fits["hotswap_s"]["power"] or {}).get("sublinear"),
        "commands": {
            "harness": "python bench/scaling.py" + (" --quick" if quick else ""),
            "point": "phoenixft run --nodes W --workers-per-node 1 --spares 1 --steps 5 --model M "
            f"--micro-batch 1 --inject kill:node=1@step={KILL_STEP},phase=backward",
        },
        "elapsed_s": round(time.time() - t_start, 1),
        "loadavg_at_end": machine_info()["loadavg_at_start"],
    }
    shutil.rmtree(work, ignore_errors=True)
    report(res, out)
    return res


def report(res: dict[str, Any], out: Path) -> None:
    def row(label: str, e: dict[str, Any]) -> list[Any]:
        s = e["stages"]
        return [
            label,
            e["model"],
            e["world_size"],
            s["detect_s"],
            s["decide_s"],
            s["reconfigure_s"],
            s["restore_params_s"],
            s["restore_optimizer_s"],
            s["join_s"],
            s["first_step_s"],
            e["hotswap_s"],
            e["recovery_s"],
            e["bytes_moved"] / 1e6,
        ]

    hdr = [
        "sweep",
        "model",
        "world",
        "detect",
        "decide",
        "reconf",
        "params",
        "optim",
        "join",
        "first_step",
        "hotswap_s",
        "recovery_s",
        "MB_moved",
    ]
    table(
        "Recovery stages (seconds) against world size and model size",
        hdr,
        [row("world", e) for e in res["by_world"]] + [row("model", e) for e in res["by_model"]],
    )
    for k, f in res["fits"].items():
        if k in ("recovery_s", "hotswap_s") and f["power"]:
            print(
                f"{k}: power fit a={f['power']['a']:.3f} b={f['power']['b']:.3f} "
                f"({'sub-linear' if f['power']['sublinear'] else 'NOT sub-linear'}); "
                f"log2 fit a={f['log2']['a']:.3f} b={f['log2']['b']:.3f}",
                flush=True,
            )
    if res["skipped"]:
        print("skipped: " + ", ".join(res["skipped"]), flush=True)
    write_json(out / "scaling.json", res)
    try:
        plot(res, out / "scaling.png")
    except Exception as e:  # noqa: BLE001
        log(f"scaling: plot failed: {e}")


STAGES = [
    ("detect_s", "detect", "tab:red"),
    ("decide_s", "decide", "tab:pink"),
    ("reconfigure_s", "reconfigure comms", "tab:blue"),
    ("restore_params_s", "restore params", "tab:orange"),
    ("restore_optimizer_s", "restore optimizer", "tab:green"),
    ("_rest_join", "join (rest)", "tab:purple"),
    ("first_step_s", "first step", "tab:gray"),
]


def _stack(ax: Any, entries: list[dict[str, Any]], labels: list[str]) -> None:
    bottoms = [0.0] * len(entries)
    for key, name, color in STAGES:
        vals = []
        for e in entries:
            s = e["stages"]
            if key == "_rest_join":
                v = (
                    (s["join_s"] or 0)
                    - (s["reconfigure_s"] or 0)
                    - (s["restore_params_s"] or 0)
                    - (s["restore_optimizer_s"] or 0)
                )
                vals.append(max(0.0, v))
            else:
                vals.append(s[key] or 0.0)
        ax.bar(range(len(entries)), vals, bottom=bottoms, color=color, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(range(len(entries)), labels)
    ax.set_ylabel("seconds")


def plot(res: dict[str, Any], path: Path) -> None:
    p = plt()
    fig, (a1, a2, a3) = p.subplots(1, 3, figsize=(15, 4.5))
    bw, bm = res["by_world"], res["by_model"]
    if bw:
        _stack(a1, bw, [f"W={e['world_size']}" for e in bw])
        a1.set_title("Recovery stages vs world size (tiny)")
        a1.legend(fontsize=7)
    if bm:
        _stack(a2, bm, [e["model"] for e in bm])
        a2.set_title("Recovery stages vs model size (W=2)")
    if bw:
        ws = [e["world_size"] for e in bw]
        a3.plot(ws, [e["recovery_s"] for e in bw], "o", label="recovery_s (incl. first step)")
        a3.plot(ws, [e["hotswap_s"] for e in bw], "s", label="hotswap_s (ready to train)")
        xs = [2 ** (i / 10) for i in range(10, 41)]
        for k, style in (("recovery_s", "-"), ("hotswap_s", "--")):
            f = res["fits"][k]["power"]
            if f:
                a3.plot(xs, [f["a"] * x ** f["b"] for x in xs], style, label=f"{k} fit W^{f['b']:.2f}")
        a3.set_xscale("log", base=2)
        a3.set_yscale("log")
        a3.set_xlabel("world size (workers)")
        a3.set_ylabel("seconds")
        a3.set_title("Fit against world size")
        a3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    p.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes")
    ap.add_argument("--models", default=None, help="comma-separated presets")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    run(
        a.quick,
        worlds=[int(x) for x in a.worlds.split(",")] if a.worlds else None,
        models=a.models.split(",") if a.models else None,
        out=Path(a.out),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
