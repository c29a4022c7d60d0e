"""A kill versus a preemption with notice, on the same job: what a notice saves.

    python bench/drain.py [--nodes 4] [--steps 30] [--step-at 12] [--notice 30] [--out bench/results/drain.json]

Two runs of the same job (`tiny`, N nodes, one warm spare, same seed):

- **kill**: `kill:node=2@step=S` (SIGKILL of the node; the fault waits until the spare is warm): the
  survivors' collectives fail, the coordinator gathers, a hot-swap replays what the replicas lack;
- **preempt**: `preempt:node=2@step=S,notice=T` (the node's agent gets its drain signal, SIGKILL after T s):
  a planned drain moves the node's role to the spare at a step boundary.

For each: detection (the fault's record to the first descriptor posted), lost steps (committed steps
replayed), training time lost (from the last step before the recovery to the first new step after it,
less one ordinary step: detection, pause and replay; a drain trains on while its notice runs), time
from the fault (the notice) to the first step completed at full strength, bytes moved,
and the final state hash (both must equal each other: the trajectory is the same). Ratios kill/preempt
are printed from this one invocation, and the JSON goes to `--out`.

`straggler_eviction` below is the marked place for the slow-node comparison (the same job with a node
slowed, with and without eviction by drain): it is not measured here.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchlib import RESULTS, fmt, machine_info, phoenix_run, ratio, table, write_json

__all__ = ["main", "straggler_eviction"]


def _one(run_dir: Path, nodes: int, steps: int, inject: str) -> dict[str, Any]:
    rep = phoenix_run(run_dir, probe=False, nodes=nodes, spares=1, steps=steps, model="tiny", inject=[inject],
                      timeout=900.0)
    recs = rep.get("recoveries") or []
    rec = recs[0] if recs else {}
    drain = rec.get("drain") or {}
    metrics = rep.get("metrics", [])
    dts = [m["dt"] for m in metrics[2:]]
    return {
        "inject": inject, "state": rep.get("state"), "final_state_sha256": rep.get("final_state_sha256"),
        "class": rec.get("class"), "action": rec.get("action"), "detect_s": rec.get("detect_s"),
        "lost_steps": rec.get("lost_steps"), "fault_to_full_strength_s": rec.get("recovery_s"),
        "notice_to_swapped_s": drain.get("notice_to_swapped_s"), "bytes_moved": rec.get("bytes_moved"),
        "stages": rec.get("stages"), "median_step_s": sorted(dts)[len(dts) // 2] if dts else None,
        "training_time_lost_s": _time_lost(metrics, sorted(dts)[len(dts) // 2] if dts else 0.0),
    }


def _time_lost(metrics: list[dict[str, Any]], step_s: float) -> float | None:
    """Wall time the recovery cost training: from the last step completed before it (the newest step of the
    first epoch) to the first step after it that goes past that one, less one ordinary step. Replayed
    steps, detection and the pause all count; steps trained while a notice ran do not."""
    before = [m for m in metrics if m.get("epoch") == 0]
    if not before:
        return None
    last = max(before, key=lambda m: m["step"])
    after = [m for m in metrics if m.get("epoch", 0) > 0 and m["step"] > last["step"]]
    if not after:
        return None
    first = min(after, key=lambda m: m["step"])
    return float(first["t_end"] - last["t_end"] - step_s)


def straggler_eviction(**kw: Any) -> dict[str, Any] | None:
    """STRAGGLER COMPARISON GOES HERE: the same job with `slow:node=I@step=S,factor=F`, once with eviction (the
    straggler drained onto the spare) and once without; median step time before, during and after. Not
    measured by this script (None): the slow-node fault and the eviction are another feature's."""
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/drain.py")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-at", type=int, default=12, help="the step of the kill / of the notice")
    ap.add_argument("--notice", type=float, default=30.0, help="seconds of notice before the SIGKILL")
    ap.add_argument("--out", default=str(RESULTS / "drain.json"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-drain-") as tmp:
        # a kill mid-replication: the node completed the step before, its replica of it was still on the way
        kill = _one(Path(tmp) / "kill", a.nodes, a.steps, f"kill:node=2@step={a.step_at},phase=replicate,wait=120")
        preempt = _one(Path(tmp) / "preempt", a.nodes, a.steps, f"preempt:node=2@step={a.step_at},notice={a.notice:g}")
    same = kill["final_state_sha256"] is not None and kill["final_state_sha256"] == preempt["final_state_sha256"]
    ratios = {"detect_s": ratio(kill["detect_s"], preempt["detect_s"]),
              "training_time_lost_s": ratio(kill["training_time_lost_s"], preempt["training_time_lost_s"]),
              "fault_to_full_strength_s": ratio(kill["fault_to_full_strength_s"], preempt["fault_to_full_strength_s"])}
    rows = [[k, fmt(kill[k]), fmt(preempt[k]), fmt(ratios.get(k))] for k in
            ("detect_s", "lost_steps", "training_time_lost_s", "fault_to_full_strength_s", "notice_to_swapped_s",
             "bytes_moved", "median_step_s")]
    print(table(f"kill vs preemption with {a.notice:g}s notice ({a.nodes} nodes, tiny, step {a.step_at} of "
                f"{a.steps}; final states {'bitwise equal' if same else 'DIFFERENT'})",
                ["", "kill", "preempt", "kill/preempt"], rows))
    config = {k: v for k, v in vars(a).items() if k != "out"}  # (where it was written is no result)
    write_json(Path(a.out), {"machine": machine_info(), "config": config, "kill": kill, "preempt": preempt,
                             "ratios_kill_over_preempt": ratios, "final_states_equal": same,
                             "straggler_eviction": straggler_eviction()})
    print(f"wrote {a.out}")
    return 0 if same and kill["state"] == preempt["state"] == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())
