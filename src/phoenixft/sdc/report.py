"""The report's `sdc` section: what the checks found, the verdicts of the replays, the nodes named, the
steps rolled back, what a sampled audit cannot prove clean, and the checks' cost per step."""

from __future__ import annotations

import statistics
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, sealed
from phoenixft.controlplane.values import read_raw
from phoenixft.sdc.record import SDC_LOG

__all__ = ["sdc_report", "COSTS", "detection_line"]

# the per-step cost of each check in metrics.jsonl (`sdc_<name>_s`); a check added later adds its name here
COSTS = ("params", "guard", "audit", "replay")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> str:
    return f"{1e3 * (x or 0):.2f}"


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _costs(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per step of each check over every step (0 where it did not run): `NAME_s` the mean, what the
    check costs amortised over the run (a sampled audit every 10 steps costs a tenth of one audit per
    step), `NAME_median_s` beside it (a typical step: 0 for a check that runs on fewer than half of them);
    and all of them as a share of the run's step time (mean over mean: amortised too)."""
    out: dict[str, Any] = {}
    for name in COSTS:
        xs = [float(r.get(f"sdc_{name}_s", 0.0)) for r in steps]
        out[f"{name}_s"], out[f"{name}_median_s"] = _mean(xs), _median(xs)
    total = [sum(float(r.get(f"sdc_{n}_s", 0.0)) for n in COSTS if n != "replay") for r in steps]
    dt = _mean([float(r["dt"]) for r in steps if "dt" in r])
    out["total_s"], out["total_median_s"] = _mean(total), _median(total)
    out["share_of_step"] = (out["total_s"] / dt) if dt and out["total_s"] is not None else None
    return out


def _limits(cfg: RunConfig, log: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sampled audits check one slot now and then: a node that corrupts low bits every step poisons
    the steps between its last passed audit and the one that failed, and rolling back one step does not
    undo them. Per node named after a failed sampled audit: that audit, the last one it passed, and the
    steps that may be affected."""
    if cfg.sdc_audit != "sample":
        return []
    out = []
    for v in verdicts:
        if not v.get("node") or "audit" not in str(v.get("reason", "")):
            continue
        node, step = v["node"], int(v["step"])
        passed = [int(a["step"]) for a in log if a.get("kind") == "sdc_audit" and node in a.get("nodes", [])
                  and int(a["step"]) < step]
        last_ok = max(passed, default=0)
        out.append({"node": node, "first_failed_audit": step, "last_passed_audit": last_ok or None,
                    "steps_that_may_be_affected": [last_ok + 1, step - 1] if step - 1 > last_ok else [],
                    "resume_from_checkpoint_before": last_ok + 1 if cfg.persist_every else None,
                    "checkpoint": _checkpoint_at_most(cfg.persist_dir, last_ok) if cfg.persist_every else None})
    return out


def _checkpoint_at_most(root: str, step: int) -> str | None:
    """The newest complete persistent checkpoint (its manifest written) of at most `step`: the state a
    `phoenixft run --resume` can start from, proven clean by the audits before it."""
    from pathlib import Path

    found = []
    for man in Path(root).glob("step_*/MANIFEST.json"):
        try:
            st = int(man.parent.name.split("_", 1)[1])
        except ValueError:
            continue
        if st <= step:
            found.append((st, str(man.parent)))
    return max(found)[1] if found else None


def sdc_report(store: Store, cfg: RunConfig, steps: list[dict[str, Any]]) -> dict[str, Any]:
    log = sealed.records(SDC_LOG, read_raw(store, SDC_LOG))
    detections = [{k: v for k, v in x.items() if k != "kind"} for x in log if x.get("kind") == "sdc_detected"]
    verdicts = [{k: v for k, v in x.items() if k != "kind"} for x in log if x.get("kind") == "sdc_verdict"]
    named = sorted({n for d in detections for n in d.get("nodes", [])} | {v["node"] for v in verdicts if v.get("node")})
    return {
        "checks": {"fingerprint_every": cfg.sdc_check_every, "spike_threshold": cfg.spike_threshold,
                   "spike_window": cfg.spike_window, "audit": cfg.sdc_audit,
                   "audit_every": cfg.sdc_audit_every or (1 if cfg.sdc_audit == "full" else 10)},
        "detections": detections,
        "verdicts": verdicts,
        "verified_spikes": [v["step"] for v in verdicts if v.get("verdict") == "genuine"],
        "nodes_named": named,
        # a suspect step is rolled back to the committed state of the step before it
        "rolled_back": [{"step": v["step"], "to": v.get("rolled_back_to")} for v in verdicts]
        + [{"step": d["step"], "to": d["step"] - 1} for d in detections if d.get("target") == "param"],
        "limits": _limits(cfg, log, verdicts),
        "cost_per_step": _costs(steps),
    }


def detection_line(ev: dict[str, Any]) -> str | None:
    """The live line of an sdc event, or None."""
    k = ev.get("kind")
    if k == "sdc_detected":
        who = f": {', '.join(ev['nodes'])} diverged" if ev.get("nodes") else ""
        why = f" ({ev['reason']})" if ev.get("reason") else ""
        return f"!! silent data corruption check: step {ev['step']} suspect by {ev['check']}{who}{why}"
    if k == "sdc_verdict":
        if ev.get("verdict") == "genuine":
            return f"   step {ev['step']} replayed on other nodes: bit for bit equal, a genuine spike; training goes on"
        if ev.get("node"):
            return (f"!! step {ev['step']} replayed on other nodes: {ev['node']} computed wrong ({ev['verdict']}); "
                    f"rolled back to step {ev['rolled_back_to']}, fencing it")
        return f"!! step {ev['step']} replayed: {', '.join(ev.get('candidates', []))} disagree, undetermined"
    return None


def timeline_marks(report: dict[str, Any], t0: float) -> list[tuple[float, str]]:
    """(seconds since the start, label) of each detection and verdict, for the HTML timeline."""
    sdc = report.get("sdc") or {}
    out = [(float(d["t"]) - t0, f"sdc: step {d['step']} suspect ({d.get('check')})")
           for d in sdc.get("detections", []) if "t" in d]
    out += [(float(v["t"]) - t0, f"sdc: step {v['step']} {v.get('verdict')}"
             + (f", {v['node']}" if v.get("node") else "")) for v in sdc.get("verdicts", []) if "t" in v]
    return sorted(out)


def sdc_html(report: dict[str, Any]) -> str:
    """The HTML report's section: the checks, every detection with its verdict, the honest limits and the
    checks' cost per step."""
    import html

    sdc = report.get("sdc")
    if not sdc:
        return '<p class="muted">No silent-data-corruption record in this report.</p>'
    e = lambda x: html.escape(str(x))  # noqa: E731
    ch = sdc.get("checks", {})
    cost = sdc.get("cost_per_step", {})
    share = cost.get("share_of_step")
    parts = [f"<p>Checks: fingerprints every {e(ch.get('fingerprint_every'))} step(s), spike threshold "
             f"{e(ch.get('spike_threshold'))} (window {e(ch.get('spike_window'))}), audits {e(ch.get('audit'))}"
             f"{' every ' + e(ch.get('audit_every')) + ' step(s)' if ch.get('audit') != 'off' else ''}. Cost per step "
             f"(mean over the run, amortised; the median step's in brackets): "
             + ", ".join(f"{label} {_ms(cost.get(f'{k}_s'))} ms ({_ms(cost.get(f'{k}_median_s'))})"
                         for label, k in (("fingerprints", "params"), ("spike guard", "guard"), ("audits", "audit")))
             + f"{f', {100 * share:.2f}% of the step' if share is not None else ''}.</p>"]
    verdict_of = {v["step"]: v for v in sdc.get("verdicts", [])}
    rows = []
    for d in sdc.get("detections", []):
        v = verdict_of.get(d["step"], {})
        node = v.get("node") or ", ".join(d.get("nodes", [])) or "-"
        label = v.get("verdict") or ("diverged" if d.get("nodes") else "-")
        to = v.get("rolled_back_to", d["step"] - 1)
        rows.append(f"<tr><td>{e(d['step'])}</td><td>{e(d.get('check'))}</td><td>{e(d.get('reason', ''))}</td>"
                    f"<td>{e(label)}</td><td>{e(node)}</td><td>{e(to)}</td></tr>")
    if rows:
        parts.append('<table id="sdc"><tr><th>step</th><th>check</th><th>why</th><th>verdict</th><th>node named</th>'
                     "<th>rolled back to</th></tr>" + "".join(rows) + "</table>")
    else:
        parts.append('<p class="muted">No detection.</p>')
    for lim in sdc.get("limits", []):
        parts.append(f"<p>Not proven clean: {e(lim['node'])} failed the sampled audit of step "
                     f"{e(lim['first_failed_audit'])}; its last passed audit was step {e(lim['last_passed_audit'])}; "
                     f"steps that may be affected: {e(lim['steps_that_may_be_affected'])}.</p>")
    return "\n".join(parts)
