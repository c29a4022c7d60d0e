"""What each redundancy scheme costs, measured: host memory per node, bytes per step, step time.

    python bench/redundancy.py [--model small] [--nodes 8] [--steps 14] [--rounds 2] [--quick]

One invocation runs, `--rounds` times, the same job (`--nodes` nodes x 1 worker, no spare) with
`--protect none` and with each of `--redundancy replicas:1, replicas:2, ec:4+1, ec:4+2`, in reversed
order every other round to cancel drift. For each run:

- host memory per node: a thread samples the sizes of the run's shared-memory segments every
  0.2 s (`/dev/shm/phoenixft-<run>-<node>.*`: parameter ping-pong buffers, optimizer-shard halves,
  replica or parity holdings: the retained state) and keeps each node's largest total; the
  table gives the largest node and the mean over nodes;
- bytes on the network per step: rank 0's measured protection bytes (`protect_bytes` in
  metrics.jsonl) and, for all ranks, the estimator's figure (`phoenixft run --dry-run`), which
  the test suite checks against the real allocations;
- failure-free overhead: the median step time (`dt` of rank 0, the first 3 steps dropped) of
  the runs of a mode, pooled over rounds, divided by that of `--protect none`; and, less at the
  mercy of other jobs on a shared machine, what rank 0's protection job cost per step: the CPU
  seconds its thread spent (copies, checksums, encoding, sends) and how long the training loop
  waited for it before the gradient reduction (`repl_wait_s`: the critical-path part).

Writes bench/results/redundancy.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import RESULTS, log, machine_info, phoenix_run, steady, table, write_json  # noqa: E402

SHM = Path("/dev/shm")
MODES = ["none", "replicas:1", "replicas:2", "ec:4+1", "ec:4+2"]


class ShmSampler:
    """Largest total size of each (run, node)'s segments seen while it runs."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period = period_s
        self.peak: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ShmSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now: dict[tuple[str, str], int] = {}
            for p in SHM.glob("phoenixft-*-*"):
                rest = p.name[len("phoenixft-") :]
                run, _, seg = rest.partition("-")
                node = seg.split(".", 1)[0]
                try:
                    now[(run, node)] = now.get((run, node), 0) + p.stat().st_size
                except OSError:
                    pass
            for k, v in now.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self._stop.wait(self.period)

    def nodes_of(self, run_id: str) -> dict[str, int]:
        return {node: v for (run, node), v in self.peak.items() if run == run_id and node.startswith("n")}


def one(tmp: Path, mode: str, a: argparse.Namespace, rnd: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"nodes": a.nodes, "spares": 0, "steps": a.steps, "model": a.model, "probe": False}
    if mode == "none":
        kw["protect"] = "none"
    else:
        kw["redundancy"] = mode
    with ShmSampler() as smp:
        rep = phoenix_run(tmp / f"r{rnd}-{mode.replace(':', '_')}", **kw)
    if rep.get("state") != "done":
        raise RuntimeError(f"{mode}: {rep.get('state')} {rep.get('error')}")
    mets = steady(rep["metrics"])
    per_node = smp.nodes_of(rep["run_id"])
    return {"mode": mode, "round": rnd, "dts": [m["dt"] for m in mets],
            "wait": [m.get("repl_wait_s", 0.0) for m in mets], "cpu": [m.get("protect_cpu_s", 0.0) for m in mets],
            "protect_bytes_rank0": statistics.median([m.get("protect_bytes", 0) for m in mets]) if mets else 0,
            "shm_per_node": per_node, "sha": rep["final_state_sha256"]}


def estimates(a: argparse.Namespace) -> dict[str, Any]:
    from phoenixft.config import RunConfig
    from phoenixft.protect.redundancy.estimate import estimate_config

    out = {}
    for mode in MODES:
        cfg = RunConfig(nodes=a.nodes, spares=0, steps=a.steps, model=a.model,
                        **({"protect": "none"} if mode == "none" else {"redundancy": mode}))
        cfg.validate()
        est = estimate_config(cfg)
        out[mode] = {"retained_max": max(c.retained for c in est.nodes),
                     "retained_mean": statistics.mean(c.retained for c in est.nodes),
                     "protection_max": max(c.protection for c in est.nodes),
                     "protection_mean": statistics.mean(c.protection for c in est.nodes),
                     "total_max": max(c.total for c in est.nodes),
                     "send_per_rank_max": max(est.send_per_rank or [0]),
                     "payload_bytes": est.payload_bytes,
                     "groups": [[list(g.members), list(g.parity)] for g in est.groups]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny, 6 nodes, 8 steps, 1 round")
    ap.add_argument("--out", default=str(RESULTS / "redundancy.json"))
    a = ap.parse_args()
    if a.quick:
        a.model, a.nodes, a.steps, a.rounds = "tiny", 6, 8, 1
    import os
    import tempfile

    t0 = time.time()
    load0 = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-red-") as tmp:
        for rnd in range(a.rounds):
            order = MODES if rnd % 2 == 0 else list(reversed(MODES))
            for mode in order:
                log(f"round {rnd + 1}/{a.rounds}: {mode}")
                runs.append(one(Path(tmp), mode, a, rnd))
    est = estimates(a)
    base = statistics.median([d for r in runs if r["mode"] == "none" for d in r["dts"]])
    rows, res = [], {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        med = statistics.median([d for r in rs for d in r["dts"]])
        nodes: dict[str, int] = {}
        for r in rs:
            for n, v in r["shm_per_node"].items():
                nodes[n] = max(nodes.get(n, 0), v)
        mx, mean = (max(nodes.values()), statistics.mean(nodes.values())) if nodes else (0, 0)
        e = est[mode]
        res[mode] = {"step_s_median": med, "overhead_ratio": med / base, "shm_per_node_max": mx,
                     "shm_per_node_mean": mean, "shm_per_node": nodes, "estimate": e,
                     "protect_bytes_rank0": statistics.median([r["protect_bytes_rank0"] for r in rs]),
                     "protect_cpu_s_median": statistics.median([c for r in rs for c in r["cpu"]] or [0.0]),
                     "repl_wait_s_median": statistics.median([c for r in rs for c in r["wait"]] or [0.0]),
                     "hashes": sorted({r["sha"] for r in rs})}
        mib = 2**20
        rows.append([mode, f"{mx / mib:.1f}", f"{mean / mib:.1f}", f"{e['protection_max'] / mib:.1f}",
                     f"{e['protection_mean'] / mib:.1f}", f"{res[mode]['protect_bytes_rank0'] / mib:.1f}",
                     f"{e['send_per_rank_max'] / mib:.1f}", f"{med:.3f}", f"{med / base:.3f}",
                     f"{res[mode]['protect_cpu_s_median'] * 1e3:.0f}", f"{res[mode]['repl_wait_s_median'] * 1e3:.0f}"])
    table(f"redundancy schemes on {a.model}, {a.nodes} nodes x 1 worker, {a.steps} steps, {a.rounds} round(s)",
                ["mode", "shm/node max MiB", "mean", "protection max", "mean", "sent/step rank0 MiB",
                 "sent/step max rank", "step s", "vs none", "protect cpu ms", "loop waited ms"], rows)  # prints it
    hashes = {h for v in res.values() for h in v["hashes"]}
    print(f"final state identical across all runs: {len(hashes) == 1}")
    write_json(Path(a.out), {"machine": machine_info(), "model": a.model, "nodes": a.nodes, "steps": a.steps,
                             "rounds": a.rounds, "wall_s": time.time() - t0, "load_avg_start": load0,
                             "load_avg_end": os.getloadavg()[0], "results": res})
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
