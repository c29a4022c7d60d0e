"""Small statistics helpers for the simulator: means with normal 95% confidence intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Estimate", "mean_ci", "ratio_ci", "ratio_of_estimates"]

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a 95% confidence interval."""

    mean: float
    lo: float
    hi: float

    def as_dict(self) -> dict[str, float]:
        """JSON-friendly form."""
        return {"mean": self.mean, "ci95_lo": self.lo, "ci95_hi": self.hi}

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the interval (inclusive)."""
        return self.lo <= value <= self.hi


def mean_ci(x: np.ndarray) -> Estimate:
    """Sample mean and normal-approximation 95% CI of the mean (``1.96 * sd / sqrt(n)``)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan)
    m = float(x.mean())
    if n == 1:
        return Estimate(m, m, m)
    half = Z95 * float(x.std(ddof=1)) / math.sqrt(n)
    return Estimate(m, m - half, m + half)


def ratio_ci(num: np.ndarray, den: np.ndarray) -> Estimate:
    """Ratio of means ``sum(num) / sum(den)`` with a delta-method 95% CI.

    Used for per-failure figures: total lost seconds over total failures, where a trajectory may
    have no failure at all (so per-trajectory ratios are undefined).
    """
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    n = num.size
    dbar = float(den.mean()) if n else 0.0
    if n == 0 or dbar == 0.0:
        return Estimate(math.nan, math.nan, math.nan)
    r = float(num.mean()) / dbar
    if n == 1:
        return Estimate(r, r, r)
    resid = num - r * den
    half = Z95 * float(resid.std(ddof=1)) / (math.sqrt(n) * dbar)
    return Estimate(r, r - half, r + half)


def ratio_of_estimates(a: Estimate, b: Estimate) -> Estimate:
    """``a / b`` for two independent positive estimates, CI from the log-normal approximation."""
    if not (a.mean > 0 and b.mean > 0):
        return Estimate(math.nan, math.nan, math.nan)
    se_a = (a.hi - a.lo) / (2 * Z95 * a.mean)
    se_b = (b.hi - b.lo) / (2 * Z95 * b.mean)
    se = math.hypot(se_a, se_b)
    r = a.mean / b.mean
    return Estimate(r, r * math.exp(-Z95 * se), r * math.exp(Z95 * se))
