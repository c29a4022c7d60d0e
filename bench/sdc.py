"""Per-step cost of the silent-data-corruption checks, each as a ratio to an unchecked run measured in
the same invocation.

    python bench/sdc.py                 # tiny, DP=2, 3 rounds of 30 steps per mode
    python bench/sdc.py --quick         # 1 round of 14 steps (about three minutes here)

Method: one invocation runs R rounds; each round runs every mode once with an identical configuration
(`phoenixft run --nodes DP --spares 0 --steps T --model M` plus the mode's flags), the order reversed
every other round. Per mode the per-step times (`dt`) of all its runs are pooled after dropping the
first 3 steps of each run, and the ratio of medians to the unchecked mode is reported with a 95%
bootstrap interval; each check's own time per step (its mean: audits are periodic; `sdc_<check>_s`
in metrics.jsonl) is reported as a share of the unchecked median step time too, which is steadier
than a ratio of two noisy medians. One function per check below (`CHECKS`) gives the flags that
turn it on alone; a check added later adds its function there. Also measured in process: the
fingerprint itself per MiB.

Writes bench/results/sdc.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import (
    RESULTS,
    bootstrap_ratio_ci,
    log,
    machine_info,
    median,
    phoenix_run,
    ratio,
    steady,
    table,
    write_json,
)

DROP = 3


def mean(xs: list[float]) -> float | None:
    """(A periodic check, an audit every 10 steps, costs its mean per step, not its median.)"""
    return sum(xs) / len(xs) if xs else None
OFF: dict[str, Any] = {"sdc_check_every": 0, "spike_threshold": -1.0, "sdc_audit": "off"}


def unchecked() -> dict[str, Any]:
    return dict(OFF)


def fingerprints() -> dict[str, Any]:
    return {**OFF, "sdc_check_every": 1}


def spike_guard() -> dict[str, Any]:
    return {**OFF, "spike_threshold": 20.0}


def sampled_audits() -> dict[str, Any]:
    return {**OFF, "sdc_audit": "sample", "sdc_audit_every": 10}


def defaults() -> dict[str, Any]:
    """What a run gets without any flag: fingerprints every step and the spike guard."""
    return {}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "unchecked": unchecked, "fingerprints": fingerprints, "spike_guard": spike_guard,
    "sampled_audits": sampled_audits, "defaults": defaults,
}
COST_FIELDS = {"fingerprints": ["sdc_params_s"], "spike_guard": ["sdc_guard_s"], "sampled_audits": ["sdc_audit_s"],
               "defaults": ["sdc_params_s", "sdc_guard_s"]}


def fingerprint_speed() -> dict[str, Any]:
    """The fingerprint of a flat fp32 buffer, in process, per MiB (median of 20)."""
    import torch

    from phoenixft.sdc.logic import fingerprint

    torch.set_num_threads(1)
    out = {}
    for mib in (4, 44):
        x = torch.randn(mib * (1 << 18))
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            fingerprint(x)
            ts.append(time.perf_counter() - t0)
        out[f"{mib}MiB_ms"] = round(1e3 * (median(ts) or 0.0), 3)
    return out


def run(quick: bool = False, *, model: str = "tiny", dp: int = 2, rounds: int | None = None,
        steps: int | None = None, out: Path = RESULTS) -> dict[str, Any]:
    t_start = time.time()
    rounds = rounds or (1 if quick else 3)
    steps = steps or (14 if quick else 30)
    work = Path(tempfile.mkdtemp(prefix="bench-sdc-"))
    samples: dict[str, list[float]] = {n: [] for n in CHECKS}
    own: dict[str, list[float]] = {n: [] for n in CHECKS}
    for r in range(rounds):
        order = list(CHECKS.items())
        if r % 2:
            order.reverse()
        for name, flags in order:
            log(f"sdc: {name} round {r + 1}/{rounds} ({model}, DP={dp}, {steps} steps)")
            rep = phoenix_run(work / f"{name}-{r}", probe=False, nodes=dp, workers_per_node=1, spares=0,
                              steps=steps, model=model, **flags())
            if rep.get("state") != "done":
                raise RuntimeError(f"{name}: {rep.get('error')}")
            recs = steady(rep["metrics"], DROP)
            samples[name] += [m["dt"] for m in recs]
            own[name] += [sum(float(m.get(f, 0.0)) for f in COST_FIELDS.get(name, [])) for m in recs]
    base = median(samples["unchecked"])
    modes = {}
    for name in CHECKS:
        med = median(samples[name])
        modes[name] = {"median_step_s": med, "n": len(samples[name]), "ratio": ratio(med, base),
                       "ratio_ci95": bootstrap_ratio_ci(samples[name], samples["unchecked"]),
                       "own_s_per_step": mean(own[name]),
                       "own_share_of_unchecked_step": ratio(mean(own[name]), base)}
    res = {"machine": machine_info(), "model": model, "dp": dp, "rounds": rounds, "steps": steps,
           "command": f"python bench/sdc.py{' --quick' if quick else ''}", "modes": modes,
           "fingerprint_in_process": fingerprint_speed(), "took_s": round(time.time() - t_start, 1)}
    print(table(f"sdc checks, {model}, DP={dp}", ["mode", "median step ms", "ratio", "95% CI", "own ms/step",
                                                  "own share"],
                [[n, 1e3 * (m["median_step_s"] or 0), m["ratio"], m["ratio_ci95"], 1e3 * (m["own_s_per_step"] or 0),
                  m["own_share_of_unchecked_step"]] for n, m in modes.items()]))
    write_json(out / "sdc.json", res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int)
    a = ap.parse_args()
    run(a.quick, model=a.model, dp=a.dp, rounds=a.rounds, steps=a.steps)


if __name__ == "__main__":
    main()
