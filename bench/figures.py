"""The measured figures of README.md and docs/benchmarks.md, written from the files in bench/results/.

    python bench/figures.py            # check: exit 1 naming each block that differs from its files
    python bench/figures.py --write    # rewrite the blocks (bench/run_all.py does this after a run)

Each block of figures in those documents sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`
and is rendered here from the results files it names, so a document cannot say another number than the
file a benchmark wrote (tests/test_docs.py checks every block, and that no measured figure stands outside
one). A figure whose file does not exist yet is not shown.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"

__all__ = ["BLOCKS", "render", "write", "check", "blocks_of"]

_BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def _load(name: str, results: Path) -> dict[str, Any]:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _g(d: Any, *path: Any) -> Any:
    for k in path:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def _f(x: Any, nd: int = 2, unit: str = "") -> str:
    return "-" if x is None else f"{x:,.{nd}f}{unit}"


def _pct(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{nd}f}%"


def _ci(ci: Any, nd: int = 3) -> str:
    return f"95% CI {_f(ci[0], nd)}-{_f(ci[1], nd)}" if isinstance(ci, list) and len(ci) == 2 else "no CI"


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _dp2(ov: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in ov.get("configs", []) if c.get("dp") == 2), {})


def _dp4(ov: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in ov.get("configs", []) if c.get("dp") == 4), {})


# ---------------------------------------------------------------------------------------------- rows
def _row_overhead(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    ov = r("overhead")
    c2 = _dp2(ov)
    if not ov:
        return []
    return [
        ["failure-free overhead, protected / unprotected median step, DP=2, 1 replica, every default check on",
         f"**{_f(ov.get('overhead_ratio_dp2'), 3)}** ({_ci(_g(c2, 'ci95', 'phoenix_r1'))}); replicas over TCP: "
         f"{_f(ov.get('overhead_ratio_dp2_tcp'), 3)} ({_ci(_g(c2, 'ci95', 'phoenix_r1_tcp'))})",
         "`python bench/overhead.py`", "`overhead.json`"],
        ["`--protect none` / plain DDP + AdamW step time, DP=2", _f(ov.get("baseline_vs_ddp_dp2"), 3),
         "`python bench/overhead.py`", "`overhead.json`"],
    ]


def _row_recovery(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    h = r("recovery").get("headline") or {}
    if not h:
        return []
    return [
        [f"time to resume after a node kill, `{h.get('model')}`, DP={h.get('world_size')}",
         f"**{_f(h.get('phoenix_time_to_resume_s'), 3, ' s')}**, {h.get('phoenix_steps_replayed')} steps replayed",
         "`python bench/recovery.py`", "`recovery.json`"],
        ["decision (failure flag to plan published), same runs", _f(h.get("phoenix_decide_s"), 3, " s"),
         "`python bench/recovery.py`", "`recovery.json`"],
        ["torchrun + DCP time to resume, checkpoint every 10 / 50 steps, same invocation",
         f"{_f(h.get('ckpt_restart_k10_time_to_resume_s'), 2, ' s')} / "
         f"{_f(h.get('ckpt_restart_k50_time_to_resume_s'), 2, ' s')}: **{_f(h.get('resume_speedup_k10'), 0, 'x')} / "
         f"{_f(h.get('resume_speedup_k50'), 0, 'x')}** slower", "`python bench/recovery.py`", "`recovery.json`"],
    ]


def _row_health(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    hg = r("health_gate")
    med = hg.get("summary") or {}
    if not med:
        return []
    def s(setting: str, key: str) -> str:
        return _f(_g(med, setting, key), 3, " s")
    return [[f"a spare's health check before its promotion (`--health-max-age 0`) / no gate / the default, "
             f"`{hg.get('model', 'tiny')}`: time to resume; decision",
             f"{s('strict', 'time_to_resume_s')} / {s('off', 'time_to_resume_s')} / "
             f"{s('default', 'time_to_resume_s')}; {s('strict', 'decide_s')} / {s('off', 'decide_s')} / "
             f"{s('default', 'decide_s')}", f"`{hg.get('command', 'python bench/health_gate.py')}`",
             "`health_gate.json`"]]


def _row_peers(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    rows = []
    tf = r("torchft")
    if tf.get("torchft_heal_s") is not None:
        rows.append(["torchft 0.2.0 heal (relaunched replica ready), tuned timeouts",
                     _f(tf["torchft_heal_s"], 2, " s"), "`python bench/torchft_peer.py`", "`torchft.json`"])
    sc = r("scaling")
    by = [e for e in sc.get("by_world", []) if e.get("model") == "tiny"]
    if by:
        rows.append([f"hot-swap (fault to ready to train) at W = {', '.join(str(e['world_size']) for e in by)} "
                     "workers (`tiny`)", ", ".join(_f(e.get("hotswap_s"), 3) for e in by) + " s",
                     "`python bench/scaling.py`", "`scaling.json`"])
    tr = r("transfer")
    if tr.get("recovery_transfer_gbps") is not None:
        mb = _g(tr, "runs", 0, "bytes_moved")
        rows.append([f"hot-swap state transfer, `{tr.get('model')}`" + (f" ({mb / 1e6:,.0f} MB)" if mb else ""),
                     f"**{_f(tr['recovery_transfer_gbps'], 2, ' GB/s')}** "
                     f"({_f(tr.get('recovery_transfer_vs_link'), 2)} of the bare link)", "`python bench/transfer.py`",
                     "`transfer.json`"])
    return rows


def _row_scale(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    rows = []
    cp = r("control_plane").get("control_plane_decide_s") or {}
    if cp.get("1024") is not None and cp.get("4096") is not None:
        rows.append(["coordinator decision at 1,024 / 4,096 simulated workers",
                     f"{_f(cp['1024'], 3, ' s')} / {_f(cp['4096'], 3, ' s')}", "`python bench/control_plane.py`",
                     "`control_plane.json`"])
    ms = r("mesh")
    if ms.get("step_time_ratio_3d_vs_dp") is not None:
        rows.append([f"3D (TP=2 x PP=2 x DP=2) / data-parallel step time, `{ms.get('model')}`",
                     _f(ms["step_time_ratio_3d_vs_dp"], 2), "`python bench/mesh.py`", "`mesh.json`"])
    et = r("etcd")
    if et.get("step_time_ratio_etcd_vs_tcpstore") is not None:
        rows.append(["etcd / TCPStore step time; standby coordinator takeover",
                     f"{_f(et['step_time_ratio_etcd_vs_tcpstore'], 2)}; "
                     f"{_f(_g(et, 'takeover', 'downtime_s'), 2, ' s')}",
                     "`python bench/etcd.py`", "`etcd.json`"])
    return rows


def _row_checks(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    rows = []
    sdc, scrub = r("sdc"), r("scrub")
    m = sdc.get("modes") or {}
    if m:
        share = lambda k: _pct(_g(m, k, "own_share_of_unchecked_step"), 2)  # noqa: E731
        sc = _g(scrub, "results", "1", "scrub_cpu_share")
        rows.append([f"silent-data-corruption checks' own time per step (mean), `{sdc.get('model')}` "
                     f"DP={sdc.get('dp')}: fingerprints / spike guard / sampled audits"
                     + (" / scrubbing" if sc is not None else ""),
                     f"{share('fingerprints')} / {share('spike_guard')} / {share('sampled_audits')}"
                     + (f" / {_pct(sc)}" if sc is not None else ""),
                     "`python bench/sdc.py`" + (", `python bench/scrub.py`" if sc is not None else ""),
                     "`sdc.json`" + (", `scrub.json`" if sc is not None else "")])
    st = r("stragglers")
    ev = _g(st, "runs", "evict", "after_over_before")
    if ev is not None:
        rows.append(["a straggler (`slow:` factor 3) evicted: median step after / before the fault", _f(ev, 2),
                     "`python bench/stragglers.py`", "`stragglers.json`"])
    dr = r("drain")
    if dr.get("kill") and dr.get("preempt"):
        k, p = dr["kill"], dr["preempt"]
        rows.append(["planned drain against a kill on the same job: lost steps, training time lost (kill / drain)",
                     f"{k.get('lost_steps')} / {p.get('lost_steps')}; {_f(k.get('training_time_lost_s'), 3, ' s')} / "
                     f"{_f(p.get('training_time_lost_s'), 3, ' s')}", "`python bench/drain.py`", "`drain.json`"])
    return rows


def _row_security(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    rows = []
    tl = r("tls")
    if tl.get("round_trip_ratio") is not None:
        rt = tl.get("round_trip_s") or {}
        rows.append([f"control plane over TLS / plain TCPStore (`{tl.get('model')}`, DP=2): store round trip, step "
                     "time, hot-swap recovery",
                     f"{_f(tl['round_trip_ratio'], 0, 'x')} ({_f(1e3 * rt.get('plain', 0), 2)} -> "
                     f"{_f(1e3 * rt.get('tls', 0), 2)} ms); {_f(tl.get('step_time_ratio_tls_vs_plain'), 2)}; "
                     f"{_f(tl.get('recovery_ratio_tls_vs_plain'), 2)}",
                     f"`python bench/tls.py --quick --rounds {tl.get('rounds', 3)}`", "`tls.json`"])
    sg = r("signing")
    if sg.get("step_time_ratio_now_vs_before") is not None:
        rows.append(["values sealed with the run key / the same code without sealing, one invocation: step time, "
                     "CPU per run, recovery",
                     f"{_f(sg['step_time_ratio_now_vs_before'], 2)} ({_ci(sg.get('step_time_ratio_ci95'), 2)}); "
                     f"{_f(sg.get('run_cpu_ratio_now_vs_before'), 2)}; {_f(sg.get('recovery_ratio_now_vs_before'), 2)}",
                     "`python bench/signing.py`", "`signing.json`"])
    return rows


def _row_script(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    sc = r("script")
    if not sc:
        return []
    la = _g(sc, "machine", "loadavg_at_start") or ["?"]
    res = sc.get("resume") or {}
    return [
        [f"your own script under `phoenixft launch` / the same script under torchrun, median step, DP={sc.get('dp')} "
         f"(3.4M-parameter MLP, AdamW); `--protect none` / torchrun; measured at load average {_f(la[0], 1)}",
         f"{_f(sc.get('overhead_vs_torchrun'), 3)} ({_ci(sc.get('overhead_vs_torchrun_ci95'))}); "
         f"{_f(sc.get('none_vs_torchrun'), 3)}", "`python bench/script_overhead.py`", "`script.json`"],
        ["the same script: time to resume after a node kill (hot-swap)",
         f"{_f(res.get('recovery_s'), 3, ' s')}, {res.get('lost_steps')} steps lost",
         "`python bench/script_overhead.py`", "`script.json`"],
    ]


def _row_mesh_shrink(r: Callable[[str], dict[str, Any]]) -> list[list[str]]:
    ms = r("mesh_shrink")
    if not ms:
        return []
    dev = max(ms.get("loss_rel_deviation_per_step") or [0.0])
    return [["a TP=2 x PP=2 x DP=2 mesh with no spare: drop a data-parallel replica / grow back; shrunk / full step; "
             "largest relative loss deviation from the failure-free run",
             f"{_f(_g(ms, 'shrink', 'recovery_s'), 2, ' s')} / {_f(_g(ms, 'grow', 'recovery_s'), 2, ' s')}; "
             f"{_f(ms.get('step_time_ratio_shrunk_vs_full'), 2)}; {dev:.1e}",
             "`python bench/mesh_shrink.py --quick`", "`mesh_shrink.json`"]]


def _machine(r: Callable[[str], dict[str, Any]]) -> str:
    m = r("overhead").get("machine") or r("latest").get("machine") or {}
    return (f"Measured on a {m.get('cpu_count', '?')}-core {m.get('cpu_model', '?')} machine, torch "
            f"{m.get('torch', '?')}, gloo over loopback, model `small` (11M parameters) unless stated; each figure "
            "from the file of `bench/results/` named beside it, which the command beside it writes (each file "
            "holds its machine and load average).\n")


def _readme(r: Callable[[str], dict[str, Any]]) -> str:
    rows = (_row_overhead(r) + _row_script(r) + _row_recovery(r) + _row_health(r) + _row_peers(r) + _row_scale(r)
            + _row_mesh_shrink(r) + _row_checks(r) + _row_security(r))
    rows.append(["final state after a kill in any phase, crash, hang, rack loss, cascade, persistent fallback",
                 "bitwise equal to the failure-free run", "`make test`", "the test suite"])
    return _machine(r) + "\n" + _table(["figure", "measured", "command", "file"], rows)


def _control_plane(r: Callable[[str], dict[str, Any]]) -> str:
    runs = r("control_plane").get("runs") or []
    rows = [[f"{x['workers']:,} ({x['nodes']})", _f(x.get("detect_s"), 3), _f(x.get("gather_s"), 3),
             _f(x.get("decide_s"), 3), _f(x.get("publish_s"), 3), _f(x.get("coordinator_cpu_s"), 2)]
            for x in runs]
    return _table(["W (nodes)", "detect s", "gather s", "decide s", "publish s", "coordinator CPU s"], rows)


def _tls(r: Callable[[str], dict[str, Any]]) -> str:
    t = r("tls")
    if not t:
        return ""
    rt, st, rc = t.get("round_trip_s") or {}, t.get("step_time_s") or {}, t.get("recovery_s") or {}
    all_ = t.get("recovery_s_all") or {}
    runs = lambda k: ", ".join(_f(x, 2) for x in all_.get(k, []))  # noqa: E731
    return _table(["figure", "plain", "TLS", "TLS / plain"], [
        ["store `set` + `get` round trip, 64-byte value (median)", _f(1e3 * rt.get("plain", 0), 2, " ms"),
         _f(1e3 * rt.get("tls", 0), 2, " ms"), _f(t.get("round_trip_ratio"), 1)],
        [f"failure-free step, median after the warm-up, {t.get('rounds')} rounds of {t.get('steps')} steps",
         _f(st.get("plain"), 3, " s"), _f(st.get("tls"), 3, " s"),
         f"**{_f(t.get('step_time_ratio_tls_vs_plain'), 2)}**"],
        ["hot-swap recovery (`kill:node=1@step=6`), `recovery_s`, median",
         f"{_f(rc.get('plain'), 2, ' s')} ({runs('plain')})", f"{_f(rc.get('tls'), 2, ' s')} ({runs('tls')})",
         _f(t.get("recovery_ratio_tls_vs_plain"), 2)],
    ])


def _scrub(r: Callable[[str], dict[str, Any]]) -> str:
    res = r("scrub").get("results") or {}
    rows = []
    for every, x in sorted(res.items(), key=lambda kv: int(kv[0])):
        label = {"0": "0 (off)", "1": "1 (default)"}.get(every, every)
        rows.append([label, _f(1e3 * x["step_s_median"], 1), _f(x.get("vs_off"), 3),
                     _f((x.get("scrub_bytes_median") or 0) / 2**20, 1, " MiB"),
                     _f(1e3 * (x.get("scrub_cpu_s_median") or 0), 2, " ms"), _pct(x.get("scrub_cpu_share")),
                     _f(1e3 * (x.get("scrub_s_median") or 0), 1, " ms"),
                     _f(1e3 * (x.get("repl_wait_s_median") or 0), 1, " ms")])
    return _table(["`--scrub-every`", "step ms (median)", "vs off", "re-hashed per step (rank 0)",
                   "scrubber CPU per step", "of the step", "scrubber wall per step", "loop waited for protection"],
                  rows)


def _drain(r: Callable[[str], dict[str, Any]]) -> str:
    d = r("drain")
    if not d.get("kill"):
        return ""
    k, p, ra = d["kill"], d["preempt"], d.get("ratios_kill_over_preempt") or {}
    return _table(["", "kill", "preempt (drain)", "kill/preempt"], [
        ["detection (fault or notice to the first descriptor)", _f(k.get("detect_s"), 3, " s"),
         _f(p.get("detect_s"), 3, " s"), _f(ra.get("detect_s"), 2)],
        ["lost (replayed) steps", str(k.get("lost_steps")), str(p.get("lost_steps")), "-"],
        ["training time lost (last step before to the first new step after, less one step)",
         _f(k.get("training_time_lost_s"), 3, " s"), _f(p.get("training_time_lost_s"), 3, " s"),
         _f(ra.get("training_time_lost_s"), 2)],
        ["fault (notice) to the first step at full strength", _f(k.get("fault_to_full_strength_s"), 3, " s"),
         _f(p.get("fault_to_full_strength_s"), 3, " s"), _f(ra.get("fault_to_full_strength_s"), 2)],
        ["notice to swapped", "-", _f(p.get("notice_to_swapped_s"), 3, " s"), "-"],
        ["bytes moved to the spare", f"{k.get('bytes_moved'):,}", f"{p.get('bytes_moved'):,}", "-"],
        ["final state", "bitwise equal to each other" if d.get("final_states_equal") else "DIFFERENT", "", ""],
    ])


def _stragglers(r: Callable[[str], dict[str, Any]]) -> str:
    runs = r("stragglers").get("runs") or {}
    if not runs:
        return ""
    rows = [["failure-free", f"{_f(_g(runs, 'clean', 'median_s'), 3, ' s')} (whole run)", "", "", "", "", ""]]
    for name, label in (("evict", "slow node, evicted"), ("report", "slow node, `--no-evict-stragglers`")):
        x = runs.get(name) or {}
        s = x.get("straggler") or {}
        rows.append([label, _f(x.get("before_s"), 3, " s"),
                     f"{_f(x.get('during_s'), 3, ' s')} ({_f(x.get('during_over_before'), 2, 'x')})",
                     _f(x.get("after_s"), 3, " s") if x.get("after_s") is not None else "(slow to the end)",
                     f"**{_f(x.get('after_over_before'), 2)}**" if x.get("after_over_before") is not None else "",
                     str(s.get("evicted_at_step")) if s.get("evicted") else "not evicted",
                     _f(s.get("ratio"), 2, "x")])
    return _table(["run", "before", "during", "after", "after / before", "evicted after step", "flagged ratio"], rows)


def _sdc(r: Callable[[str], dict[str, Any]]) -> str:
    m = r("sdc").get("modes") or {}
    if not m:
        return ""
    labels = (("fingerprints", "parameter fingerprints (`--sdc-check-every 1`, the default)"),
              ("spike_guard", "spike guard"), ("sampled_audits", "sampled audits (`--sdc-audit sample "
                                                                   "--sdc-audit-every 10`)"),
              ("defaults", "defaults (fingerprints + guard)"))
    rows = [[label, _f(1e3 * (_g(m, k, "own_s_per_step") or 0), 2, " ms"),
             _pct(_g(m, k, "own_share_of_unchecked_step"), 2),
             f"{_f(_g(m, k, 'ratio'), 2)} ({_ci(_g(m, k, 'ratio_ci95'), 2)})"] for k, label in labels if k in m]
    unchecked = _g(m, "unchecked", "median_step_s")
    return (f"Unchecked median step: {_f(1e3 * unchecked if unchecked else None, 1, ' ms')}.\n\n"
            + _table(["check", "own time per step (mean)", "share of the unchecked step",
                      "step-time ratio (95% CI)"], rows))


def _recipe(r: Callable[[str], dict[str, Any]]) -> str:
    rp = r("recipe")
    modes = rp.get("modes") or {}
    if not modes:
        return ""
    rows = [[k, f"`{v.get('flags') or '(fp32 adamw)'}`", _f(v.get("ratio"), 2), _ci(v.get("ratio_ci95"), 2)]
            for k, v in modes.items()]
    return (f"`{rp.get('model')}`, DP={rp.get('dp')}, {rp.get('rounds')} rounds; CPU bf16 units: "
            f"{'yes' if _g(rp, 'machine', 'cpu_bf16') else 'no'}.\n\n"
            + _table(["mode", "flags", "step time / fp32 adamw", "interval"], rows))


def _benchmarks(r: Callable[[str], dict[str, Any]]) -> str:
    ov = r("overhead")
    c2, c4 = _dp2(ov), _dp4(ov)
    rows = _row_overhead(r)
    if c4:
        rows.append(["same, DP=4, 1 / 2 replicas",
                     f"{_f(_g(c4, 'ratios', 'phoenix_r1'), 3)} / {_f(_g(c4, 'ratios', 'phoenix_r2'), 3)} "
                     f"({_ci(_g(c4, 'ci95', 'phoenix_r1'), 2)} / {_ci(_g(c4, 'ci95', 'phoenix_r2'), 2)})",
                     "`python bench/overhead.py`", "`overhead.json`"])
    dd = _g(ov, "ddp", "ratios_vs_plain_ddp") or {}
    if dd:
        rows.append(["DCP `save` / `async_save` every step / plain DDP, DP=2",
                     f"{_f(dd.get('dcp_sync_every_step'), 2)} / {_f(dd.get('dcp_async_every_step'), 2)}",
                     "`python bench/overhead.py`", "`overhead.json`"])
    b = _g(c2, "bytes_per_step", "phoenix_r1") or {}
    bd = _g(c2, "breakdown", "phoenix_r1") or {}
    if b:
        rows.append(["protection work per step and worker, DP=2, 1 replica: bytes replicated, CPU of the replication "
                     "thread, replication time, of it the loop waited for",
                     f"{_f(b.get('protect_bytes_per_step', 0) / 1e6, 1, ' MB')}, "
                     f"{_f(b.get('protect_cpu_s_per_step'), 4, ' s')}, {_f(bd.get('replication_s'), 3, ' s')}, "
                     f"{_f(bd.get('replication_exposed_s'), 4, ' s')}", "`python bench/overhead.py`",
                     "`overhead.json`"])
    rows += _row_recovery(r) + _row_health(r) + _row_peers(r)
    tf = r("torchft")
    stall = {k: _g(tf, "runs", k, "survivor_stall_s") for k in ("tuned", "defaults")}
    if all(v is not None for v in stall.values()):
        rows.append(["torchft survivor stall, tuned / default timeouts",
                     f"{_f(stall['tuned'], 2, ' s')} / {_f(stall['defaults'], 2, ' s')}",
                     "`python bench/torchft_peer.py`", "`torchft.json`"])
    h = r("recovery").get("headline") or {}
    if h.get("phoenix_first_new_step_s") is not None and _g(tf, "runs", "tuned", "first_commit_s") is not None:
        rows.append(["first step at full strength after the fault: phoenixft / torchft",
                     f"{_f(h['phoenix_first_new_step_s'], 2, ' s')} / "
                     f"{_f(tf['runs']['tuned']['first_commit_s'], 2, ' s')}",
                     "`python bench/recovery.py`, `python bench/torchft_peer.py`", "`recovery.json`, `torchft.json`"])
    fits = r("scaling").get("fits") or {}
    if fits:
        rows.append(["hot-swap and recovery against world size: exponent b of y = a W^b (all W; W <= 8)",
                     f"hot-swap {_f(_g(fits, 'hotswap_s', 'power', 'b'), 2)}; "
                     f"{_f(_g(fits, 'w_le_8', 'hotswap_s_power', 'b'), 2)} / recovery "
                     f"{_f(_g(fits, 'recovery_s', 'power', 'b'), 2)}; "
                     f"{_f(_g(fits, 'w_le_8', 'recovery_s_power', 'b'), 2)}", "`python bench/scaling.py`",
                     "`scaling.json`"])
    rows += _row_scale(r) + _row_mesh_shrink(r) + _row_script(r) + _row_checks(r) + _row_security(r)
    return _machine(r) + "\n" + _table(["figure", "measured", "command", "file"], rows)


BLOCKS: dict[str, tuple[Path, Callable[[Callable[[str], dict[str, Any]]], str]]] = {
    "readme": (README, _readme),
    "current": (BENCHMARKS, _benchmarks),
    "control-plane": (BENCHMARKS, _control_plane),
    "recipe": (BENCHMARKS, _recipe),
    "scrub": (BENCHMARKS, _scrub),
    "tls": (BENCHMARKS, _tls),
    "drain": (BENCHMARKS, _drain),
    "stragglers": (BENCHMARKS, _stragglers),
    "sdc": (BENCHMARKS, _sdc),
}


def render(name: str, results: Path = RESULTS) -> str:
    """Block `name` as the files in `results` say it."""
    cache: dict[str, dict[str, Any]] = {}

    def r(part: str) -> dict[str, Any]:
        if part not in cache:
            cache[part] = _load(part, results)
        return cache[part]

    return BLOCKS[name][1](r)


def blocks_of(text: str) -> dict[str, str]:
    """{name: body} of every figures block in a document's text."""
    return {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}


def _rewritten(text: str, results: Path) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + render(m.group("name"), results) + m.group(4), text)


def check(results: Path = RESULTS) -> list[str]:
    """The blocks whose text differs from what their files say (and the blocks missing from their document)."""
    bad = []
    for doc in sorted({p for p, _ in BLOCKS.values()}):
        found = blocks_of(doc.read_text())
        for name, (path, _) in BLOCKS.items():
            if path != doc:
                continue
            if name not in found:
                bad.append(f"{doc.name}: no block <!-- figures:{name} -->")
            elif found[name] != render(name, results):
                bad.append(f"{doc.name}: block {name} differs from bench/results/ (python bench/figures.py --write)")
    return bad


def write(results: Path = RESULTS) -> list[Path]:
    """Rewrite every block from the files; the documents changed."""
    changed = []
    for doc in sorted({p for p, _ in BLOCKS.values()}):
        text = doc.read_text()
        new = _rewritten(text, results)
        if new != text:
            doc.write_text(new)
            changed.append(doc)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the blocks from bench/results/")
    a = ap.parse_args()
    if a.write:
        for path in write():
            print(f"wrote {path}")
        return 0
    bad = check()
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
