"""How many keys the control-plane store holds at the end of a run, by the run's length: the default window of
step records (--store-step-records 256), a small one (34: --spike-window 32 + 2), and every record kept (a
window longer than the run: what the store held before records were deleted).

    python bench/store_keys.py            # runs of 200 and 2,000 steps (nano, 2 nodes + 1 spare)
    python bench/store_keys.py --quick    # 200 steps only

Each run's report says `store.keys` (num_keys() just before the report; the teardown then removes the job's
keys) and `store.step_records_from`. Prints a table, writes bench/results/store_keys.json.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import REPO, RESULTS, log, machine_info, phoenix_run, table, write_json

sys.path.insert(0, str(REPO / "src"))

ALL = 1 << 30  # a window longer than any run: every step record stays


def one(steps: int, kept: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="phoenixft-bench-keys-") as d:
        rep = phoenix_run(Path(d) / "run", probe=False, nodes=2, spares=1, steps=steps, model="nano", micro_batch=2,
                          store_step_records=kept)
    store = rep.get("store") or {}
    held = steps - int(store.get("step_records_from") or 1) + 1
    return {"steps": steps, "store_step_records": kept if kept != ALL else "all", "state": rep.get("state"),
            "keys": store.get("keys"), "step_records": held, "report_steps": len(rep.get("loss") or []),
            "recoveries": len(rep.get("recoveries") or [])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    rows = []
    for steps in (200,) if a.quick else (200, 2000):
        for kept in (ALL, 256, 34):
            log(f"{steps} steps, --store-step-records {kept if kept != ALL else 'all'}")
            rows.append(one(steps, kept))
    print(table("keys in the control-plane store at the end of a run",
                ["steps", "--store-step-records", "keys", "step records", "steps in the report", "recoveries"],
                [[r["steps"], r["store_step_records"], r["keys"], r["step_records"], r["report_steps"], r["recoveries"]]
                 for r in rows]))
    write_json(RESULTS / "store_keys.json", {"machine": machine_info(), "runs": rows,
                                             "date": datetime.date.today().isoformat()})


if __name__ == "__main__":
    main()
