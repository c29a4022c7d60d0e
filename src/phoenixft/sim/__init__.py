"""phoenixft.sim: analytic cost model and Monte Carlo simulator of training runs under failures.

It turns measured costs (step time, checkpoint write, restart, hot-swap recovery, protection
overhead) into the effective training time ratio (ETTR) of checkpoint-restart, PHOENIX hot-swap,
in-place recovery and shrink at scales we cannot run (up to 131,072 GPUs). It does not import
torch. Entry points: :func:`simulate` (Monte Carlo), the functions of :mod:`.model` (Eq. 1-6,
Young/Daly), :mod:`.calibrate` (fits of recovery time against world size) and the
``phoenixft simulate`` command (:mod:`.cli`).
"""

from __future__ import annotations

from .calibrate import Calibration, Fit, best_fit, default_calibration, load_calibration
from .model import (
    ckpt_disruption,
    efficiency,
    expected_replay_steps,
    optimal_interval,
    phoenix_disruption,
    segment_ettr_exact,
    shard_loss_correlated,
    shard_loss_independent,
)
from .montecarlo import CAUSES, MCResult, simulate
from .scenario import POLICIES, Scenario

__all__ = [
    "CAUSES",
    "POLICIES",
    "Calibration",
    "Fit",
    "MCResult",
    "Scenario",
    "best_fit",
    "ckpt_disruption",
    "default_calibration",
    "efficiency",
    "expected_replay_steps",
    "load_calibration",
    "optimal_interval",
    "phoenix_disruption",
    "segment_ettr_exact",
    "shard_loss_correlated",
    "shard_loss_independent",
    "simulate",
]
