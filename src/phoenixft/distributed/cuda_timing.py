"""The snapshot copy of a CUDA worker timed with CUDA events, for the GPU check (bench/gpu_check.py).

With `PHOENIXFT_CUDA_TIMING=FILE` set, a CUDA worker times the device-to-host copies of its optimizer
shard (`Device.d2h`) of a few steps after a warm-up, and appends one JSON line per copy to FILE:

- `copy_ms`: the copy on the copy stream (its start to its end event);
- `wait_ms`: from the compute stream's event after the optimizer to the copy's start (the copy stream
  waits for that event: the copy never reads a half-written shard);
- `step_ms`: from that event to the same event of the next step, on the compute stream (the step the
  copy runs beside);
- `end_ms`: from that event to the copy's end; `overlapped` is `end_ms <= step_ms`: the copy finished
  inside the next step instead of after it;
- `bytes`, `gb_per_s`, and `pinned`: whether the host half the copy wrote is page-locked (a pageable
  destination makes a "non-blocking" copy synchronous).

Events are queried, never synchronized: a measurement is written once all its events completed, at a
later copy. Without the variable nothing is timed (`from_env` returns None).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["TIMING_ENV", "CopyTiming"]

TIMING_ENV = "PHOENIXFT_CUDA_TIMING"
SKIP, COUNT = 3, 3  # warm-up copies, then copies timed


class CopyTiming:
    """Times copies SKIP .. SKIP+COUNT-1 of one worker (see the module docstring)."""

    def __init__(self, path: str, wid: str = "") -> None:
        self.path, self.wid = path, wid
        self.n = 0  # copies seen
        self._open: dict[str, Any] | None = None  # the last timed copy, waiting for the next step's event
        self._done: list[tuple[dict[str, Any], Any]] = []  # (timed copy, next step's event), not yet complete

    @classmethod
    def from_env(cls, wid: str = "") -> CopyTiming | None:
        path = os.environ.get(TIMING_ENV, "")
        return cls(path, wid) if path else None

    def times_ready(self) -> bool:
        """Whether this copy's ready event must be timed (a timed copy's, or the one after it)."""
        return SKIP <= self.n <= SKIP + COUNT

    def measures(self) -> bool:
        """Whether this copy is timed."""
        return SKIP <= self.n < SKIP + COUNT

    def copied(self, ready: Any, start: Any, end: Any, dst: torch.Tensor) -> None:
        """A copy was queued: `ready` on the compute stream, `start`/`end` on the copy stream (`start` None
        when this copy is not timed)."""
        if self._open is not None:
            self._done.append((self._open, ready))
            self._open = None
        if start is not None:
            self._open = {"ready": ready, "start": start, "end": end, "bytes": dst.numel() * dst.element_size(),
                          "pinned": bool(dst.is_pinned()), "copy": self.n}
        self.n += 1
        self.flush()

    def flush(self) -> int:
        """Write the measurements whose events all completed; how many were written."""
        keep, lines = [], []
        for rec, nxt in self._done:
            if not (nxt.query() and rec["end"].query()):
                keep.append((rec, nxt))
                continue
            ready, start, end = rec["ready"], rec["start"], rec["end"]
            copy_ms, step_ms, end_ms = start.elapsed_time(end), ready.elapsed_time(nxt), ready.elapsed_time(end)
            lines.append(json.dumps({
                "wid": self.wid, "pid": os.getpid(), "copy": rec["copy"], "bytes": rec["bytes"],
                "pinned": rec["pinned"], "copy_ms": round(copy_ms, 4), "wait_ms": round(ready.elapsed_time(start), 4),
                "step_ms": round(step_ms, 4), "end_ms": round(end_ms, 4), "overlapped": end_ms <= step_ms,
                "gb_per_s": round(rec["bytes"] / copy_ms / 1e6, 3) if copy_ms > 0 else None}))
        self._done = keep
        if lines:
            with open(self.path, "a") as f:
                f.write("".join(line + "\n" for line in lines))
        return len(lines)
