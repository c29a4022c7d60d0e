"""Measurement probe: the built-in GPT workload, plus a record of every replication job.

Used as `--workload phoenix_probe:workload` (with bench/ on PYTHONPATH) by the benchmark runs,
for both `--protect none` and `--protect phoenix`, so that both modes run identical code. The
model, loss and batches are exactly `phoenixft.train.gpt.workload`'s. The only addition: in each worker
process the background replication job (`Replicator._replicate`) is wrapped with a timer that
appends {pid, step, t0, t1, seconds, bytes} to `$PHOENIXFT_BENCH_PROBE/repl-<pid>.jsonl`, so the
harness can report how long replication took and how much of it was hidden behind compute
(phoenixft's per-step record only has the part the training loop waited for, `repl_wait_s`).

Not run directly.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from phoenixft.workload import Workload, WorkloadContext

_PATCHED = False


def _patch() -> None:
    global _PATCHED
    out_dir = os.environ.get("PHOENIXFT_BENCH_PROBE")
    if _PATCHED or not out_dir:
        return
    from phoenixft.protect import replication
    orig = getattr(replication.Replicator, "_replicate", None)
    if orig is None:  # phoenixft changed: no breakdown, but the workload itself is untouched
        return

    def timed(self: Any, step: int) -> None:
        t0 = time.time()
        p0 = time.perf_counter()
        stats = getattr(self, "stats", None)
        bytes0 = getattr(stats, "bytes_sent", 0)
        orig(self, step)
        rec = {
            "pid": os.getpid(),
            "step": step,
            "t0": t0,
            "t1": time.time(),
            "seconds": time.perf_counter() - p0,
            "bytes": getattr(stats, "bytes_sent", 0) - bytes0,
        }
        with open(os.path.join(out_dir, f"repl-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    replication.Replicator._replicate = timed
    _PATCHED = True


def workload(ctx: WorkloadContext) -> Workload:
    from phoenixft.train.gpt import workload as gpt_workload

    _patch()
    return gpt_workload(ctx)
