"""The simulator's named experiments: worked example, paper scenario, shard-loss table, sweeps.

Each function returns a JSON-friendly dict (inputs, results, notes) that the CLI prints as a
table, writes with ``--json`` and plots; no printing happens here.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from . import model
from .calibrate import Calibration, default_calibration
from .montecarlo import FAILURE_CAUSES, MCResult, simulate
from .scenario import Scenario, canonical_policy
from .stats import ratio_of_estimates

__all__ = [
    "DEFAULT_SWEEP_GPUS",
    "PAPER",
    "paper_accountings",
    "paper_scenario",
    "policy_interval",
    "run_policies",
    "scale_sweep",
    "scenario_at_scale",
    "shard_loss_table",
    "worked_example",
]

DEFAULT_SWEEP_GPUS: tuple[int, ...] = tuple(2**e for e in range(9, 18))  # 512 .. 131,072

#: The paper's real-world benefit scenario (Section VII-C), as the review reports it.
PAPER: dict[str, Any] = {
    "model": "2.3B GPT",
    "nodes": 64,
    "gpus_per_node": 4,
    "steps": 100_000,
    "step_s": 2.08,
    "ckpt_every": 5000,
    "ckpt_s": 8.9,
    "restart_s": 150.0,
    "failure_steps_after_ckpt": (18, 2366),
    "hotswap_s": (32.6, 29.8),
    "paper_ratio": 18.8,
    "paper_fraction": 0.053,
}


def worked_example(
    mttf_s: float = 1080.0,
    step_s: float = 20.0,
    k_interval: int = 100,
    restart_s: float = 600.0,
    overhead_s: float = 5.0,
    hotswap_s: float = 30.0,
    phi: float = 0.5,
    trajectories: int = 1000,
    steps: int = 20_000,
    seed: int = 0,
) -> dict[str, Any]:
    """The review's worked example, Eq. (1)-(5), then the same cluster under the exact model.

    The Monte Carlo rows use exponential failures at ``mttf_s``, a checkpoint write of
    ``overhead_s`` every ``K`` steps, failures during recoveries, and ample spares; they are
    compared with the exact segment formula and with checkpoint-restart at its optimal ``K``.
    """
    er = model.expected_replay_steps(k_interval)
    ck = model.ckpt_disruption(overhead_s, restart_s, step_s, k_interval)
    hs = model.phoenix_disruption(0.0, hotswap_s, step_s, phi)
    eta_ck, eta_hs = model.efficiency(mttf_s, ck.total_s), model.efficiency(mttf_s, hs.total_s)
    out: dict[str, Any] = {
        "inputs": {
            "mttf_s": mttf_s,
            "step_s": step_s,
            "k": k_interval,
            "restart_s": restart_s,
            "overhead_s": overhead_s,
            "hotswap_s": hotswap_s,
            "phi": phi,
        },
        "analytic": {
            "expected_replay_steps": er,
            "checkpoint_restart": {
                "overhead_s": ck.overhead_s,
                "restart_s": ck.recovery_s,
                "replay_s": ck.replay_s,
                "disruption_s": ck.total_s,
                "eta": eta_ck,
            },
            "hotswap": {
                "overhead_s": hs.overhead_s,
                "hotswap_s": hs.recovery_s,
                "partial_step_s": hs.replay_s,
                "disruption_s": hs.total_s,
                "eta": eta_hs,
            },
            "disruption_ratio": ck.total_s / hs.total_s,
        },
    }
    if trajectories > 0:
        nodes = 128
        sc = Scenario(
            gpus=nodes,
            gpus_per_node=1,
            steps=steps,
            step_s=step_s,
            gpu_mttf_s=mttf_s * nodes,
            spares=1,
            provision_s=0.0,
            restart_s=restart_s,
            ckpt_s=overhead_s,
            hotswap_s=hotswap_s,
            replicas=3,
            persist_every=0,
        )
        best = model.optimal_interval(step_s, overhead_s, restart_s, mttf_s)
        rows = []
        for label, pol, k in (
            (f"checkpoint-restart K={k_interval}", "checkpoint-restart", k_interval),
            (f"checkpoint-restart K={best.best_steps} (optimal)", "checkpoint-restart", best.best_steps),
            ("hot-swap (per-step protection)", "phoenix", None),
        ):
            r = simulate(sc, pol, ckpt_every=k, trajectories=trajectories, seed=seed)
            exact = (
                model.segment_ettr_exact(k * step_s, overhead_s, restart_s, mttf_s)
                if k is not None
                else model.segment_ettr_exact(step_s, 0.0, hotswap_s, mttf_s)
            )
            rows.append(
                {
                    "label": label,
                    "k": k,
                    "exact_ettr": exact,
                    "mc_ettr_pooled": r.ettr_pooled().as_dict(),
                    "mc_ettr_per_run": r.ettr_ci().as_dict(),
                    "failures_per_run": float(r.failures.mean()),
                }
            )
        out["exact_model"] = {
            "note": "exponential failures, failures during recovery restart it, checkpoint write of"
            " overhead_s every K steps; Eq. (4) ignores both effects",
            "young_daly": {"young_steps": best.young_steps, "daly_steps": best.daly_steps},
            "steps": steps,
            "trajectories": trajectories,
            "rows": rows,
        }
    return out


def _samples(r: MCResult) -> list[float]:
    return [] if r.episode_samples is None else [round(float(v), 3) for v in r.episode_samples]


def paper_accountings() -> list[dict[str, Any]]:
    """Ways of adding up the paper's two failures; shows which reproduce 5.3% / 18.8x."""
    t = PAPER["step_s"]
    f1, f2 = PAPER["failure_steps_after_ckpt"]
    h1, h2 = PAPER["hotswap_s"]
    r = PAPER["restart_s"]
    hs = h1 + h2
    ckpt_writes = (PAPER["steps"] // PAPER["ckpt_every"]) * PAPER["ckpt_s"]
    rows = [
        (
            "restart + replay per failure (the review's description)",
            f"({r:g}+{f1}*{t})+({r:g}+{f2}*{t})",
            (r + f1 * t) + (r + f2 * t),
            hs,
        ),
        ("restart only, no replay", f"{r:g}+{r:g}", 2 * r, hs),
        (
            "restart + replay + all checkpoint writes of the run",
            f"({r:g}+{f1}*{t})+({r:g}+{f2}*{t})+20*{PAPER['ckpt_s']}",
            (r + f1 * t) + (r + f2 * t) + ckpt_writes,
            hs,
        ),
        ("first failure only", f"{r:g}+{f1}*{t}", r + f1 * t, h1),
        ("second failure only", f"{r:g}+{f2}*{t}", r + f2 * t, h2),
        ("what 18.8x would need", f"{PAPER['paper_ratio']}*({h1}+{h2})", PAPER["paper_ratio"] * hs, hs),
    ]
    out = []
    for label, formula, cr, h in rows:
        out.append(
            {
                "accounting": label,
                "checkpoint_restart_formula": formula,
                "checkpoint_restart_s": cr,
                "hotswap_s": h,
                "ratio": cr / h,
                "hotswap_fraction": h / cr,
                "reproduces_paper": abs(cr / h - PAPER["paper_ratio"]) < 0.05 * PAPER["paper_ratio"],
            }
        )
    return out


def paper_scenario(
    trajectories: int = 4000, seed: int = 0, gpu_mttf_s: float | None = None
) -> dict[str, Any]:
    """The paper's 64-node scenario: the two-failure arithmetic, then its distribution by MC."""
    sc = Scenario(
        gpus=PAPER["nodes"] * PAPER["gpus_per_node"],
        gpus_per_node=PAPER["gpus_per_node"],
        steps=PAPER["steps"],
        step_s=PAPER["step_s"],
        restart_s=PAPER["restart_s"],
        ckpt_s=PAPER["ckpt_s"],
        hotswap_s=float(np.mean(PAPER["hotswap_s"])),
        inplace_s=float(np.mean(PAPER["hotswap_s"])),
        shrink_s=float(np.mean(PAPER["hotswap_s"])),
        persist_every=PAPER["ckpt_every"],
        persist_s=PAPER["ckpt_s"],
    )
    if gpu_mttf_s is not None:
        sc = sc.with_(gpu_mttf_s=gpu_mttf_s)
    accountings = paper_accountings()
    k = PAPER["ckpt_every"]
    r_cr = simulate(
        sc, "checkpoint-restart", ckpt_every=k, trajectories=trajectories, seed=seed, record_episodes=True
    )
    r_hs = simulate(sc, "phoenix", trajectories=trajectories, seed=seed, record_episodes=True)
    ttr_cr, ttr_hs = r_cr.time_to_resume(), r_hs.time_to_resume()
    both = (r_cr.episodes > 0) & (r_hs.episodes > 0)
    per_traj = r_cr.episode_sum_s[both] / r_hs.episode_sum_s[both]
    best = model.optimal_interval(sc.step_s, sc.ckpt_s, sc.restart_s, sc.system_mttf_s)
    expected_cr = sc.restart_s + sc.step_s * model.expected_replay_steps(k)
    expected_hs = sc.hotswap_s + 0.5 * sc.step_s
    return {
        "inputs": {
            **{k2: (list(v) if isinstance(v, tuple) else v) for k2, v in PAPER.items()},
            "scenario": sc.as_dict(),
        },
        "accountings": accountings,
        "analytic_expected_per_failure": {
            "checkpoint_restart_s": expected_cr,
            "hotswap_s": expected_hs,
            "ratio": expected_cr / expected_hs,
            "formula": f"({sc.restart_s:g} + {sc.step_s}*({k}-1)/2) / ({sc.hotswap_s:g} + 0.5*{sc.step_s})",
        },
        "monte_carlo": {
            "trajectories": trajectories,
            "seed": seed,
            "system_mttf_days": sc.system_mttf_s / 86400.0,
            "failures_per_run_cr": float(r_cr.failures.mean()),
            "failures_per_run_hotswap": float(r_hs.failures.mean()),
            "ettr_cr": r_cr.ettr_ci().as_dict(),
            "ettr_hotswap": r_hs.ettr_ci().as_dict(),
            "time_to_resume_cr_s": ttr_cr.as_dict(),
            "time_to_resume_hotswap_s": ttr_hs.as_dict(),
            "ratio_of_means": ratio_of_estimates(ttr_cr, ttr_hs).as_dict(),
            "per_run_ratio_runs": int(both.sum()),
            "per_run_ratio_p05_p50_p95": [float(v) for v in np.percentile(per_traj, [5, 50, 95])]
            if per_traj.size
            else None,
            "fraction_of_runs_with_ratio_le_18_8": float(np.mean(per_traj <= PAPER["paper_ratio"]))
            if per_traj.size
            else None,
            "optimal_k": {"young": best.young_steps, "daly": best.daly_steps, "exact": best.best_steps},
            "episodes_s": {
                "checkpoint_restart": _samples(r_cr),
                "hotswap": _samples(r_hs),
            },
        },
    }


def shard_loss_table(
    shards: int = 128, p: float = 1e-6, q: float = 1e-4, steps: int = 100_000, k_max: int = 3
) -> dict[str, Any]:
    """Eq. (6) for k = 1..k_max, independent (p) and correlated with aware placement (q)."""
    rows = []
    for case, prob in (("independent", p), ("correlated", q)):
        for k in range(1, k_max + 1):
            per_step, cum = model.shard_loss_independent(shards, prob, k, steps)
            exact = -math.expm1(steps * math.log1p(-min(per_step, 1.0))) if per_step < 1 else 1.0
            rows.append(
                {
                    "case": case,
                    "prob_per_step": prob,
                    "k": k,
                    "per_step": per_step,
                    "cumulative_union_bound": cum,
                    "cumulative_exact": exact,
                }
            )
    return {"inputs": {"shards": shards, "p": p, "q": q, "steps": steps, "k_max": k_max}, "rows": rows}


def scenario_at_scale(base: Scenario, gpus: int, cal: Calibration, overrides: dict[str, float]) -> Scenario:
    """``base`` at ``gpus`` GPUs with recovery costs from ``cal`` unless overridden by flags."""
    hot = float(cal.hotswap(gpus))
    vals: dict[str, Any] = {
        "gpus": gpus,
        "restart_s": float(cal.restart(gpus)),
        "hotswap_s": hot,
        "inplace_s": hot,
        "shrink_s": hot,
        "overhead_ratio": cal.overhead_ratio,
    }
    vals.update(overrides)
    return base.with_(**vals)


def policy_interval(sc: Scenario, policy: str) -> int | None:
    """Checkpoint interval each policy is run at: the exact-optimal ``K`` (Young/Daly family).

    checkpoint-restart: optimal for the system MTTF; in-place: optimal for the MTTF of permanent
    failures (transient ones never touch its checkpoint); phoenix / shrink: ``None`` (they use
    ``persist_every``).
    """
    policy = canonical_policy(policy)
    if policy == "checkpoint-restart":
        mttf = sc.system_mttf_s
    elif policy == "inplace":
        mttf = sc.permanent_mttf_s
    else:
        return None
    if not math.isfinite(mttf):
        return sc.steps
    return model.optimal_interval(sc.step_s, sc.ckpt_s, sc.restart_s, mttf, max_steps=sc.steps).best_steps


def _policy_row(r: MCResult) -> dict[str, Any]:
    d = r.summary()
    d["lost_per_failure_mean_s"] = {c: d["lost_per_failure_s"][c]["mean"] for c in FAILURE_CAUSES}
    return d


def run_policies(
    sc: Scenario,
    policies: list[str],
    *,
    trajectories: int,
    seed: int,
    ckpt_every: int | None = None,
) -> dict[str, Any]:
    """Simulate ``sc`` under each policy (same failure streams) and collect their summaries."""
    out: dict[str, Any] = {"scenario": sc.as_dict(), "policies": {}, "warnings": []}
    waiting = [p for p in map(canonical_policy, policies) if p in ("checkpoint-restart", "inplace")]
    if sc.no_spare == "wait" and "phoenix" in map(canonical_policy, policies):
        waiting.append("phoenix")
    if waiting and sc.spares < sc.spares_needed:
        out["warnings"].append(
            f"{sc.gpus} GPUs: the spare pool ({sc.spares}) is below the {sc.spares_needed:.2g} nodes that are"
            f" on average waiting for replacement (node-loss rate x {sc.provision_s:g} s); "
            f"{', '.join(waiting)} will stall waiting for spares"
        )
    for pol in policies:
        pol = canonical_policy(pol)
        k = ckpt_every if (ckpt_every is not None and pol in ("checkpoint-restart", "inplace")) else None
        if k is None:
            k = policy_interval(sc, pol)
        r = simulate(sc, pol, ckpt_every=k, trajectories=trajectories, seed=seed)
        row = _policy_row(r)
        if pol == "checkpoint-restart":
            mt = sc.system_mttf_s
            best = model.optimal_interval(sc.step_s, sc.ckpt_s, sc.restart_s, mt, max_steps=sc.steps)
            row["interval_choice"] = {
                "young": best.young_steps,
                "daly": best.daly_steps,
                "exact": best.best_steps,
                "exact_ettr": best.best_ettr,
            }
        out["policies"][pol] = row
    return out


def scale_sweep(
    base: Scenario,
    gpus_list: list[int],
    policies: list[str],
    *,
    cal: Calibration | None = None,
    overrides: dict[str, float] | None = None,
    trajectories: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """ETTR of each policy from ``gpus_list[0]`` to ``gpus_list[-1]`` GPUs."""
    cal = cal or default_calibration()
    t0 = time.perf_counter()
    rows = []
    warnings: list[str] = []
    for w in gpus_list:
        sc = scenario_at_scale(base, w, cal, overrides or {})
        res = run_policies(sc, policies, trajectories=trajectories, seed=seed)
        warnings.extend(res["warnings"])
        rows.append(
            {
                "gpus": w,
                "nodes": sc.nodes,
                "system_mttf_s": sc.system_mttf_s,
                "restart_s": sc.restart_s,
                "hotswap_s": sc.hotswap_s,
                "overhead_ratio": sc.overhead_ratio,
                "policies": res["policies"],
            }
        )
    ettr_gain = []
    for row in rows:
        p = row["policies"]
        if "checkpoint-restart" in p and "phoenix" in p:
            ettr_gain.append(p["phoenix"]["ettr"]["mean"] / p["checkpoint-restart"]["ettr"]["mean"])
    notes = []
    top, bottom = max(gpus_list), min(gpus_list)
    for what, fit in (("hot-swap recovery", cal.hotswap), ("checkpoint-restart restart", cal.restart)):
        if fit.xs and top > 1.05 * max(fit.xs):
            notes.append(
                f"{what}: {fit.kind} fit extrapolated {top / max(fit.xs):,.3g}x beyond its largest point"
                f" ({max(fit.xs):,.0f} GPUs) to {top:,} GPUs"
            )
        if fit.xs and fit.kind == "log2" and bottom < min(fit.xs):
            notes.append(f"{what}: held at its value at {min(fit.xs):,.0f} GPUs (the fit's smallest point) below it")
    return {
        "base": base.as_dict(),
        "calibration": cal.as_dict(),
        "notes": notes,
        "warnings": warnings,
        "trajectories": trajectories,
        "seed": seed,
        "rows": rows,
        "phoenix_over_cr_ettr": ettr_gain,
        "runtime_s": time.perf_counter() - t0,
        "ci_note": "ETTR: mean over runs with 95% CI; losses per failure: ratio of means, 95% CI",
    }
