"""3D parallelism: failure-free step time and hot-swap time by stage, 3D mesh next to data-parallel only.

    python bench/mesh.py            # model `small`
    python bench/mesh.py --quick    # model `tiny`

Both layouts run the same model on the same 8 workers (4 nodes x 2) with the same global batch
(micro-batch 8 x 8 microbatches): `dp` is DP=8, `3d` is TP=2 x PP=2 x DP=2 (a node holds one
tensor-parallel group; the 8 microbatches go 4 per data-parallel rank through a 2-stage 1F1B
pipeline). Failure-free runs alternate dp, 3d, dp, 3d in one invocation (the machine is shared:
ratios come from the same run); the step time is the median after the warm-up. Then one hot-swap
per layout: node 1 SIGKILLed after the forward pass of step 8, a warm spare promoted; the
recovery's stages as the report records them (detect, decide, reconfigure = the new epoch's
process groups, restore_params, restore_optimizer, join = until every member passed the
invariants, first_step = the first step after the recovery).

Prints tables, writes bench/results/mesh.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, median, phoenix_run, ratio, steady, table, write_json

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {"nodes": 4, "workers_per_node": 2, "tp": 1, "pp": 1},
    "3d": {"nodes": 4, "workers_per_node": 2, "tp": 2, "pp": 2},
}
STAGES = ("detect_s", "decide_s", "reconfigure_s", "restore_params_s", "restore_optimizer_s", "join_s", "first_step_s")


def _common(model: str, steps: int) -> dict[str, Any]:
    return {"model": model, "steps": steps, "micro_batch": 8, "microbatches": 8, "protect": "phoenix"}


def step_times(work: Path, model: str, steps: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    for i in range(rounds):
        for name, lay in LAYOUTS.items():
            log(f"mesh: failure-free {name} round {i + 1}/{rounds} ({model})")
            rep = phoenix_run(work / f"ff-{name}-{i}", probe=False, spares=0, **lay, **_common(model, steps))
            if rep.get("state") != "done":
                raise RuntimeError(f"{name}: {rep.get('error')}")
            out[name] += [m["dt"] for m in steady(rep["metrics"])]
    return out


def hotswap(work: Path, name: str, model: str) -> dict[str, Any]:
    log(f"mesh: hot-swap {name} ({model})")
    spec = "kill:node=1@step=8,phase=backward,wait=60"
    rep = phoenix_run(work / f"hs-{name}", probe=False, spares=1, inject=[spec], **LAYOUTS[name], **_common(model, 11))
    if rep.get("state") != "done" or not rep.get("recoveries"):
        raise RuntimeError(f"{name} hot-swap: {rep.get('state')} {rep.get('error', '')}")
    rec = rep["recoveries"][0]
    return {"layout": name, "action": rec["action"], "recovery_s": rec["recovery_s"], "stages": rec["stages"],
            "bytes_moved": rec["bytes_moved"], "lost_steps": rec["lost_steps"], "invariants": rec["invariants"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="model tiny instead of small")
    a = ap.parse_args()
    return 0 if run(a.quick) else 1


def run(quick: bool = False, out: Path = RESULTS) -> dict[str, Any]:
    model = "tiny" if quick else "small"
    res: dict[str, Any] = {"machine": machine_info(), "model": model, "layouts": LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-mesh-") as tmp:
        work = Path(tmp)
        dts = step_times(work, model, steps=12, rounds=2)
        res["step_time_s"] = {k: median(v) for k, v in dts.items()}
        res["step_time_ratio_3d_vs_dp"] = ratio(res["step_time_s"]["3d"], res["step_time_s"]["dp"])
        res["hotswap"] = {k: hotswap(work, k, model) for k in LAYOUTS}
    st = res["step_time_s"]
    table(f"failure-free step time, {model}, 8 workers, global batch 8x8",
                ["layout", "step s", "vs dp"],
                [[k, st[k], ratio(st[k], st["dp"])] for k in LAYOUTS])
    hs = res["hotswap"]
    table(f"hot-swap of node 1 at step 8, {model}: seconds by stage",
                ["stage", *LAYOUTS], [[s, *(hs[k]["stages"].get(s) for k in LAYOUTS)] for s in STAGES]
                + [["recovery_s", *(hs[k]["recovery_s"] for k in LAYOUTS)],
                   ["bytes_moved", *(hs[k]["bytes_moved"] for k in LAYOUTS)]])
    write_json(out / "mesh.json", res)
    return res


if __name__ == "__main__":
    raise SystemExit(main())
