"""A mesh with no spare: time to drop a data-parallel replica, step time while shrunk, time to grow back.

    python bench/mesh_shrink.py            # model `small`
    python bench/mesh_shrink.py --quick    # model `tiny`

TP=2 x PP=2 x DP=2 on 4 nodes x 2 workers, no spare, global batch 8 x 8 microbatches. Node 1 is
SIGKILLed in the backward pass of step 6: its data-parallel replica (nodes 1 and 3) leaves, node 3 is
released as a spare, nodes 0 and 2 train on as DP=1 with the whole global batch. A spare started at step
12 and node 3 make a whole column again, and the job grows back to DP=2 at a step boundary. From the same
run: the shrink's and the grow's seconds by stage (as the report records them), the median step time
before the loss, while shrunk and after the growth (warm-up and each recovery's first step dropped), and
the largest relative deviation of the loss from a failure-free run of the same configuration, per step.

Prints tables, writes bench/results/mesh_shrink.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, median, phoenix_run, ratio, table, write_json

MESH: dict[str, Any] = {"nodes": 4, "workers_per_node": 2, "tp": 2, "pp": 2, "micro_batch": 8, "microbatches": 8}
STAGES = ("detect_s", "decide_s", "reconfigure_s", "restore_params_s", "restore_optimizer_s", "join_s", "first_step_s")
KILL = "kill:node=1@step=6,phase=backward"


def _phase_steps(metrics: list[dict[str, Any]], epoch: int, drop: int) -> list[float]:
    """Step times of one epoch, without its first `drop` steps (warm-up, or the first step after a recovery)."""
    steps = sorted((m for m in metrics if m.get("epoch") == epoch), key=lambda m: m["step"])
    return [m["dt"] for m in steps[drop:]]


def run(quick: bool = False, out: Path = RESULTS) -> dict[str, Any]:
    model = "tiny" if quick else "small"
    common = {**MESH, "model": model, "steps": 30}
    res: dict[str, Any] = {"machine": machine_info(), "model": model, "layout": MESH, "fault": KILL}
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-mesh-shrink-") as tmp:
        work = Path(tmp)
        log(f"mesh shrink: failure-free reference ({model})")
        ref = phoenix_run(work / "ref", probe=False, spares=0, protect="none", **common)
        log(f"mesh shrink: shrink and grow back ({model})")
        rep = phoenix_run(work / "shrink", probe=False, spares=0, spare_arrives_at_step=12, inject=[KILL], **common)
    if rep.get("state") != "done" or ref.get("state") != "done":
        raise RuntimeError(f"mesh shrink: {rep.get('state')} {rep.get('error', '')} / {ref.get('error', '')}")
    recs = {r["action"]: r for r in rep["recoveries"]}
    if set(recs) != {"shrink", "grow"}:
        raise RuntimeError(f"mesh shrink: recoveries {[r['action'] for r in rep['recoveries']]}")
    for name, r in recs.items():
        res[name] = {"recovery_s": r["recovery_s"], "stages": r["stages"], "lost_steps": r["lost_steps"],
                     "world": r["world"], "released": r.get("released", []), "promoted": r["promoted"],
                     "invariants": r["invariants"], "resumed_step": r["resumed_step"]}
    m = rep["metrics"]
    full, shrunk, grown = (median(_phase_steps(m, e, d)) for e, d in ((0, 3), (1, 1), (2, 1)))
    res["step_time_s"] = {"full_dp2": full, "shrunk_dp1": shrunk, "grown_dp2": grown}
    res["step_time_ratio_shrunk_vs_full"] = ratio(shrunk, full)
    devs = [abs(a - b) / abs(b) for a, b in zip(rep["loss"], ref["loss"], strict=True)]
    res["loss_rel_deviation_per_step"] = devs
    res["loss_rel_deviation_max"] = max(devs)
    table(f"drop a data-parallel replica and grow back, {model}, TP2 x PP2 x DP2, global batch 8x8: seconds",
          ["stage", "shrink", "grow"],
          [[s, recs["shrink"]["stages"].get(s), recs["grow"]["stages"].get(s)] for s in STAGES]
          + [["recovery_s", recs["shrink"]["recovery_s"], recs["grow"]["recovery_s"]],
             ["lost_steps", recs["shrink"]["lost_steps"], recs["grow"]["lost_steps"]]])
    table("median step time, s", ["phase", "step s", "vs full"],
          [["full (DP=2)", full, 1.0], ["shrunk (DP=1)", shrunk, ratio(shrunk, full)],
           ["grown back (DP=2)", grown, ratio(grown, full)]])
    log(f"largest relative loss deviation from the failure-free run: {max(devs):.3g} (per step: "
        + " ".join(f"{d:.1e}" for d in devs) + ")")
    write_json(out / "mesh_shrink.json", res)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="model tiny instead of small")
    a = ap.parse_args()
    return 0 if run(a.quick) else 1


if __name__ == "__main__":
    raise SystemExit(main())
