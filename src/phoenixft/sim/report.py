"""Plain-text tables for the ``phoenixft simulate`` subcommands (one function per command)."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "calibration_text",
    "fmt_ci",
    "fmt_ettr",
    "paper_text",
    "run_text",
    "shard_loss_text",
    "sweep_text",
    "table",
    "worked_text",
]


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces between columns."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        parts = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _g(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"


def fmt_ci(est: dict[str, float], digits: int = 4) -> str:
    """``mean [lo, hi]`` with ``digits`` significant digits."""
    return f"{_g(est['mean'], digits)} [{_g(est['ci95_lo'], digits)}, {_g(est['ci95_hi'], digits)}]"


def fmt_ettr(est: dict[str, float]) -> str:
    """``mean [lo, hi]`` with four decimals (ETTR is a fraction)."""
    return f"{est['mean']:.4f} [{est['ci95_lo']:.4f}, {est['ci95_hi']:.4f}]"


def worked_text(res: dict[str, Any]) -> str:
    """The worked example, term by term, then the exact-model check."""
    i, a = res["inputs"], res["analytic"]
    ck, hs = a["checkpoint_restart"], a["hotswap"]
    head = (
        f"Worked example (review Eq. 1-5): MTTF {i['mttf_s']:g} s, step {i['step_s']:g} s, K {i['k']},"
        f" restart {i['restart_s']:g} s, overhead {i['overhead_s']:g} s, hot-swap {i['hotswap_s']:g} s,"
        f" phi {i['phi']:g}"
    )
    rows = [
        ["E[R] = (K-1)/2 (steps)  (1)", f"{a['expected_replay_steps']:g}", "-"],
        ["overhead (s)", f"{ck['overhead_s']:g}", f"{hs['overhead_s']:g}"],
        ["restart / hot-swap (s)", f"{ck['restart_s']:g}", f"{hs['hotswap_s']:g}"],
        ["replay / partial step (s)", f"{ck['replay_s']:g}", f"{hs['partial_step_s']:g}"],
        ["E[C] per failure (s)  (2),(5)", f"{ck['disruption_s']:g}", f"{hs['disruption_s']:g}"],
        ["eta = MTTF/(MTTF+E[C])  (4)", f"{ck['eta']:.3f}", f"{hs['eta']:.3f}"],
    ]
    out = [head, table(["term", "checkpoint-restart", "hot-swap"], rows)]
    out.append(
        f"disruption ratio {ck['disruption_s']:g} / {hs['disruption_s']:g} = {a['disruption_ratio']:.1f}x"
    )
    ex = res.get("exact_model")
    if ex:
        out.append("")
        out.append(
            f"Same cluster, exact model ({ex['note']}); {ex['trajectories']} runs of {ex['steps']} steps;"
            f" Young K={ex['young_daly']['young_steps']}, Daly K={ex['young_daly']['daly_steps']}"
        )
        rows = [
            [
                r["label"],
                f"{r['exact_ettr']:.4f}",
                fmt_ettr(r["mc_ettr_pooled"]),
                fmt_ettr(r["mc_ettr_per_run"]),
                f"{r['failures_per_run']:.1f}",
            ]
            for r in ex["rows"]
        ]
        out.append(
            table(
                ["policy", "exact ETTR", "MC ETTR pooled [95% CI]", "MC ETTR per run", "failures/run"], rows
            )
        )
    return "\n".join(out)


def paper_text(res: dict[str, Any]) -> str:
    """The two-failure arithmetic under several accountings, then the Monte Carlo distribution."""
    i = res["inputs"]
    out = [
        f"Paper scenario: {i['model']}, {i['nodes']} nodes x {i['gpus_per_node']} GPUs, {i['step_s']} s/step,"
        f" checkpoint every {i['ckpt_every']} steps ({i['ckpt_s']} s), restart {i['restart_s']:g} s,"
        f" failures {i['failure_steps_after_ckpt'][0]} and {i['failure_steps_after_ckpt'][1]} steps after a"
        f" checkpoint, hot-swap {i['hotswap_s'][0]} s and {i['hotswap_s'][1]} s; paper: "
        f"{i['paper_fraction'] * 100:.1f}% ({i['paper_ratio']}x)",
        "",
    ]
    rows = [
        [
            a["accounting"],
            a["checkpoint_restart_formula"],
            f"{a['checkpoint_restart_s']:.2f}",
            f"{a['hotswap_s']:.1f}",
            f"{a['ratio']:.2f}x",
            f"{a['hotswap_fraction'] * 100:.2f}%",
            "yes" if a["reproduces_paper"] else "no",
        ]
        for a in res["accountings"]
    ]
    out.append(
        table(["accounting", "checkpoint-restart (s)", "=", "hot-swap (s)", "ratio", "hs/cr", "18.8x?"], rows)
    )
    e = res["analytic_expected_per_failure"]
    out.append("")
    out.append(f"expected per failure (uniform failure position): {e['formula']} = {e['ratio']:.1f}x")
    mc = res["monte_carlo"]
    out.append("")
    out.append(
        f"Monte Carlo, {mc['trajectories']} runs (system MTTF {mc['system_mttf_days']:.2f} days;"
        f" failures/run {mc['failures_per_run_cr']:.2f} CR, {mc['failures_per_run_hotswap']:.2f} hot-swap;"
        f" same failure times for both)"
    )
    rows = [
        ["ETTR", fmt_ettr(mc["ettr_cr"]), fmt_ettr(mc["ettr_hotswap"])],
        [
            "time to resume per failure (s)",
            fmt_ci(mc["time_to_resume_cr_s"]),
            fmt_ci(mc["time_to_resume_hotswap_s"]),
        ],
    ]
    out.append(table(["", "checkpoint-restart K=5000", "hot-swap"], rows))
    out.append(f"ratio of mean time to resume: {fmt_ci(mc['ratio_of_means'], 3)} x")
    pr = mc["per_run_ratio_p05_p50_p95"]
    if pr:
        out.append(
            f"per-run ratio over {mc['per_run_ratio_runs']} runs with failures: p5 {pr[0]:.1f}x, median"
            f" {pr[1]:.1f}x, p95 {pr[2]:.1f}x; runs at or below 18.8x:"
            f" {mc['fraction_of_runs_with_ratio_le_18_8'] * 100:.1f}%"
        )
    ok = mc["optimal_k"]
    out.append(
        f"optimal checkpoint interval for this MTTF: Young {ok['young']}, Daly {ok['daly']},"
        f" exact {ok['exact']}"
    )
    return "\n".join(out)


def shard_loss_text(res: dict[str, Any]) -> str:
    """Eq. (6) table."""
    i = res["inputs"]
    head = (
        f"Shard loss, Eq. (6): D={i['shards']} shards, {i['steps']:g} steps,"
        f" p={i['p']:g} (node), q={i['q']:g} (domain)"
    )
    rows = [
        [
            r["case"],
            f"{r['prob_per_step']:g}",
            str(r["k"]),
            f"{r['per_step']:.3g}",
            f"{r['cumulative_union_bound']:.3g}",
            f"{r['cumulative_exact']:.3g}",
        ]
        for r in res["rows"]
    ]
    return (
        head
        + "\n"
        + table(
            ["failures", "p or q", "k", "per step D*p^(k+1)", "cumulative (bound)", "cumulative 1-(1-P)^n"],
            rows,
        )
    )


def _causes_line(p: dict[str, Any]) -> str:
    parts = [f"{c} {v:.3g}" for c, v in p["lost_per_failure_mean_s"].items() if v > 0]
    return ", ".join(parts) if parts else "-"


def run_text(res: dict[str, Any]) -> str:
    """One row per policy: ETTR, failures, lost time per failure by cause."""
    sc = res["scenario"]
    mttf = sc["system_mttf_s"]
    head = (
        f"{sc['gpus']} GPUs ({sc['nodes']} nodes), {sc['steps']} steps of {sc['step_s']:g} s, system MTTF"
        f" {mttf / 60:.1f} min, {sc['arrival']} arrivals, restart {sc['restart_s']:.1f} s, hot-swap"
        f" {sc['hotswap_s']:.1f} s, spares {sc['spares']}, {res['trajectories']} runs"
    )
    rows = []
    for name, p in res["policies"].items():
        k = p["ckpt_every"]
        rows.append(
            [
                name,
                str(k) if k else "-",
                fmt_ettr(p["ettr"]),
                f"{p['failures_per_run']['mean']:.1f}",
                fmt_ci(p["lost_per_failure_total_s"]),
                fmt_ci(p["time_to_resume_s"]),
                f"{p['runtime_s']:.1f}",
            ]
        )
    out = [
        head,
        table(
            ["policy", "K", "ETTR [95% CI]", "fail/run", "lost/failure s", "time to resume s", "sim s"], rows
        ),
    ]
    out.append("lost per failure by cause (s):")
    for name, p in res["policies"].items():
        out.append(f"  {name}: {_causes_line(p)}")
    out.extend(f"warning: {w}" for w in res.get("warnings", []))
    for name, p in res["policies"].items():
        if p["unfinished"]:
            out.append(
                f"warning: {name}: {p['unfinished']} of {p['trajectories']} runs did not finish within"
                " 10x the failure-free time (demand for spares or recovery exceeds what failures allow);"
                " their ETTR is progress / elapsed time"
            )
    return "\n".join(out)


def sweep_text(res: dict[str, Any]) -> str:
    """One row per scale: MTTF, recovery costs, K*, and each policy's ETTR with CI."""
    pols = list(res["rows"][0]["policies"]) if res["rows"] else []
    headers = ["GPUs", "MTTF min", "restart s", "hot-swap s", "K*"] + [f"ETTR {p}" for p in pols]
    rows = []
    for r in res["rows"]:
        cr = r["policies"].get("checkpoint-restart")
        rows.append(
            [
                f"{r['gpus']:,}",
                f"{r['system_mttf_s'] / 60:.1f}",
                f"{r['restart_s']:.0f}",
                f"{r['hotswap_s']:.1f}",
                str(cr["ckpt_every"]) if cr else "-",
                *(fmt_ettr(r["policies"][p]["ettr"]) for p in pols),
            ]
        )
    b = res["base"]
    head = (
        f"Scale sweep: {b['steps']} steps of {b['step_s']:g} s, GPU MTTF {b['gpu_mttf_s']:.3g} s,"
        f" {b['gpus_per_node']} GPUs/node, checkpoint write {b['ckpt_s']:g} s, {b['arrival']} arrivals,"
        f" transient {b['transient_frac']:g}, spares {b['spares']} (provision {b['provision_s']:g} s),"
        f" k={b['replicas']}, {res['trajectories']} runs per point; K* = exact-optimal checkpoint interval"
    )
    notes = "".join(f"\nnote: {n}" for n in res.get("notes", []))
    notes += "".join(f"\nwarning: {w}" for w in res.get("warnings", []))
    return head + "\n" + table(headers, rows) + notes + f"\n(simulated in {res['runtime_s']:.1f} s)"


def calibration_text(cal: dict[str, Any]) -> str:
    """Both fits with residuals, the chosen one, and every note."""
    out = [f"Calibration: {cal['source'] or 'defaults (no --calibrate)'}"]
    for what in ("hotswap", "restart"):
        cands = cal[f"{what}_candidates"]
        chosen = cal[f"{what}_fit"]
        label = "recovery (hot-swap)" if what == "hotswap" else "checkpoint-restart restart"
        if cands:
            for f in cands:
                res = ", ".join(f"{r:+.3g}" for r in f["residuals_s"])
                mark = " <- used" if f["formula"] == chosen["formula"] else ""
                out.append(
                    f"  {label}: {f['kind']:8s} {f['formula']:28s} rmse {f['rmse_s']:.3g} s,"
                    f" residuals [{res}]{mark}"
                )
        else:
            out.append(f"  {label}: {chosen['kind']} {chosen['formula']} (default anchors)")
    out.append(f"  protection overhead ratio: {cal['overhead_ratio']:.4f}")
    for m in cal["measured_cr_over_recovery"]:
        out.append(
            f"  measured at W={m['world_size']:g}: checkpoint-restart time to resume"
            f" {m['cr_time_to_resume_s']:.3g} s"
            f" vs recovery {m['recovery_s']:.3g} s ({m['ratio']:.1f}x)"
        )
    out.extend(f"  note: {n}" for n in cal["notes"])
    return "\n".join(out)
