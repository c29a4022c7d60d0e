"""The persistent tier: periodic torch.distributed.checkpoint (DCP) checkpoints, off the critical path.

Every `--persist-every K` steps each rank saves its optimizer shard (rows: param, exp_avg,
exp_avg_sq) as it was *committed* in memory: the replication thread copies the committed half
(which stays untouched until that thread finishes), and a persist thread writes it with
`dcp.save` to `DIR/step_<s>/rank<i>`. The last rank to finish writes `DIR/step_<s>/MANIFEST.json`
(atomically, last), so a torn checkpoint is never loaded: only directories with a manifest count.

Loading reassembles the full parameter and optimizer vectors in logical order from every shard
file, so a checkpoint written by D ranks loads onto any other number (resharding).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from phoenixft.snapshot import checksum

__all__ = ["Persister", "latest_manifest", "load_full"]

KEEP = 2  # complete checkpoints kept on disk


def _quiet() -> Any:
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.simplefilter("ignore")
    return cm


def latest_manifest(root: str | os.PathLike[str], max_step: int | None = None) -> dict[str, Any] | None:
    """The newest complete checkpoint under `root` (optionally at or before `max_step`)."""
    best = None
    for m in Path(root).glob("step_*/MANIFEST.json"):
        try:
            man = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        if max_step is not None and man["step"] > max_step:
            continue
        if best is None or man["step"] > best["step"]:
            man["path"] = str(m.parent)
            best = man
    return best


def load_full(man: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """Rows (param, exp_avg, exp_avg_sq) x numel, in logical order, from every shard file, and the
    shards whose data does not match the checksum their writer committed in the manifest."""
    rows = []
    bad = []
    crcs = man.get("crc", {})
    cm = _quiet()
    try:
        for r in range(man["shards"]):
            t = torch.empty(3, man["shard_numel"])
            dcp.load({"shard": t}, checkpoint_id=os.path.join(man["path"], f"rank{r}"), no_dist=True)
            if str(r) in crcs and checksum(t) != int(crcs[str(r)]):
                bad.append(r)
            rows.append(t)
    finally:
        cm.__exit__(None, None, None)
    return torch.cat(rows, dim=1)[:, : man["numel"]].contiguous(), bad


class Persister:
    """Background DCP writer for one rank."""

    def __init__(self, root: str, every: int, store: Any, fenced: Callable[[], bool] = lambda: False) -> None:
        self.root, self.every, self.store = Path(root), every, store
        self._fenced = fenced
        self.root.mkdir(parents=True, exist_ok=True)
        self._q: queue.Queue[tuple[int, torch.Tensor, dict[str, Any]] | None] = queue.Queue(maxsize=2)
        self.saved: list[float] = []
        self._t = threading.Thread(target=self._run, name="phoenixft-persist", daemon=True)
        self._t.start()

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def stage(self, step: int, committed_half: torch.Tensor, meta: dict[str, Any]) -> None:
        """Copy the committed snapshot now (caller guarantees it is stable), write it later."""
        try:
            self._q.put_nowait((step, committed_half.clone(), meta))
        except queue.Full:  # the disk is slower than K steps: skip this one rather than stall training
            pass

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the writes already staged, then stop."""
        self._q.put(None)
        self._t.join(timeout=timeout_s)

    def _run(self) -> None:
        import time

        while True:
            job = self._q.get()
            if job is None:
                return
            step, data, meta = job
            if self._fenced():  # a fenced node never writes into the job's checkpoints again
                continue
            t0 = time.perf_counter()
            d = self.root / f"step_{step:08d}"
            cm = _quiet()
            try:
                dcp.save({"shard": data}, checkpoint_id=str(d / f"rank{meta['rank']}"), no_dist=True)
            except Exception:  # noqa: BLE001 - a failed write only means this checkpoint never completes
                continue
            finally:
                cm.__exit__(None, None, None)
            self.saved.append(time.perf_counter() - t0)
            key = f"persist/{meta['epoch']}/{step}"
            self.store.set(f"{key}/crc/{meta['rank']}", str(checksum(data)))
            if self.store.add(key, 1) == meta["shards"] and not self._fenced():  # last one in writes the manifest
                crcs = {str(r): int(self.store.get(f"{key}/crc/{r}")) for r in range(meta["shards"])}
                man = {"step": step, "shards": meta["shards"], "numel": meta["numel"],
                       "shard_numel": meta["shard_numel"], "epoch": meta["epoch"], "seed": meta["seed"],
                       "crc": crcs}
                tmp = d / "MANIFEST.json.tmp"
                tmp.write_text(json.dumps(man))
                os.replace(tmp, d / "MANIFEST.json")
                done = sorted(p.parent for p in self.root.glob("step_*/MANIFEST.json"))
                for old in done[:-KEEP]:
                    shutil.rmtree(old, ignore_errors=True)
