"""What scrubbing the held copies costs per step, against the same job unscrubbed, in one invocation.

    python bench/scrub.py [--model small] [--nodes 4] [--steps 30] [--rounds 2] [--every 0,1,4] [--quick]

One invocation runs, `--rounds` times, the same job (`--nodes` nodes x 1 worker, no spare, replicas:1)
with each `--scrub-every` value of `--every` (0 = off, the baseline), in reversed order every other
round to cancel drift. Per mode, pooled over rounds, with the first 3 steps dropped:

- step time: the median step time of rank 0 (`dt`), and its ratio to the unscrubbed runs' median
  (`vs_off`): the figure the default is chosen on, at the mercy of other jobs on a shared machine;
- scrub cost: what rank 0's scrubber itself spent per step (`scrub_s`: wall seconds of its share of
  the pass and of the job's repair round, on the replication thread, off the training loop's critical
  path; the round's all-reduce waits for every rank to reach its protection job, a wait the job's first
  exchange would otherwise make, so the CPU seconds `scrub_cpu_s` are the cost) and the bytes it re-hashed
  (`scrub_bytes`), as a fraction of the median step time (`scrub_share`): the part of the ratio that is
  the scrubber's, measured in the run rather than inferred from two runs' noise;
- how long the training loop waited for the protection job before its gradient reduction
  (`repl_wait_s`, the critical-path part: the scrub runs before that job's replication).

Every run's final state must be identical (scrubbing changes no byte of a good copy).
Writes bench/results/scrub.json. `measure(...)` is importable (a sibling benchmark reuses it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import RESULTS, log, machine_info, phoenix_run, steady, table, write_json  # noqa: E402

__all__ = ["measure"]


def _one(tmp: Path, every: int, rnd: int, kw: dict[str, Any]) -> dict[str, Any]:
    rep = phoenix_run(tmp / f"r{rnd}-every{every}", scrub_every=every, **kw)
    if rep.get("state") != "done":
        raise RuntimeError(f"--scrub-every {every}: {rep.get('state')} {rep.get('error')}")
    mets = steady(rep["metrics"])
    return {"every": every, "round": rnd, "dts": [m["dt"] for m in mets],
            "scrub_s": [m.get("scrub_s", 0.0) for m in mets], "scrub_cpu_s": [m.get("scrub_cpu_s", 0.0) for m in mets],
            "scrub_bytes": [m.get("scrub_bytes", 0) for m in mets],
            "wait": [m.get("repl_wait_s", 0.0) for m in mets], "sha": rep["final_state_sha256"],
            "found": rep.get("scrub", {}).get("found", 0)}


def measure(modes: list[int], rounds: int, **kw: Any) -> dict[str, Any]:
    """Run the job of `kw` (phoenix_run's keywords) once per --scrub-every value of `modes` per round (the
    first mode is the baseline) and return per-mode medians and ratios to the baseline."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-scrub-") as tmp:
        for rnd in range(rounds):
            for every in modes if rnd % 2 == 0 else list(reversed(modes)):
                log(f"round {rnd + 1}/{rounds}: --scrub-every {every}")
                runs.append(_one(Path(tmp), every, rnd, kw))
    base = statistics.median([d for r in runs if r["every"] == modes[0] for d in r["dts"]])
    res: dict[str, Any] = {}
    for every in modes:
        rs = [r for r in runs if r["every"] == every]
        med = statistics.median([d for r in rs for d in r["dts"]])
        scrub_s = statistics.median([x for r in rs for x in r["scrub_s"]] or [0.0])
        cpu_s = statistics.median([x for r in rs for x in r["scrub_cpu_s"]] or [0.0])
        res[str(every)] = {"step_s_median": med, "vs_off": med / base, "scrub_s_median": scrub_s,
                           "scrub_bytes_median": statistics.median([x for r in rs for x in r["scrub_bytes"]] or [0]),
                           "scrub_cpu_s_median": cpu_s, "scrub_share": scrub_s / med, "scrub_cpu_share": cpu_s / med,
                           "repl_wait_s_median":
                           statistics.median([x for r in rs for x in r["wait"]] or [0.0]),
                           "found": sum(r["found"] for r in rs), "hashes": sorted({r["sha"] for r in rs})}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", default="0,1,4", help="--scrub-every values, the first the baseline (0 = off)")
    ap.add_argument("--quick", action="store_true", help="tiny, 3 nodes, 10 steps, 1 round")
    ap.add_argument("--out", default=str(RESULTS / "scrub.json"))
    a = ap.parse_args()
    if a.quick:
        a.model, a.nodes, a.steps, a.rounds = "tiny", 3, 10, 1
    modes = [int(x) for x in a.every.split(",")]
    t0, load0 = time.time(), os.getloadavg()[0]
    res = measure(modes, a.rounds, nodes=a.nodes, spares=0, steps=a.steps, model=a.model, probe=False)
    rows = [[m, f"{v['step_s_median'] * 1e3:.1f}", f"{v['vs_off']:.3f}", f"{v['scrub_s_median'] * 1e3:.2f}",
             f"{v['scrub_cpu_s_median'] * 1e3:.2f}", f"{v['scrub_bytes_median'] / 2**20:.1f}",
             f"{v['scrub_share'] * 100:.2f}%", f"{v['scrub_cpu_share'] * 100:.2f}%",
             f"{v['repl_wait_s_median'] * 1e3:.1f}", v["found"]] for m, v in res.items()]
    table(f"scrubbing on {a.model}, {a.nodes} nodes x 1 worker, {a.steps} steps, {a.rounds} round(s)",
          ["--scrub-every", "step ms", "vs off", "scrub ms/step", "scrub CPU ms/step", "re-hashed MiB/step",
           "scrub wall/step", "scrub CPU/step",
           "loop waited ms", "found"], rows)
    hashes = {h for v in res.values() for h in v["hashes"]}
    print(f"final state identical across all runs: {len(hashes) == 1}")
    write_json(Path(a.out), {"machine": machine_info(), "model": a.model, "nodes": a.nodes, "steps": a.steps,
                             "rounds": a.rounds, "modes": modes, "wall_s": time.time() - t0, "load_avg_start": load0,
                             "load_avg_end": os.getloadavg()[0], "results": res})
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
