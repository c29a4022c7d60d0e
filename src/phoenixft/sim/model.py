"""Analytic cost model of failures: Eq. (1)-(6) of the PHOENIX review, plus Young/Daly.

The equations (numbers refer to the seed review, ``seeds/000_*.txt``):

* (1) expected replayed steps of checkpoint-restart: ``E[R] = (K - 1) / 2``
* (2) disruption per failure, checkpoint-restart:
  ``E[C_ckpt] = C_overhead + E[T_restart] + t_step * E[R]``
* (3) disruption rate: ``lambda * E[C]`` with ``lambda = 1 / MTTF_sys``
* (4) efficiency (renewal approximation): ``eta = MTTF / (MTTF + E[C])``
* (5) disruption per failure, hot-swap: ``E[C_phoenix] = C_overhead + E[T_hotswap] + t_step * E[phi]``
* (6) shard-loss probability per step with ``k`` replicas, union bound over ``D`` shards:
  ``P_loss <= D * p ** (k + 1)`` (independent nodes) or ``D * q ** (k + 1)`` (failure domains
  with topology-aware placement).

Eq. (4) is a first-order approximation: it ignores failures that strike during a recovery and
charges the checkpoint overhead per failure. :func:`segment_ettr_exact` is the exact expected
effective-training-time ratio of the segment model under exponential failures (Daly 2006), in
which a failure during a recovery restarts the recovery. It is the reference the Monte Carlo
simulator must converge to, and it is what :func:`optimal_interval` maximises to compare
checkpoint-restart at its best interval rather than at a straw-man ``K``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Disruption",
    "IntervalChoice",
    "ckpt_disruption",
    "daly_interval_s",
    "efficiency",
    "expected_replay_steps",
    "failure_rate",
    "optimal_interval",
    "phoenix_disruption",
    "segment_ettr_exact",
    "shard_loss_correlated",
    "shard_loss_independent",
    "system_mttf",
    "young_interval_s",
]


@dataclass(frozen=True)
class Disruption:
    """Expected disruption of one failure, split into the terms of Eq. (2) / Eq. (5)."""

    overhead_s: float
    recovery_s: float
    replay_s: float

    @property
    def total_s(self) -> float:
        """Sum of the three terms, seconds."""
        return self.overhead_s + self.recovery_s + self.replay_s


def expected_replay_steps(k_interval: int | float, *, half_interval: bool = False) -> float:
    """Eq. (1): expected replayed steps when checkpointing every ``k_interval`` steps.

    ``(K - 1) / 2`` under a uniform failure position; ``half_interval=True`` gives the ``K / 2``
    variant the paper used for its "16.7 minutes".
    """
    if k_interval < 1:
        raise ValueError(f"checkpoint interval must be >= 1 step, got {k_interval}")
    return k_interval / 2.0 if half_interval else (k_interval - 1) / 2.0


def ckpt_disruption(
    overhead_s: float, restart_s: float, t_step_s: float, k_interval: int | float
) -> Disruption:
    """Eq. (2): expected disruption per failure under checkpoint-restart."""
    return Disruption(overhead_s, restart_s, t_step_s * expected_replay_steps(k_interval))


def phoenix_disruption(overhead_s: float, hotswap_s: float, t_step_s: float, phi: float) -> Disruption:
    """Eq. (5): expected disruption per failure under hot-swap; ``phi`` in [0, 1)."""
    if not 0.0 <= phi <= 1.0:
        raise ValueError(f"phi must be in [0, 1], got {phi}")
    return Disruption(overhead_s, hotswap_s, t_step_s * phi)


def failure_rate(mttf_s: float) -> float:
    """Eq. (3): system failure rate ``lambda = 1 / MTTF_sys`` (failures per second)."""
    if mttf_s <= 0:
        raise ValueError(f"MTTF must be positive, got {mttf_s}")
    return 1.0 / mttf_s


def efficiency(mttf_s: float, disruption_s: float) -> float:
    """Eq. (4): ``eta = MTTF / (MTTF + E[C])`` (renewal approximation)."""
    if mttf_s <= 0 or disruption_s < 0:
        raise ValueError("MTTF must be positive and the disruption non-negative")
    return mttf_s / (mttf_s + disruption_s)


def system_mttf(unit_mttf_s: float, units: int | float) -> float:
    """MTTF of ``units`` independent exponential components: ``unit_mttf / units``."""
    if units <= 0:
        raise ValueError("units must be positive")
    return unit_mttf_s / units


def shard_loss_independent(shards: int, p: float, replicas: int, steps: int = 1) -> tuple[float, float]:
    """Eq. (6), independent node failures: (per-step bound, cumulative bound over ``steps``).

    A shard is lost when its owner and all ``replicas`` holders fail in the same step, which has
    probability ``p ** (replicas + 1)``; the union bound over ``shards`` shards and ``steps`` steps
    gives the two numbers (the cumulative one is ``steps`` times the per-step bound, as in the
    review, and may exceed 1 when the bound is vacuous).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    per_step = shards * p ** (replicas + 1)
    return per_step, per_step * steps


def shard_loss_correlated(
    domains_shards: int, q: float, replicas: int, steps: int = 1
) -> tuple[float, float]:
    """Eq. (6) for failure domains with topology-aware placement (replicas in k+1 domains).

    ``q`` is the per-domain per-step failure probability; the bound is ``D * q ** (k + 1)``.
    """
    return shard_loss_independent(domains_shards, q, replicas, steps)


def segment_ettr_exact(work_s: float, commit_s: float, recovery_s: float, mttf_s: float) -> float:
    """Exact ETTR of the segment model under exponential failures (Daly 2006).

    Work is done in segments of ``work_s`` useful seconds followed by a commit of ``commit_s``
    seconds (a checkpoint write; for per-step protection the protection overhead of one step).
    A failure anywhere loses the current segment and costs ``recovery_s``; a failure during a
    recovery restarts the recovery. The expected wall time of one segment is
    ``MTTF * exp(R / MTTF) * (exp((W + C) / MTTF) - 1)`` and the ETTR is ``W`` over that.
    """
    if work_s <= 0 or commit_s < 0 or recovery_s < 0 or mttf_s <= 0:
        raise ValueError("work and MTTF must be positive, commit and recovery non-negative")
    lam = 1.0 / mttf_s
    expected = math.exp(lam * recovery_s) * math.expm1(lam * (work_s + commit_s)) / lam
    return work_s / expected


def young_interval_s(ckpt_s: float, mttf_s: float) -> float:
    """Young (1974): optimal compute time between checkpoints, ``sqrt(2 * delta * MTTF)``."""
    return math.sqrt(2.0 * ckpt_s * mttf_s)


def daly_interval_s(ckpt_s: float, mttf_s: float) -> float:
    """Daly (2006) higher-order optimum of the compute time between checkpoints."""
    if ckpt_s >= 2.0 * mttf_s:
        return mttf_s
    ratio = ckpt_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * ckpt_s * mttf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - ckpt_s


@dataclass(frozen=True)
class IntervalChoice:
    """Checkpoint interval choices for checkpoint-restart, in steps, with their exact ETTR."""

    young_steps: int
    daly_steps: int
    best_steps: int
    young_ettr: float
    daly_ettr: float
    best_ettr: float


def _ettr_for_k(k: np.ndarray, t_step_s: float, ckpt_s: float, restart_s: float, mttf_s: float) -> np.ndarray:
    lam = 1.0 / mttf_s
    work = k * t_step_s
    return work * lam / (math.exp(lam * restart_s) * np.expm1(lam * (work + ckpt_s)))


def optimal_interval(
    t_step_s: float, ckpt_s: float, restart_s: float, mttf_s: float, max_steps: int = 10_000_000
) -> IntervalChoice:
    """Young, Daly and exact-optimal checkpoint intervals (in whole steps) and their exact ETTR.

    The exact optimum maximises :func:`segment_ettr_exact` over integer ``K``; it is searched in a
    window around the Daly estimate (the ETTR is unimodal in ``K``).
    """
    young = max(1, round(young_interval_s(ckpt_s, mttf_s) / t_step_s))
    daly = max(1, round(daly_interval_s(ckpt_s, mttf_s) / t_step_s))
    young, daly = min(young, max_steps), min(daly, max_steps)
    hi = min(max_steps, max(4 * daly, 64))
    ks = np.arange(1, hi + 1, dtype=np.float64)
    ettr = _ettr_for_k(ks, t_step_s, ckpt_s, restart_s, mttf_s)
    best_i = int(np.argmax(ettr))
    return IntervalChoice(
        young_steps=young,
        daly_steps=daly,
        best_steps=int(ks[best_i]),
        young_ettr=float(_ettr_for_k(np.array([young], float), t_step_s, ckpt_s, restart_s, mttf_s)[0]),
        daly_ettr=float(_ettr_for_k(np.array([daly], float), t_step_s, ckpt_s, restart_s, mttf_s)[0]),
        best_ettr=float(ettr[best_i]),
    )
