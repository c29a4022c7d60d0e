"""PNG plots of the ``phoenixft simulate`` results (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _worked(plt: Any, res: dict[str, Any]) -> Any:
    a = res["analytic"]
    ck, hs = a["checkpoint_restart"], a["hotswap"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = ["checkpoint-restart", "hot-swap"]
    parts = [
        ("overhead", [ck["overhead_s"], hs["overhead_s"]]),
        ("restart / hot-swap", [ck["restart_s"], hs["hotswap_s"]]),
        ("replay / partial step", [ck["replay_s"], hs["partial_step_s"]]),
    ]
    bottom = np.zeros(2)
    for name, vals in parts:
        ax1.bar(labels, vals, bottom=bottom, label=name)
        bottom += np.array(vals)
    ax1.set_ylabel("expected disruption per failure (s)")
    ax1.set_title(f"Eq. (2)/(5): eta {ck['eta']:.3f} vs {hs['eta']:.3f}")
    ax1.legend()
    ex = res.get("exact_model")
    if ex:
        names = [r["label"] for r in ex["rows"]]
        mc = [r["mc_ettr_pooled"]["mean"] for r in ex["rows"]]
        err = [
            [m - r["mc_ettr_pooled"]["ci95_lo"] for m, r in zip(mc, ex["rows"], strict=True)],
            [r["mc_ettr_pooled"]["ci95_hi"] - m for m, r in zip(mc, ex["rows"], strict=True)],
        ]
        x = np.arange(len(names))
        ax2.bar(x - 0.2, [r["exact_ettr"] for r in ex["rows"]], 0.4, label="exact")
        ax2.bar(x + 0.2, mc, 0.4, yerr=err, label="Monte Carlo (95% CI)")
        ax2.axhline(
            ck["eta"], ls="--", c="gray", lw=1, label=f"Eq. (4), checkpoint-restart K={res['inputs']['k']}"
        )
        ax2.set_xticks(x, [n.replace(" (", "\n(") for n in names], fontsize=7)
        ax2.set_ylabel("ETTR")
        ax2.set_ylim(0, 1)
        ax2.set_title("exact model vs Monte Carlo")
        ax2.legend(fontsize=7)
    return fig


def _paper(plt: Any, res: dict[str, Any]) -> Any:
    mc = res["monte_carlo"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    eps = mc["episodes_s"]
    data = [np.array(eps["checkpoint_restart"]), np.array(eps["hotswap"])]
    allv = np.concatenate([d for d in data if d.size]) if any(d.size for d in data) else np.array([1.0, 10.0])
    bins = np.logspace(np.log10(max(allv.min(), 1.0)), np.log10(allv.max() * 1.1), 40)
    for d, lab in zip(data, ["checkpoint-restart (K=5000)", "hot-swap"], strict=True):
        if d.size:
            ax.hist(d, bins=bins, alpha=0.6, label=f"{lab}: mean {d.mean():.0f} s")
    i = res["inputs"]
    t, r = i["step_s"], i["restart_s"]
    for s_after, h in zip(i["failure_steps_after_ckpt"], i["hotswap_s"], strict=True):
        ax.axvline(r + s_after * t, c="C0", ls="--", lw=1)
        ax.axvline(h, c="C1", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("time to resume per failure (s); dashed: the paper's two failures")
    ax.set_ylabel("failures")
    ax.set_title(
        f"Paper scenario, {mc['trajectories']} runs: ratio of means {mc['ratio_of_means']['mean']:.0f}x"
    )
    ax.legend()
    return fig


def _shard(plt: Any, res: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for case, mk in (("independent", "o-"), ("correlated", "s-")):
        rows = [r for r in res["rows"] if r["case"] == case]
        ax.plot(
            [r["k"] for r in rows],
            [max(r["cumulative_exact"], 1e-300) for r in rows],
            mk,
            label=f"{case} (p={rows[0]['prob_per_step']:g})",
        )
    ax.set_yscale("log")
    ax.set_xlabel("replicas k")
    ax.set_ylabel(f"P(shard loss) over {res['inputs']['steps']:g} steps")
    ax.set_xticks(sorted({r["k"] for r in res["rows"]}))
    ax.set_title(f"Eq. (6), D={res['inputs']['shards']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _sweep(plt: Any, res: dict[str, Any]) -> Any:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = res["rows"]
    w = np.array([r["gpus"] for r in rows], dtype=float)
    for pol in rows[0]["policies"] if rows else []:
        m = np.array([r["policies"][pol]["ettr"]["mean"] for r in rows])
        lo = np.array([r["policies"][pol]["ettr"]["ci95_lo"] for r in rows])
        hi = np.array([r["policies"][pol]["ettr"]["ci95_hi"] for r in rows])
        ax1.errorbar(w, m, yerr=[m - lo, hi - m], marker="o", capsize=3, label=pol)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("GPUs")
    ax1.set_ylabel("ETTR (mean, 95% CI)")
    ax1.set_ylim(0, 1.02)
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ax1.set_title("effective training time ratio vs scale")
    cal = res["calibration"]
    for key, lab, c in (
        ("hotswap_fit", "hot-swap recovery", "C1"),
        ("restart_fit", "checkpoint-restart restart", "C0"),
    ):
        f = cal[key]
        ax2.plot(
            w,
            [r["hotswap_s" if key == "hotswap_fit" else "restart_s"] for r in rows],
            c=c,
            label=f"{lab}: {f['formula']}",
        )
        pts = f["points"]
        if pts:
            ax2.plot([p["world_size"] for p in pts], [p["seconds"] for p in pts], "x", c=c, ms=8)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("GPUs (x: measured / anchor points)")
    ax2.set_ylabel("seconds")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    ax2.set_title("recovery cost model")
    return fig


def _run(plt: Any, res: dict[str, Any]) -> Any:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    pols = list(res["policies"])
    m = np.array([res["policies"][p]["ettr"]["mean"] for p in pols])
    lo = np.array([res["policies"][p]["ettr"]["ci95_lo"] for p in pols])
    hi = np.array([res["policies"][p]["ettr"]["ci95_hi"] for p in pols])
    ax1.bar(pols, m, yerr=[m - lo, hi - m], capsize=4)
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("ETTR (mean, 95% CI)")
    causes = list(next(iter(res["policies"].values()))["lost_per_failure_mean_s"]) if pols else []
    bottom = np.zeros(len(pols))
    for c in causes:
        vals = np.array([res["policies"][p]["lost_per_failure_mean_s"][c] for p in pols])
        if vals.any():
            ax2.bar(pols, vals, bottom=bottom, label=c)
            bottom += vals
    ax2.set_ylabel("seconds lost per failure, by cause")
    ax2.legend(fontsize=7)
    return fig


_PLOTTERS = {
    "worked-example": _worked,
    "paper-scenario": _paper,
    "shard-loss": _shard,
    "scale-sweep": _sweep,
    "run": _run,
}


def plot(command: str, result: dict[str, Any], path: str | Path) -> Path:
    """Draw the figure of ``command`` from its JSON-friendly ``result`` and save it as a PNG."""
    plt = _pyplot()
    fig = _PLOTTERS[command](plt, result)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
