"""Learning-rate schedules: pure functions of the step, so a replayed or restored step uses exactly
the rate the failure-free run used.

- `constant`: lr (after the warm-up);
- `cosine`: linear warm-up to lr over `warmup` steps, then half a cosine down to `min_lr` over
  `decay` steps (default: the rest of the run), `min_lr` after;
- `linear`: warm-up, then a straight line down to `min_lr` over `decay` steps;
- `wsd` (warmup-stable-decay): warm-up, `lr` held, then a straight line down to `min_lr` over the
  last `decay` steps of the run (default: the last 20%).

The warm-up rises linearly and reaches `lr` at step `warmup` (step 1 trains at lr / warmup).
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]

SCHEDULES = ("constant", "cosine", "linear", "wsd")


def lr_at(step: int, *, schedule: str, lr: float, min_lr: float, warmup: int, decay: int, total: int) -> float:
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        d = decay or max(1, total // 5)
        start = total - d
        if step <= start:
            return lr
        frac = min(1.0, (step - start) / d)
        return lr + (min_lr - lr) * frac
    d = decay or max(1, total - warmup)
    frac = min(1.0, (step - warmup) / d)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))
    if schedule == "linear":
        return lr + (min_lr - lr) * frac
    raise ValueError(f"unknown schedule {schedule!r}")
