"""What the spares' health gate costs a recovery and a spare's start, on the same job in one invocation.

    python bench/health_gate.py [--quick] [--rounds R] [--out bench/results/health_gate.json]

The recovery of bench/recovery.py (`tiny`, 2 nodes, one warm spare, node 1 killed after the forward pass
of step 8, the spare promoted) under three settings of the gate, in interleaved rounds (each round runs
all three, so that they see the same load drift):

- **off**: `--no-health-gate` (spares promoted unchecked);
- **strict**: `--health-max-age 0` (every promotion waits for a check of the spare just before it, started
  when the recovery starts and run while the survivors report);
- **default**: the spare's passing check is at most `--health-max-age` old (its join check, here), so the
  promotion takes it at once; idle spares are re-checked in the background every `--health-recheck-every`.

Per run: the coordinator's decide time (`stages.decide_s`: the gather's end to the new epoch's publication;
the promotion's check is waited for there), time to resume (bench/recovery.py's definition), and how long
after the last active node's workers the spare's workers were ready (`spare_ready_lag_s`, read live from
the control plane: the join check runs while the spare's workers start, and must not hold them). Medians per
setting, and their ratios to `off`, printed and written to `--out`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS, fmt, log, machine_info, median, ratio, table, write_json
from recovery import phoenix_recovery

__all__ = ["SETTINGS", "run"]

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"health_gate": False},
    "strict": {"health_max_age": 0.0},
    "default": {},
}


def _watch_ready(run_dir: Path, nodes: int, out: dict[str, float], stop: threading.Event) -> None:
    """Record when each node's worker announced itself ready (keys.ready: its wall time), read live."""
    from phoenixft.controlplane import keys
    from phoenixft.observe.status import connect

    port = run_dir / "coordinator.port"
    while not stop.is_set() and not (port.exists() and port.read_text().strip()):
        time.sleep(0.02)
    if stop.is_set():
        return
    store = connect(f"127.0.0.1:{port.read_text().strip()}", 10.0)
    want = [f"n{i}.0" for i in range(nodes)] + ["s0.0"]
    while not stop.is_set() and len(out) < len(want):
        for w in want:
            if w not in out and store.check([keys.ready(w)]):
                out[w] = float(store.get(keys.ready(w)))
        time.sleep(0.01)


def _one(work: Path, setting: str, nodes: int) -> dict[str, Any]:
    ready: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_ready, args=(work, nodes, ready, stop), daemon=True)
    watcher.start()
    try:
        e = phoenix_recovery(work, model="tiny", nodes=nodes, **SETTINGS[setting])
    finally:
        stop.set()
        watcher.join(timeout=10)
    actives = [ready[f"n{i}.0"] for i in range(nodes) if f"n{i}.0" in ready]
    lag = ready["s0.0"] - max(actives) if "s0.0" in ready and len(actives) == nodes else None
    spares = {s["node"]: s for s in ((e.get("health") or {}).get("spares") or [])}
    return {"setting": setting, "decide_s": e["stages"].get("decide_s"), "time_to_resume_s": e["time_to_resume_s"],
            "hotswap_s": e["hotswap_s"], "action": e["action"], "promoted": e.get("promoted"),
            "spare_ready_lag_s": lag, "spare_check": spares.get("s0")}


def run(quick: bool = False, rounds: int = 0, out: Path = RESULTS / "health_gate.json") -> dict[str, Any]:
    rounds = rounds or (3 if quick else 5)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-health-") as tmp:
        for r in range(rounds):
            for setting in SETTINGS:
                log(f"health gate: {setting}, round {r + 1}/{rounds}")
                runs.append(_one(Path(tmp) / f"{setting}-{r}", setting, nodes=2))
    summary: dict[str, dict[str, Any]] = {}
    for setting in SETTINGS:
        mine = [x for x in runs if x["setting"] == setting]
        summary[setting] = {k: median([x[k] for x in mine if x[k] is not None])
                            for k in ("decide_s", "time_to_resume_s", "spare_ready_lag_s")}
        summary[setting]["actions"] = sorted({x["action"] for x in mine})
    for setting in ("strict", "default"):
        for k in ("decide_s", "time_to_resume_s"):
            summary[setting][f"{k}_vs_off"] = ratio(summary[setting][k], summary["off"][k])
    res = {"machine": machine_info(), "rounds": rounds, "summary": summary, "runs": runs,
           "command": "python bench/health_gate.py" + (" --quick" if quick else "")}
    table("The health gate's cost (tiny, DP=2, one kill; medians)",
                ["setting", "decide s", "resume s", "spare ready after actives s", "actions"],
                [[s, fmt(v["decide_s"]), fmt(v["time_to_resume_s"]), fmt(v["spare_ready_lag_s"]),
                  ",".join(v["actions"])] for s, v in summary.items()])
    write_json(out, res)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 5")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "health_gate.json"))
    a = ap.parse_args()
    res = run(a.quick, a.rounds, Path(a.out))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
