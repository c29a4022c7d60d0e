"""Calibration: recovery time as a fitted function of world size, from anchors or from bench JSON.

Two model families are fitted by least squares to ``(world_size, seconds)`` points:

* ``log2``:  ``y = a + b * log2(W)`` (linear least squares in ``log2 W``);
* ``power``: ``y = a * W ** b`` (least squares on ``log y`` against ``log W``).

Both are reported with their residuals (measured minus fitted, in seconds) and root-mean-square
error in linear space; the one with the smaller RMSE is used to project recovery times to the
sweep scales (ties, e.g. two points that both models pass through exactly, go to ``log2``, the
more conservative extrapolation of the two when ``b < 1``).

Without a calibration file the defaults are ``log2`` fits through the anchors the seed review
quotes: hot-swap 17.1 s at 32 GPUs and 29.8 s at 512 GPUs (paper Fig. 11), checkpoint-restart
150 s at the paper's 64 nodes x 4 GPUs and about 10 minutes at O(100K) GPUs (FT-HSDP).

``load_calibration`` reads the benchmark's JSON: a dict that may contain ``overhead_ratio_dp2``
(protected / unprotected step time), ``recovery`` (list of ``{"world_size", "recovery_s"}``),
``checkpoint_restart`` (list of ``{"world_size", "time_to_resume_s", "k"}``; a ``restart_s``
key, when present, is fitted as the restart cost) and ``machine``. Missing keys fall back to
the defaults, and every fallback is recorded in ``Calibration.notes``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Calibration",
    "CalibrationError",
    "DEFAULT_HOTSWAP",
    "DEFAULT_RESTART",
    "Fit",
    "HOTSWAP_ANCHORS",
    "RESTART_ANCHORS",
    "best_fit",
    "default_calibration",
    "fit_log2",
    "fit_power",
    "load_calibration",
]

#: (GPUs, seconds) hot-swap recovery anchors from the review of the paper (Fig. 11).
HOTSWAP_ANCHORS: tuple[tuple[int, float], ...] = ((32, 17.1), (512, 29.8))
#: (GPUs, seconds) checkpoint-restart anchors: paper's 150 s at 64 nodes x 4 GPUs, FT-HSDP 10 min.
RESTART_ANCHORS: tuple[tuple[int, float], ...] = ((256, 150.0), (100_000, 600.0))


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message is one line naming the flag."""


@dataclass(frozen=True)
class Fit:
    """A fitted recovery-time curve ``seconds = f(world_size)`` with its residuals."""

    kind: str
    a: float
    b: float
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, world: float | np.ndarray) -> Any:
        """Seconds at `world`. Below the smallest fitted world size a log2 fit is held at its value
        there (its line in log2 W goes to zero and below within a few halvings: the default restart
        fit gives -110 s at 8 GPUs), and no fit returns less than 0 s."""
        w = np.asarray(world, dtype=np.float64)
        if self.kind == "log2":
            if self.xs:
                w = np.maximum(w, min(self.xs))
            out = np.maximum(self.a + self.b * np.log2(w), 0.0)
        elif self.kind == "power":
            out = self.a * np.power(w, self.b)
        else:
            out = np.full_like(w, self.a)
        return float(out) if out.ndim == 0 else out

    @property
    def residuals(self) -> tuple[float, ...]:
        """Measured minus fitted seconds at each point."""
        if not self.xs:
            return ()
        fitted = np.atleast_1d(self(np.array(self.xs)))
        return tuple(float(v) for v in np.array(self.ys) - fitted)

    @property
    def rmse(self) -> float:
        """Root-mean-square residual in seconds (0 for an exact fit)."""
        r = np.array(self.residuals)
        return float(math.sqrt(float(np.mean(r**2)))) if r.size else math.nan

    def describe(self) -> str:
        """Human-readable formula."""
        if self.kind == "log2":
            return f"{self.a:.4g} + {self.b:.4g}*log2(W)"
        if self.kind == "power":
            return f"{self.a:.4g}*W^{self.b:.4g}"
        return f"{self.a:.4g} (constant)"

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form, with residuals."""
        return {
            "kind": self.kind,
            "formula": self.describe(),
            "a": self.a,
            "b": self.b,
            "points": [{"world_size": x, "seconds": y} for x, y in zip(self.xs, self.ys, strict=True)],
            "residuals_s": list(self.residuals),
            "rmse_s": self.rmse,
        }


def _check_points(ws: list[float], ys: list[float]) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(ws, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if w.size == 0 or w.size != y.size:
        raise ValueError("need at least one (world_size, seconds) point")
    if np.any(w <= 0) or np.any(y <= 0):
        raise ValueError("world sizes and seconds must be positive")
    return w, y


def fit_log2(ws: list[float], ys: list[float]) -> Fit:
    """Least-squares ``a + b * log2(W)``; a constant when all points share one world size."""
    w, y = _check_points(ws, ys)
    xs, yl = tuple(float(v) for v in w), tuple(float(v) for v in y)
    if np.unique(w).size < 2:
        return Fit("constant", float(y.mean()), 0.0, xs, yl)
    b, a = np.polyfit(np.log2(w), y, 1)
    return Fit("log2", float(a), float(b), xs, yl)


def fit_power(ws: list[float], ys: list[float]) -> Fit:
    """Least-squares ``log y = log a + b log W`` (i.e. ``a * W ** b``); constant for one size."""
    w, y = _check_points(ws, ys)
    xs, yl = tuple(float(v) for v in w), tuple(float(v) for v in y)
    if np.unique(w).size < 2:
        return Fit("constant", float(y.mean()), 0.0, xs, yl)
    b, loga = np.polyfit(np.log(w), np.log(y), 1)
    return Fit("power", float(math.exp(loga)), float(b), xs, yl)


def best_fit(ws: list[float], ys: list[float]) -> tuple[Fit, Fit, Fit]:
    """Both fits and the chosen one (smaller RMSE in seconds; ties within 1e-9 s go to log2)."""
    lg, pw = fit_log2(ws, ys), fit_power(ws, ys)
    chosen = pw if pw.rmse < lg.rmse - 1e-9 else lg
    return lg, pw, chosen


DEFAULT_HOTSWAP: Fit = fit_log2([w for w, _ in HOTSWAP_ANCHORS], [s for _, s in HOTSWAP_ANCHORS])
DEFAULT_RESTART: Fit = fit_log2([w for w, _ in RESTART_ANCHORS], [s for _, s in RESTART_ANCHORS])


@dataclass
class Calibration:
    """What the simulator uses from measurements (or the defaults), and how it got there."""

    source: str | None
    overhead_ratio: float
    hotswap: Fit
    restart: Fit
    hotswap_fits: tuple[Fit, Fit] | None = None
    restart_fits: tuple[Fit, Fit] | None = None
    machine: Any = None
    notes: list[str] = field(default_factory=list)
    measured_ratios: list[dict[str, float]] = field(default_factory=list)

    @property
    def max_measured_world(self) -> float:
        """Largest world size among the hot-swap points."""
        return max(self.hotswap.xs) if self.hotswap.xs else math.nan

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form with both fits, their residuals and the notes."""
        return {
            "source": self.source,
            "overhead_ratio": self.overhead_ratio,
            "hotswap_fit": self.hotswap.as_dict(),
            "hotswap_candidates": [f.as_dict() for f in self.hotswap_fits] if self.hotswap_fits else None,
            "restart_fit": self.restart.as_dict(),
            "restart_candidates": [f.as_dict() for f in self.restart_fits] if self.restart_fits else None,
            "machine": self.machine,
            "measured_cr_over_recovery": self.measured_ratios,
            "notes": list(self.notes),
        }


def default_calibration() -> Calibration:
    """The defaults: zero protection overhead and the seed's anchor fits."""
    return Calibration(
        source=None,
        overhead_ratio=1.0,
        hotswap=DEFAULT_HOTSWAP,
        restart=DEFAULT_RESTART,
        notes=[
            "hot-swap recovery: log2 fit through the paper's 17.1 s @ 32 GPUs and 29.8 s @ 512 GPUs",
            "checkpoint-restart: log2 fit through 150 s @ 256 GPUs (paper) and 600 s @ 100,000 GPUs"
            " (FT-HSDP)",
            "protection overhead ratio 1.0 (the paper's measured zero overhead)",
        ],
    )


def _positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _points(entries: Any, key: str, value_key: str, notes: list[str]) -> tuple[list[float], list[float]]:
    ws: list[float] = []
    ys: list[float] = []
    if not isinstance(entries, list):
        notes.append(f"'{key}' is not a list; ignored")
        return ws, ys
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not _positive_number(e.get("world_size")):
            notes.append(f"'{key}'[{i}] has no positive world_size; skipped")
            continue
        if not _positive_number(e.get(value_key)):
            notes.append(f"'{key}'[{i}] has no positive {value_key}; skipped")
            continue
        ws.append(float(e["world_size"]))
        ys.append(float(e[value_key]))
    return ws, ys


def load_calibration(path: str | Path) -> Calibration:
    """Read a bench JSON file; raise :class:`CalibrationError` with a one-line message."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"--calibrate: file {str(p)!r} does not exist; pass a bench JSON file")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CalibrationError(f"--calibrate: {str(p)!r} is not a readable JSON file ({msg})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"--calibrate: {str(p)!r} must hold a JSON object, got {type(data).__name__}")

    cal = default_calibration()
    cal.source = str(p)
    cal.notes = []
    cal.machine = data.get("machine")

    ov = data.get("overhead_ratio_dp2")
    if ov is None:
        cal.notes.append("no overhead_ratio_dp2: using protection overhead ratio 1.0 (paper's zero overhead)")
    elif not _positive_number(ov):
        cal.notes.append(f"overhead_ratio_dp2={ov!r} is not a positive number: using 1.0")
    elif ov < 1.0:
        cal.overhead_ratio = 1.0
        cal.notes.append(f"overhead_ratio_dp2={ov:.4f} < 1 (within noise): using 1.0")
    else:
        cal.overhead_ratio = float(ov)

    if "recovery" not in data:
        cal.notes.append("no 'recovery' list: hot-swap recovery from the paper's anchors")
    else:
        ws, ys = _points(data["recovery"], "recovery", "recovery_s", cal.notes)
        if ws:
            lg, pw, chosen = best_fit(ws, ys)
            cal.hotswap, cal.hotswap_fits = chosen, (lg, pw)
            if len(set(ws)) < 2:
                cal.notes.append("recovery measured at a single world size: constant, no scaling fitted")
        else:
            cal.notes.append("no usable 'recovery' entries: hot-swap recovery from the paper's anchors")

    cr = data.get("checkpoint_restart")
    if cr is None:
        cal.notes.append("no 'checkpoint_restart' list: restart cost from the seed's anchors")
    else:
        rws, rys = _points(cr, "checkpoint_restart", "restart_s", [])
        if rws:
            lg, pw, chosen = best_fit(rws, rys)
            cal.restart, cal.restart_fits = chosen, (lg, pw)
        else:
            cal.notes.append(
                "checkpoint_restart entries have no restart_s (time_to_resume_s includes replay, which"
                " the simulator models separately): restart cost from the seed's anchors"
            )
        tws, tys = _points(cr, "checkpoint_restart", "time_to_resume_s", [])
        rws2, rys2 = _points(data.get("recovery", []), "recovery", "recovery_s", [])
        for w, t in zip(tws, tys, strict=True):
            same = [y for x, y in zip(rws2, rys2, strict=True) if x == w]
            if same:
                rec = float(np.mean(same))
                cal.measured_ratios.append(
                    {"world_size": w, "cr_time_to_resume_s": t, "recovery_s": rec, "ratio": t / rec}
                )
    return cal
