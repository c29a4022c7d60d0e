"""Run every benchmark, one after the other, and merge the results into bench/results/latest.json.

    make bench            # = python bench/run_all.py          (full, about 15-20 min on 2 cores)
    make bench QUICK=1    # = python bench/run_all.py --quick  (each part at its quick settings)
    python bench/run_all.py --only overhead,recovery

Parts (each also runnable alone, each printing a table and writing its JSON and PNG into
bench/results/): overhead.py (failure-free overhead vs none, DDP, DCP save / async_save),
recovery.py (time-to-resume vs torchrun + DCP checkpoint-restart), torchft_peer.py (torchft
replica groups: survivor stall and heal), scaling.py (recovery stages vs world and model size),
recipe.py (failure-free step-time cost of bf16, clipping, sgd, lion, a cosine schedule; it runs
last, after the quick budget of the others, and adds about 1.5 min to `--quick`).
control_plane.py (the coordinator's detect / decide / publish with up to 4,096 simulated workers),
etcd.py (the etcd control plane against the TCPStore: step time, rendezvous, takeover, member loss),
transfer.py (bytes / seconds of a hot-swap's state transfer on `medium`; `small` with --quick),
script_overhead.py (a user's own script under `phoenixft launch` against torchrun; a hot-swap's resume),
mesh_shrink.py (a TP x PP x DP mesh with no spare drops a data-parallel replica and grows back).

latest.json holds the machine, every part's full result under `parts`, and the figures the
docs and the simulator read at the top level: overhead_ratio_dp2, baseline_vs_ddp_dp2,
dcp_sync_ratio_dp2, dcp_async_ratio_dp2, resume_speedup_k10, resume_speedup_k50,
torchft_heal_s (or null, with torchft_note), recipe_ratios (mode -> step-time ratio to fp32
adamw), control_plane_decide_s ({W: s}), recovery_transfer_gbps_medium,
recovery (list of {world_size, recovery_s, ...}),
checkpoint_restart (list of {world_size, time_to_resume_s, restart_s, k, ...}) and `targets`
(each target figure, hit or miss). Also writes bench/results/summary.md.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

from benchlib import RESULTS, log, machine_info, write_json

PARTS = ("overhead", "recovery", "torchft", "scaling", "recipe", "control_plane", "mesh", "transfer", "etcd",
         "script", "mesh_shrink")
QUICK_BUDGET_S = 180.0


def _g(d: dict[str, Any] | None, *path: Any) -> Any:
    for k in path:
        if d is None:
            return None
        d = (
            d.get(k)
            if isinstance(d, dict)
            else (d[k] if isinstance(d, list) and isinstance(k, int) and k < len(d) else None)
        )
    return d


def merge(parts: dict[str, Any], quick: bool, started: float, machine: dict[str, Any]) -> dict[str, Any]:
    ov, rc, tf, sc, rp, cp, ms, tr, et = (parts.get(k) or {} for k in PARTS[:9])
    c2 = next((c for c in ov.get("configs", []) if c["dp"] == 2), None)
    c4 = next((c for c in ov.get("configs", []) if c["dp"] == 4), None)
    calib_model = "tiny"
    out: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "machine": machine,
        "overhead_ratio_dp2": ov.get("overhead_ratio_dp2"),
        # the same protection with every replica over TCP (--replica-transport tcp), as between hosts
        "overhead_ratio_dp2_tcp": ov.get("overhead_ratio_dp2_tcp"),
        "mesh_step_ratio_3d_vs_dp": ms.get("step_time_ratio_3d_vs_dp"),
        # the etcd control plane against the embedded TCPStore
        "etcd_step_ratio_vs_tcpstore": et.get("step_time_ratio_etcd_vs_tcpstore"),
        "etcd_server_cpu_cores": et.get("etcd_server_cpu_cores"),
        "etcd_takeover_s": _g(et, "takeover", "downtime_s"),
        "etcd_rendezvous_s": et.get("rendezvous_s"),
        # the headline recovery and transfer keys (None where this mode did not measure them: the `small`
        # headline needs a full run)
        "phoenix_resume_s_small_dp2": _g(rc, "headline", "phoenix_time_to_resume_s")
        if _g(rc, "headline", "model") == "small" else None,
        "decide_s_small_dp2": _g(rc, "headline", "phoenix_decide_s")
        if _g(rc, "headline", "model") == "small" else None,
        "protect_bytes_per_step": _g(c2, "bytes_per_step", "phoenix_r1", "protect_bytes_per_step"),
        "protect_cpu_s_per_step": _g(c2, "bytes_per_step", "phoenix_r1", "protect_cpu_s_per_step"),
        "recovery_transfer_gbps": ((_g(rc, "headline", "phoenix_bytes_moved") or 0)
                                   / (_g(rc, "headline", "phoenix_transfer_s") or 1) / 1e9) or None,
        "recovery_transfer_model": _g(rc, "headline", "model"),
        # a hot-swap on `medium` (bench/transfer.py; --quick measures `small` and leaves this None)
        "recovery_transfer_gbps_medium": tr.get("recovery_transfer_gbps_medium"),
        "recovery_transfer_gbps_transfer_part": tr.get("recovery_transfer_gbps"),
        # the same bytes between two bare processes right after each hot-swap (bench/gloo_link.py), and the share
        "recovery_transfer_link_gbps": tr.get("recovery_transfer_link_gbps"),
        "recovery_transfer_vs_link": tr.get("recovery_transfer_vs_link"),
        "recovery_transfer_part_model": tr.get("model"),
        "mesh_recovery_s": {k: _g(ms, "hotswap", k, "recovery_s") for k in ("dp", "3d")} if ms else None,
        "overhead_model": ov.get("model"),
        "overhead_ratio_dp2_ci95": _g(c2, "ci95", "phoenix_r1"),
        "overhead_ratio_dp2_tcp_ci95": _g(c2, "ci95", "phoenix_r1_tcp"),
        "protect_cpu_s_per_step_tcp": _g(c2, "bytes_per_step", "phoenix_r1_tcp", "protect_cpu_s_per_step"),
        "overhead_ratio_dp4_r1": _g(c4, "ratios", "phoenix_r1"),
        "overhead_ratio_dp4_r2": _g(c4, "ratios", "phoenix_r2"),
        "baseline_vs_ddp_dp2": ov.get("baseline_vs_ddp_dp2"),
        "dcp_sync_ratio_dp2": _g(ov, "ddp", "ratios_vs_plain_ddp", "dcp_sync_every_step"),
        "dcp_async_ratio_dp2": _g(ov, "ddp", "ratios_vs_plain_ddp", "dcp_async_every_step"),
        "replicated_mb_per_worker_step_dp2": (_g(c2, "bytes_per_step", "phoenix_r1", "replicated_per_worker") or 0)
        / 1e6
        or None,
        "replication_hidden_fraction_dp2": _g(c2, "breakdown", "phoenix_r1", "hidden_fraction"),
        "headline_model": _g(rc, "headline", "model"),
        "phoenix_time_to_resume_s": _g(rc, "headline", "phoenix_time_to_resume_s"),
        "ckpt_restart_k10_time_to_resume_s": _g(rc, "headline", "ckpt_restart_k10_time_to_resume_s"),
        "ckpt_restart_k50_time_to_resume_s": _g(rc, "headline", "ckpt_restart_k50_time_to_resume_s"),
        "resume_speedup_k10": rc.get("resume_speedup_k10"),
        "resume_speedup_k50": rc.get("resume_speedup_k50"),
        "torchft_heal_s": tf.get("torchft_heal_s"),
        "torchft_first_commit_s": _g(tf, "runs", "tuned", "first_commit_s"),
        "phoenix_first_new_step_s": _g(rc, "headline", "phoenix_first_new_step_s"),
        "torchft_note": tf.get("torchft_note", "torchft part did not run"),
        "torchft_model": tf.get("model"),
        "torchft_survivor_stall_s": {k: v.get("survivor_stall_s") for k, v in (tf.get("runs") or {}).items()},
        "recovery_fit": _g(sc, "fits"),
        "recipe_model": rp.get("model"),
        "recipe_ratios": {k: v.get("ratio") for k, v in (rp.get("modes") or {}).items()} or None,
        "control_plane_detect_s": cp.get("control_plane_detect_s"),
        "control_plane_decide_s": cp.get("control_plane_decide_s"),
        "control_plane_publish_s": cp.get("control_plane_publish_s"),
        "recovery": [
            {
                "world_size": e["world_size"],
                "recovery_s": e["recovery_s"],
                "hotswap_s": e["hotswap_s"],
                "model": e["model"],
                "micro_batch": e["micro_batch"],
                "stages": e["stages"],
                "bytes_moved": e["bytes_moved"],
            }
            for e in sc.get("by_world", [])
        ],
        "checkpoint_restart": [
            {
                "world_size": e["world_size"],
                "time_to_resume_s": e["time_to_resume_s"],
                "restart_s": e["restart_s"],
                "k": e["k"],
                "model": e["model"],
                "steps_replayed": e["steps_replayed"],
                "step_time_s": e["step_time_s"],
            }
            for e in rc.get("checkpoint_restart", [])
            if e["model"] == calib_model
        ],
        "calibration_note": (
            f"`recovery` and `checkpoint_restart` hold only `{calib_model}` runs so that the "
            "simulator compares like with like; the headline model's numbers are under "
            "parts.recovery"
        ),
    }
    heal = out["torchft_heal_s"]
    ph = out["phoenix_time_to_resume_s"]
    same_model = out["torchft_model"] == out["headline_model"]
    out["targets"] = {
        "overhead_dp2_le_1.02": (out["overhead_ratio_dp2"] <= 1.02) if out["overhead_ratio_dp2"] else None,
        "resume_ge_10x_ckpt_restart_k50": (out["resume_speedup_k50"] >= 10) if out["resume_speedup_k50"] else None,
        "resume_faster_than_torchft_heal": (ph < heal) if (ph and heal and same_model) else None,
        "first_step_faster_than_torchft": (
            (out["phoenix_first_new_step_s"] < out["torchft_first_commit_s"])
            if (out["phoenix_first_new_step_s"] and out["torchft_first_commit_s"] and same_model)
            else None
        ),
        "recovery_sublinear_in_world": sc.get("recovery_sublinear"),
        "hotswap_sublinear_in_world": sc.get("hotswap_sublinear"),
        # the performance targets of the headline figures
        "overhead_dp2_le_1.03": _le(out["overhead_ratio_dp2"], 1.03),
        "overhead_dp2_tcp_le_1.03": _le(out["overhead_ratio_dp2_tcp"], 1.03),
        "baseline_vs_ddp_dp2_le_1.00": _le(out["baseline_vs_ddp_dp2"], 1.00),
        "resume_small_dp2_le_0.35s": _le(out["phoenix_resume_s_small_dp2"], 0.35),
        "decide_small_dp2_le_0.05s": _le(out["decide_s_small_dp2"], 0.05),
        "transfer_medium_ge_2gbps": None if out["recovery_transfer_gbps_medium"] is None
        else out["recovery_transfer_gbps_medium"] >= 2.0,
        "control_plane_1024_le_1s": _le(_at(out.get("control_plane_decide_s") or {}, 1024), 1.0),
        "control_plane_linear_1024_4096": _linear(out.get("control_plane_decide_s") or {}),
    }
    out["errors"] = {k: v["error"] for k, v in parts.items() if isinstance(v, dict) and "error" in v and k != "torchft"}
    out["elapsed_s"] = {k: (v or {}).get("elapsed_s") for k, v in parts.items()}
    out["elapsed_s"]["total"] = round(time.time() - started, 1)
    out["parts"] = parts
    return out


def _le(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


#: "growing at most linearly": decide(4096) / decide(1024) <= 4 x this (the 2 shared cores move a single
#: run's figures by about 10%)
LINEAR_SLACK = 1.1


def _at(decide: dict[Any, float], w: int) -> float | None:
    return decide.get(str(w), decide.get(w))  # int keys in process, str keys once through JSON


def _linear(decide: dict[Any, float]) -> bool | None:
    a, b = _at(decide, 1024), _at(decide, 4096)
    return None if not a or not b else b / a <= 4 * LINEAR_SLACK


def summary_md(res: dict[str, Any]) -> str:
    def f(x: Any, nd: int = 2, unit: str = "") -> str:
        return "-" if x is None else (f"{x:.{nd}f}{unit}" if isinstance(x, float) else f"{x}{unit}")

    flag = "" if res["mode"] == "full" else " --quick"
    ov = res["parts"].get("overhead") or {}
    rc = res["parts"].get("recovery") or {}
    tf = res["parts"].get("torchft") or {}
    sc = res["parts"].get("scaling") or {}
    t = res["targets"]
    worlds = ", ".join(str(e["world_size"]) for e in sc.get("by_world", []))
    hm = lambda ok: "-" if ok is None else ("hit" if ok else "miss")  # noqa: E731
    rows = [
        (
            "Failure-free overhead, phoenix/none median step, DP=2, k=1",
            f(res["overhead_ratio_dp2"], 3),
            "<= 1.02",
            hm(t["overhead_dp2_le_1.02"]),
            f"`python bench/overhead.py{flag}` (model {ov.get('model')})",
        ),
        (
            "Failure-free overhead, DP=4, k=1 / k=2",
            f"{f(res['overhead_ratio_dp4_r1'], 3)} / {f(res['overhead_ratio_dp4_r2'], 3)}",
            "",
            "",
            f"`python bench/overhead.py{flag}`",
        ),
        (
            "`--protect none` vs plain DDP + AdamW, DP=2",
            f(res["baseline_vs_ddp_dp2"], 3),
            "<= 1.00",
            hm(t.get("baseline_vs_ddp_dp2_le_1.00")),
            f"`python bench/overhead.py{flag}`",
        ),
        (
            "Targets: overhead DP=2 / resume / decide (small, DP=2)",
            f"{f(res['overhead_ratio_dp2'], 3)} / {f(res.get('phoenix_resume_s_small_dp2'), 3, ' s')} / "
            f"{f(res.get('decide_s_small_dp2'), 3, ' s')}",
            "<= 1.03 / <= 0.35 s / <= 0.05 s",
            " / ".join(hm(t.get(k)) for k in ("overhead_dp2_le_1.03", "resume_small_dp2_le_0.35s",
                                               "decide_small_dp2_le_0.05s")),
            f"`python bench/overhead.py{flag}`, `python bench/recovery.py{flag}`",
        ),
        (
            "Control plane decide at W = 1024 / 4096 simulated workers",
            " / ".join(f(_at(res.get("control_plane_decide_s") or {}, w), 3, " s") for w in (1024, 4096)),
            f"1024 <= 1.0 s; 4096 / 1024 <= {4 * LINEAR_SLACK:.1f}",
            f"{hm(t.get('control_plane_1024_le_1s'))} / {hm(t.get('control_plane_linear_1024_4096'))}",
            f"`python bench/control_plane.py{flag}`",
        ),
        (
            "DCP `save` every step / plain DDP, DP=2",
            f(res["dcp_sync_ratio_dp2"], 2),
            "",
            "",
            f"`python bench/overhead.py{flag}`",
        ),
        (
            "DCP `async_save` every step / plain DDP, DP=2",
            f(res["dcp_async_ratio_dp2"], 2),
            "",
            "",
            f"`python bench/overhead.py{flag}`",
        ),
        (
            "Time-to-resume, phoenix hot-swap (s)",
            f(res["phoenix_time_to_resume_s"], 2),
            "",
            "",
            f"`python bench/recovery.py{flag}` (model {res['headline_model']}, DP=2)",
        ),
        (
            "Time-to-resume, torchrun + DCP, K=10 (s) / speed-up",
            f"{f(res['ckpt_restart_k10_time_to_resume_s'])} / {f(res['resume_speedup_k10'], 1, 'x')}",
            "",
            "",
            f"`python bench/recovery.py{flag}`",
        ),
        (
            "Time-to-resume, torchrun + DCP, K=50 (s) / speed-up",
            f"{f(res['ckpt_restart_k50_time_to_resume_s'])} / {f(res['resume_speedup_k50'], 1, 'x')}",
            ">= 10x",
            hm(t["resume_ge_10x_ckpt_restart_k50"]),
            f"`python bench/recovery.py{flag}`",
        ),
        (
            "torchft heal, tuned timeouts: fault -> relaunched replica healed, ready (s)",
            f(res["torchft_heal_s"]),
            "> phoenix time-to-resume",
            hm(t["resume_faster_than_torchft_heal"]),
            f"`python bench/torchft_peer.py{flag}` (model {tf.get('model')})",
        ),
        (
            "First step at full strength after the fault (s): phoenix / torchft relaunched replica",
            f"{f(res['phoenix_first_new_step_s'])} / {f(res['torchft_first_commit_s'])}",
            "phoenix faster",
            hm(t["first_step_faster_than_torchft"]),
            f"`python bench/recovery.py{flag}`, `python bench/torchft_peer.py{flag}`",
        ),
        (
            "torchft survivor stall (s), tuned / default timeouts",
            " / ".join(f(v) for v in res["torchft_survivor_stall_s"].values()) or "-",
            "",
            "",
            f"`python bench/torchft_peer.py{flag}`",
        ),
        (
            "Recipe features, step time / fp32 adamw, DP=2: "
            + ", ".join(k for k in (res.get("recipe_ratios") or {}) if k != "baseline"),
            " / ".join(f(v, 2) for k, v in (res.get("recipe_ratios") or {}).items() if k != "baseline") or "-",
            "",
            "",
            f"`python bench/recipe.py{flag}` (model {res.get('recipe_model')}; bf16: "
            f"{'this CPU has bf16 units' if res.get('machine', {}).get('cpu_bf16') else 'no bf16 units on this CPU'})",
        ),
        (
            "Hot-swap state transfer, bytes / transfer seconds "
            f"(GB/s, model {res.get('recovery_transfer_part_model')})",
            f(res.get("recovery_transfer_gbps_transfer_part"), 2),
            ">= 2.0 (medium)",
            hm(None if res.get("recovery_transfer_gbps_medium") is None
               else res["recovery_transfer_gbps_medium"] >= 2.0),
            f"`python bench/transfer.py{flag}`",
        ),
        (
            "Hot-swap transfer / the bare link's GB/s for the same bytes, measured right after each hot-swap",
            f(res.get("recovery_transfer_vs_link"), 2),
            "",
            "",
            f"`python bench/transfer.py{flag}` (bare link {f(res.get('recovery_transfer_link_gbps'), 2)} GB/s, "
            "bench/gloo_link.py)",
        ),
        (
            "Recovery vs world size, power-law exponent b (y = a W^b)",
            f(_g(sc, "fits", "recovery_s", "power", "b"), 2),
            "< 1",
            hm(t["recovery_sublinear_in_world"]),
            f"`python bench/scaling.py{flag}` (W = {worlds})",
        ),
        (
            "Hot-swap (ready to train) vs world size, exponent b",
            f(_g(sc, "fits", "hotswap_s", "power", "b"), 2),
            "< 1",
            hm(t["hotswap_sublinear_in_world"]),
            f"`python bench/scaling.py{flag}`",
        ),
    ]
    how = ("each part's own latest run, merged by `python bench/run_all.py --merge`"
           if res.get("merged_from_part_files") else ('make bench' if res['mode'] == 'full' else 'make bench QUICK=1'))
    lines = [
        f"Measured {res['machine'].get('date')} on {res['machine'].get('cpu_count')} x "
        f"{res['machine'].get('cpu_model')}, torch {res['machine'].get('torch')} "
        f"({how}; {res['elapsed_s'].get('total')} s of benchmarks in all).",
        "",
        "| Figure | Measured | Target | Hit? | Command |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    if rc.get("phoenix"):
        lines += [
            "",
            "Recovery runs:",
            "",
            "| system | model | world | time-to-resume s | replayed steps | command |",
            "|---|---|---|---|---|---|",
        ]
        for e in rc["phoenix"] + rc.get("checkpoint_restart", []):
            name = e["system"] + (f" K={e['k']}" if "k" in e else "")
            lines.append(
                f"| {name} | {e['model']} | {e['world_size']} | {f(e['time_to_resume_s'])} | "
                f"{e['steps_replayed']} | `{e['command']}` |"
            )
    if tf.get("runs"):
        lines += ["", f"torchft ({res['torchft_note']}):", ""]
        for n, r in tf["runs"].items():
            lines.append(
                f"- {n} timeouts: survivor stall {f(r.get('survivor_stall_s'))} s; relaunched replica healed "
                f"(ready) {f(r.get('heal_s'))} s and committed its first step {f(r.get('first_commit_s'))} s "
                f"after the fault ({f(r.get('heal_after_relaunch_s'))} s after its relaunch); the survivor "
                f"committed {r.get('survivor_steps_with_fewer_participants')} steps with half the global batch "
                f"meanwhile; max |loss - failure-free loss| = "
                f"{f(r.get('trajectory_max_abs_loss_diff_vs_failure_free'), 4)}"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 3-minute version")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--merge", action="store_true",
                    help="run nothing: rebuild latest.json, summary.md and the figures in README.md and "
                         "docs/benchmarks.md from each part's own JSON in --out (after a part was run alone)")
    a = ap.parse_args()
    out = Path(a.out)
    if a.merge:
        return merge_files(out)
    started = time.time()
    machine = machine_info()
    wanted = [p for p in PARTS if not a.only or p in a.only.split(",")]
    parts: dict[str, Any] = {}
    for name in wanted:
        log(f"run_all: part {name} ({'quick' if a.quick else 'full'}), {time.time() - started:.0f}s elapsed")
        try:
            if name == "overhead":
                import overhead

                parts[name] = overhead.run(a.quick, out=out)
            elif name == "recovery":
                import recovery

                parts[name] = recovery.run(a.quick, out=out)
            elif name == "torchft":
                import torchft_peer

                parts[name] = torchft_peer.run(a.quick, out=out)
            elif name == "recipe":
                import recipe

                parts[name] = recipe.run(a.quick, out=out)
            elif name == "scaling":
                import scaling

                deadline = started + QUICK_BUDGET_S - 8 if a.quick else None
                parts[name] = scaling.run(a.quick, deadline=deadline, out=out)
            elif name == "control_plane":
                import control_plane

                parts[name] = control_plane.run(a.quick, out=out)
            elif name == "mesh":
                import mesh

                parts[name] = mesh.run(a.quick, out=out)
            elif name == "transfer":
                import transfer

                parts[name] = transfer.run(a.quick, out=out)
            elif name == "etcd":
                import etcd

                parts[name] = etcd.run(a.quick, out=out)
            elif name == "script":
                import script_overhead

                parts[name] = script_overhead.run(a.quick, out=out)
            elif name == "mesh_shrink":
                import mesh_shrink

                parts[name] = mesh_shrink.run(a.quick, out=out)
        except Exception as e:  # noqa: BLE001 - one failed part must not lose the others
            traceback.print_exc()
            parts[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    machine["loadavg_at_end"] = machine_info()["loadavg_at_start"]
    res = merge(parts, a.quick, started, machine)
    write_json(out / "latest.json", res)
    (out / "summary.md").write_text(summary_md(res))
    print("\n" + (out / "summary.md").read_text(), flush=True)
    log(f"run_all: done in {res['elapsed_s']['total']:.0f}s; wrote {out / 'latest.json'}")
    _write_docs(out)
    return 1 if res["errors"] else 0


def _write_docs(out: Path) -> None:
    """The figures of README.md and docs/benchmarks.md, from the results just written (bench/figures.py)."""
    if out.resolve() != RESULTS.resolve():
        return  # (results written elsewhere are not the docs' figures)
    import figures

    for path in figures.write():
        log(f"run_all: figures written into {path}")


def merge_files(out: Path) -> int:
    """latest.json and summary.md from each part's own file in `out` (every part keeps its latest run: one run
    alone replaces its file, and this brings the merged figures and the docs level with it); no part runs."""
    parts: dict[str, Any] = {}
    for name in PARTS:
        path = out / f"{name}.json"
        if path.is_file():
            parts[name] = json.loads(path.read_text())
    if not parts:
        log(f"run_all --merge: no part's JSON in {out}")
        return 1
    headline = parts.get("overhead") or next(iter(parts.values()))
    machine = dict(headline.get("machine") or {})
    machine["note"] = "each part's own machine and load are in its file (parts.<name>.machine)"
    res = merge(parts, False, time.time(), machine)
    res["elapsed_s"]["total"] = round(sum(v for k, v in res["elapsed_s"].items() if isinstance(v, int | float)), 1)
    res["merged_from_part_files"] = sorted(parts)
    write_json(out / "latest.json", res)
    (out / "summary.md").write_text(summary_md(res))
    log(f"run_all --merge: wrote {out / 'latest.json'} and {out / 'summary.md'} from {', '.join(sorted(parts))}")
    _write_docs(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
