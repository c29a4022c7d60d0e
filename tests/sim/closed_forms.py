"""Closed forms the simulator tests compare against, written out here from their sources.

Nothing in this module imports phoenixft: every expected value the tests derive from these
functions comes from the formula as published (cited per function), so a bug in
``phoenixft.sim`` cannot reproduce itself in the expected value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def segment_wall_s(work_s: float, commit_s: float, recovery_s: float, mttf_s: float) -> float:
    """Expected wall time of one segment of ``work_s`` useful seconds plus a ``commit_s`` commit,
    restarted from scratch by any failure, each failure costing a recovery of ``recovery_s`` that
    itself restarts on a failure; exponential failures of mean ``mttf_s``.

    Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps":
    ``M e^{R/M} (e^{(W+C)/M} - 1)``. Derivation (renewal): a segment of length a completes with
    probability e^{-a/M}; otherwise the expected time to the failure is M - a/(e^{a/M}-1) and the
    recovery (with restarts) takes M (e^{R/M} - 1); solving
    E = e^{-a/M} a + (1 - e^{-a/M}) (E_fail + E_rec + E) gives the formula.
    """
    return mttf_s * math.exp(recovery_s / mttf_s) * math.expm1((work_s + commit_s) / mttf_s)


def ettr(work_s: float, commit_s: float, recovery_s: float, mttf_s: float) -> float:
    """Useful time over wall time of the segment model above."""
    return work_s / segment_wall_s(work_s, commit_s, recovery_s, mttf_s)


def young_s(ckpt_s: float, mttf_s: float) -> float:
    """Young (1974): optimum compute time between checkpoints, ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * ckpt_s * mttf_s)


def daly_s(ckpt_s: float, mttf_s: float) -> float:
    """Daly (2006), the higher-order optimum compute time between checkpoints:
    ``sqrt(2CM) [1 + sqrt(C/(2M))/3 + C/(2M)/9] - C`` for ``C < 2M``, else ``M``."""
    if ckpt_s >= 2.0 * mttf_s:
        return mttf_s
    x = ckpt_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * ckpt_s * mttf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - ckpt_s


def optimum_s(ckpt_s: float, mttf_s: float) -> float:
    """The exact optimum compute time of the segment model, by bisection (no approximation).

    ETTR ~ tau / (e^{(tau+C)/M} - 1) (the recovery factor does not depend on tau); its derivative
    vanishes where ``e^{x} - 1 = (tau/M) e^{x}``, ``x = (tau+C)/M``.
    """

    def g(tau: float) -> float:
        x = (tau + ckpt_s) / mttf_s
        return math.expm1(x) - tau / mttf_s * math.exp(x)

    lo, hi = 1e-12, 50.0 * mttf_s
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if g(mid) > 0 else (lo, mid)
    return lo


def best_k(t_step_s: float, ckpt_s: float, restart_s: float, mttf_s: float, k_max: int) -> int:
    """Integer checkpoint interval (steps) maximising the segment-model ETTR, by exhaustive search."""
    return max(range(1, k_max + 1), key=lambda k: ettr(k * t_step_s, ckpt_s, restart_s, mttf_s))


def pooled_ratio_ci(num: Sequence[float] | np.ndarray, den: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """``sum(num) / sum(den)`` over independent trajectories and its 95% half-width (delta method:
    ``Z95 * sd(num - r den) / (sqrt(n) mean(den))``)."""
    a = np.asarray(num, dtype=np.float64)
    b = np.asarray(den, dtype=np.float64)
    r = float(a.sum() / b.sum())
    half = Z95 * float(np.std(a - r * b, ddof=1)) / (math.sqrt(a.size) * float(b.mean()))
    return r, half
