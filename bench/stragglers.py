"""A slow node with and without eviction: the median step time before, during and after.

    python bench/stragglers.py            # 3 nodes + 1 spare, `tiny`, 80 steps, slow:node=1@step=20,factor=3
    python bench/stragglers.py --quick    # 40 steps, slow from step 10, window 8

Three runs of the same job (`phoenixft run --nodes 3 --spares 1 --steps N --straggler-window W`):

    clean      no fault
    evict      --inject slow:node=1@step=S,factor=F (the default --evict-stragglers)
    report     the same fault with --no-evict-stragglers

Per run the per-step times (`dt` of rank 0 in metrics.jsonl, the last record of a replayed step)
are split into phases: before (steps 3..S-1), during (S+1 up to the eviction, or to the end
without one), after (from 3 steps after the eviction to the end: the recovery's own step and
the first steps of the promoted spare are left out); the figures are each phase's median and
the ratios after/before and after/clean (the clean run's steps 3..N).

Prints a table, writes bench/results/stragglers.json.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, median, phoenix_run, ratio, table, write_json


def _dts(metrics: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for m in metrics:
        out[m["step"]] = m["dt"]
    return out


def _phases(dt: dict[int, float], slow_at: int, evicted: int | None, steps: int) -> dict[str, Any]:
    def med(lo: int, hi: int) -> float | None:
        return median([dt[s] for s in range(lo, hi + 1) if s in dt])

    before = med(3, slow_at - 1)
    during = med(slow_at + 1, (evicted or steps + 1) - 1)
    after = med(evicted + 3, steps) if evicted is not None else None
    return {"before_s": before, "during_s": during, "after_s": after, "during_over_before": ratio(during, before),
            "after_over_before": ratio(after, before)}


def run(quick: bool = False, *, out: Path = RESULTS, steps: int | None = None, slow_at: int | None = None,
        factor: float = 3.0, window: int | None = None, model: str = "tiny") -> dict[str, Any]:
    """Run the three jobs and return (and write) the result."""
    t_start = time.time()
    steps = steps or (40 if quick else 80)
    slow_at = slow_at or (10 if quick else 20)
    window = window or (8 if quick else 10)
    spec = f"slow:node=1@step={slow_at},factor={factor:g}"
    common: dict[str, Any] = {"nodes": 3, "spares": 1, "steps": steps, "model": model, "straggler_window": window}
    runs = {"clean": {}, "evict": {"inject": [spec]}, "report": {"inject": [spec], "evict_stragglers": False}}
    work = Path(tempfile.mkdtemp(prefix="bench-stragglers-"))
    res_runs: dict[str, Any] = {}
    try:
        for name, kw in runs.items():
            log(f"stragglers: {name} ({steps} steps, {spec if kw else 'no fault'})")
            rep = phoenix_run(work / name, probe=False, **common, **kw)
            if rep.get("state") != "done":
                raise RuntimeError(f"phoenixft run ({name}) failed: {rep.get('state')} {rep.get('error', '')}")
            dt = _dts(rep["metrics"])
            st = (rep.get("stragglers") or [None])[0]
            evicted = st["evicted_at_step"] if st and st.get("evicted") else None
            res_runs[name] = {
                "final_state_sha256": rep["final_state_sha256"],
                "median_s": median([dt[s] for s in range(3, steps + 1) if s in dt]),
                "straggler": st,
                **(_phases(dt, slow_at, evicted, steps) if kw else {}),
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    clean = res_runs["clean"]["median_s"]
    res_runs["evict"]["after_over_clean"] = ratio(res_runs["evict"]["after_s"], clean)
    flags = f"--nodes 3 --spares 1 --steps {steps} --model {model} --straggler-window {window} --inject {spec}"
    result: dict[str, Any] = {
        "part": "stragglers",
        "quick": quick,
        "commands": {"clean": f"phoenixft run --nodes 3 --spares 1 --steps {steps} --model {model}",
                     "evict": f"phoenixft run {flags}", "report": f"phoenixft run {flags} --no-evict-stragglers"},
        "runs": res_runs,
        "bitwise_equal": len({r["final_state_sha256"] for r in res_runs.values()}) == 1,
        "machine": machine_info(),
        "wall_s": round(time.time() - t_start, 1),
    }
    table("Step time with a slow node (median seconds)",
          ["run", "before", "during", "after", "after/before", "evicted at step", "ratio flagged"],
          [[n, r.get("before_s", r["median_s"]), r.get("during_s"), r.get("after_s"), r.get("after_over_before"),
            (r["straggler"] or {}).get("evicted_at_step"), (r["straggler"] or {}).get("ratio")]
           for n, r in res_runs.items()])
    write_json(out / "stragglers.json", result)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--slow-at", type=int)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--window", type=int)
    a = ap.parse_args()
    run(a.quick, out=a.out, steps=a.steps, slow_at=a.slow_at, factor=a.factor, window=a.window)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
