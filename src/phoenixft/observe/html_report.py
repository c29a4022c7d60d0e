"""One self-contained HTML report of a finished run: plots, summary, events and recoveries.

    phoenixft report RUN_DIR [--reference REF_RUN_DIR] [--out FILE]

or from Python: `write_report(Path("runs/x"), reference=Path("runs/ref"))`. It reads the run
directory written by `phoenixft run` (report.json, metrics.jsonl, events.jsonl) and writes one
HTML file (default RUN_DIR/report.html) that opens with no network: the plots are PNGs drawn
with matplotlib's Agg canvas and embedded as base64, the style sheet is inline, there is no
script. It shows

- throughput over wall-clock time (tokens/s when the workload tells its tokens per microbatch,
  else steps/s; one point per completed step, over the wall time since the previous one, so a
  recovery shows as a dip), faults as vertical lines, each recovery shaded from the fault to the
  end of the first step after it (Leto, Fig. 11);
- the loss per step, over the failure-free reference run's loss when `--reference` is given,
  with the validation loss (`--eval-every`) as points on the same axes (and a summary row);
- the recovery time of each fault broken into stages (detect, decide, reconfigure, restore
  parameters, restore optimizer, rest of the join, first step), stacked (PHOENIX, Fig. 10-11);
- a summary, the goodput with the wall time by cause (a bar and a table: observe/goodput.py), the
  table of recoveries (stage timings in ms with one decimal, invariants I1-I4), the stragglers (node,
  compute over its peers' median, first slow step, eviction), the faults and the
  event log.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phoenixft.config.training import model_label
from phoenixft.errors import UserError
from phoenixft.observe.goodput import account
from phoenixft.recovery.invariants import failed_invariants, invariants_hold
from phoenixft.sdc.report import sdc_html, timeline_marks

__all__ = ["RunData", "load_run", "write_report", "render_html", "fmt_ms", "STAGES", "tokens_per_step",
           "val_series"]

# (key in report["recoveries"][i]["stages"], label, colour); "join_other_s" is derived: the part
# of the join (decision -> every worker joined) not spent in reconfigure/restore.
STAGES: list[tuple[str, str, str]] = [
    ("detect_s", "detect", "#d62728"),
    ("decide_s", "decide", "#ff7f0e"),
    ("reconfigure_s", "reconfigure", "#2ca02c"),
    ("restore_params_s", "restore params", "#1f77b4"),
    ("restore_optimizer_s", "restore optimizer", "#9467bd"),
    ("join_other_s", "join: other (invariants, waiting)", "#bcbd22"),
    ("first_step_s", "first step", "#7f7f7f"),
]
# the columns of the recoveries table that hold times: (key, header)
TIME_COLUMNS: list[tuple[str, str]] = [
    ("detect_s", "detect"),
    ("decide_s", "decide"),
    ("reconfigure_s", "reconfigure"),
    ("restore_params_s", "restore params"),
    ("restore_optimizer_s", "restore optimizer"),
    ("join_s", "join"),
    ("first_step_s", "first step"),
    ("recovery_s", "recovery total"),
]


def fmt_ms(x: float | None) -> str:
    """Seconds as milliseconds with one decimal; '-' for unknown."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


@dataclass
class RunData:
    run_dir: Path
    report: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def t0(self) -> float | None:
        """Start of the run's clock: the run_start event, else the start of the first step."""
        for ev in self.events:
            if ev.get("kind") == "run_start":
                return float(ev["t"])
        if self.metrics:
            return float(self.metrics[0]["t_end"] - self.metrics[0].get("dt", 0.0))
        ts = [float(e["t"]) for e in self.events if "t" in e]
        return min(ts) if ts else None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{i} is not valid JSON ({e.msg})") from None
    return out


def load_run(run_dir: Path, what: str = "run directory") -> RunData:
    """Read a run directory; UserError (one line) when it or its report.json is missing/invalid."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{what} {str(run_dir)!r} does not exist or is not a directory")
    rp = run_dir / "report.json"
    if not rp.is_file():
        raise UserError(
            f"{what} {str(run_dir)!r} has no report.json (is it a phoenixft run directory? "
            "the report is written when the run ends)"
        )
    try:
        report = json.loads(rp.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{rp} is not valid JSON ({e.msg})") from None
    if not isinstance(report, dict):
        raise UserError(f"{rp} is not a phoenixft report (expected a JSON object)")
    metrics = sorted(_jsonl(run_dir / "metrics.jsonl"), key=lambda r: r.get("t_end", 0.0))
    events = sorted(_jsonl(run_dir / "events.jsonl"), key=lambda r: r.get("t", 0.0))
    return RunData(run_dir=run_dir, report=report, metrics=metrics, events=events)


def tokens_per_step(config: dict[str, Any]) -> int | None:
    """Tokens in one global batch, from the run's workload; None when the workload does not say."""
    try:
        from phoenixft.config import RunConfig
        from phoenixft.workload import WorkloadContext, load_workload

        cfg = RunConfig.from_json(json.dumps(config))
        wl = load_workload(
            cfg.workload, WorkloadContext.from_config(cfg)
        )
        return wl.tokens_per_microbatch * cfg.total_microbatches or None
    except Exception:  # noqa: BLE001 - a workload that no longer imports only costs us the unit
        return None


# ---------------------------------------------------------------------------------------- plots
def _png(fig: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", pad_inches=0.15)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def throughput_series(run: RunData, tokens: int | None) -> tuple[list[float], list[float]]:
    """(seconds since start, throughput) per completed step; the rate is over the wall time since
    the previous completed step (the step's own time for the first), so recoveries show."""
    t0 = run.t0
    xs: list[float] = []
    ys: list[float] = []
    if t0 is None:
        return xs, ys
    prev: float | None = None
    for m in run.metrics:
        span = (m["t_end"] - prev) if prev is not None else m.get("dt", 0.0)
        prev = m["t_end"]
        if span > 0:
            xs.append(m["t_end"] - t0)
            ys.append((tokens or 1) / span)
    return xs, ys


def fault_recoveries(run: RunData) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each fault with the recovery that answered it (matched by spec, in order), or None."""
    recs = [r for r in run.report.get("recoveries") or [] if r.get("fault")]
    used: set[int] = set()
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for f in run.report.get("faults") or []:
        k = next((i for i, r in enumerate(recs) if i not in used and r["fault"] == f.get("spec")), None)
        if k is not None:
            used.add(k)
        out.append((f, recs[k] if k is not None else None))
    return out


def _fault_label(f: dict[str, Any]) -> str:
    where = f"step {f['step']}" if f.get("step") is not None else f"epoch {f.get('epoch', '?')}"
    return f"fault {f.get('index', '?')}: {f.get('fault') or 'fault'} {f.get('node', '?')} @ {where}"


def _recovery_spans(run: RunData) -> list[tuple[float, float | None, str]]:
    """(fault, end of recovery or None, label) in seconds since start. A recovery runs from the
    fault to the end of the first step after it; a fault nothing recovered from (a corrupted
    replica that was never needed, a NaN that stopped the run) has no span."""
    t0 = run.t0 or 0.0
    spans: list[tuple[float, float | None, str]] = []
    for f, rec in fault_recoveries(run):
        t = float(f["t"])
        end: float | None = None
        if rec is not None and rec.get("recovery_s") is not None:
            end = t + rec["recovery_s"]
        elif rec is not None:  # recovery never finished a step (the run failed): up to the last step, if any
            after = [m["t_end"] for m in run.metrics if m["t_end"] > t]
            end = after[0] if after else None
        spans.append((t - t0, None if end is None else end - t0, _fault_label(f)))
    return spans


def plot_throughput(run: RunData, ref: RunData | None, tokens: int | None) -> str | None:
    from matplotlib.figure import Figure

    xs, ys = throughput_series(run, tokens)
    if not xs:
        return None
    unit = "tokens/s" if tokens else "steps/s"
    fig = Figure(figsize=(11, 3.9))
    ax = fig.add_subplot()
    if ref is not None:
        rx, ry = throughput_series(ref, tokens)
        ax.plot(rx, ry, drawstyle="steps-pre", color="#999999", lw=1.2, label="reference (no failure)")
    ax.plot(xs, ys, drawstyle="steps-pre", color="#1f77b4", lw=1.6, label="this run")
    shaded = False
    for i, (a, b, label) in enumerate(_recovery_spans(run)):
        if b is not None:
            ax.axvspan(
                a,
                b,
                color="#ff7f0e",
                alpha=0.25,
                lw=0,
                label=None if shaded else "recovery (fault to first step after it)",
            )
            shaded = True
        ax.axvline(a, color="#d62728", ls="--", lw=1.2, label="fault" if i == 0 else None)
        # stagger the labels of faults close together
        ax.annotate(
            label,
            (a, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12 - 11 * (i % 3)),
            textcoords="offset points",
            fontsize=8,
            color="#d62728",
        )
    for j, (x, label) in enumerate(timeline_marks(run.report, run.t0 or 0.0)):  # silent data corruption
        ax.axvline(x, color="#9467bd", ls=":", lw=1.2, label="sdc detection / verdict" if j == 0 else None)
        ax.annotate(label, (x, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 4 + 11 * (j % 3)),
                    textcoords="offset points", fontsize=8, color="#9467bd")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"Throughput ({unit}, per completed step, over the wall time since the previous one)", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    fig.tight_layout()
    return _png(fig)


def val_series(run: RunData) -> list[tuple[int, float]]:
    """(step, validation loss) of every evaluation, in step order; a replayed step counts once (its last record)."""
    by_step = {int(m["step"]): float(m["val_loss"]) for m in run.metrics if m.get("val_loss") is not None}
    return sorted(by_step.items())


def plot_loss(run: RunData, ref: RunData | None) -> str | None:
    from matplotlib.figure import Figure

    loss = run.report.get("loss") or [m["loss"] for m in sorted(run.metrics, key=lambda m: m["step"])]
    if not loss:
        return None
    fig = Figure(figsize=(11, 3.4))
    ax = fig.add_subplot()
    if ref is not None and ref.report.get("loss"):
        rl = ref.report["loss"]
        ax.plot(range(1, len(rl) + 1), rl, color="#999999", lw=4, alpha=0.6, label="reference (no failure)")
    ax.plot(range(1, len(loss) + 1), loss, color="#1f77b4", lw=1.4, marker=".", ms=4, label="this run")
    if ref is not None and (rv := val_series(ref)):
        ax.plot([x for x, _ in rv], [y for _, y in rv], ls="none", marker="s", ms=9, color="#999999", alpha=0.6,
                label="reference validation loss")
    if val := val_series(run):
        ax.plot([x for x, _ in val], [y for _, y in val], ls="none", marker="D", ms=5, color="#2ca02c",
                label="validation loss")
    stepped = [f for f in run.report.get("faults") or [] if f.get("step") is not None]
    for i, f in enumerate(stepped):
        ax.axvline(f["step"], color="#d62728", ls="--", lw=1.2, label="fault (step)" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss per step" + (" and validation loss" if val else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def stage_values(rec: dict[str, Any]) -> dict[str, float]:
    """The stacked stages of one recovery in seconds (unknown = 0); they add up to recovery_s."""
    st = {k: (v or 0.0) for k, v in (rec.get("stages") or {}).items()}
    inner = (
        st.get("reconfigure_s", 0.0) + st.get("restore_params_s", 0.0) + st.get("restore_optimizer_s", 0.0)
    )
    st["join_other_s"] = max(0.0, st.get("join_s", 0.0) - inner)
    return {k: st.get(k, 0.0) for k, _, _ in STAGES}


def plot_breakdown(run: RunData) -> str | None:
    from matplotlib.figure import Figure

    recs = run.report.get("recoveries") or []
    if not recs:
        return None
    fig = Figure(figsize=(11, 1.0 + 0.5 * len(recs)))
    ax = fig.add_subplot()
    labels = [f"#{i + 1} {r.get('fault') or 'failure'} ({r.get('action')})" for i, r in enumerate(recs)]
    left = [0.0] * len(recs)
    for key, name, colour in STAGES:
        w = [stage_values(r)[key] * 1e3 for r in recs]
        ax.barh(range(len(recs)), w, left=left, color=colour, label=name, height=0.6)
        left = [a + b for a, b in zip(left, w, strict=True)]
    for i, r in enumerate(recs):
        ax.text(left[i], i, f"  {fmt_ms(r.get('recovery_s'))} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(recs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the fault")
    ax.set_xlim(0, max(left) * 1.18 or 1)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        fontsize=8,
        ncol=len(STAGES),
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        frameon=False,
        handlelength=1.2,
        columnspacing=1.0,
    )
    return _png(fig)


# ------------------------------------------------------------------------------------------ html
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:24px;color:#222;
background:#fff;max-width:1180px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border:1px solid #ddd;padding:3px 7px;
vertical-align:top} th{background:#f3f3f3;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
table.kv th{width:210px} .ok{color:#1a7f37;font-weight:600} .bad{color:#c62828;font-weight:600}
img{max-width:100%;border:1px solid #eee} code,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;
font-size:12px} .muted{color:#777;font-size:13px} details summary{cursor:pointer} .wide{overflow-x:auto}
#recoveries td[data-key=fault]{overflow-wrap:anywhere;min-width:120px;max-width:190px}
h3{font-size:15px;margin:16px 0 6px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _td(text: Any, key: str | None = None, cls: str | None = None) -> str:
    text = "-" if text is None else text
    attrs = (f' data-key="{_e(key)}"' if key else "") + (f' class="{cls}"' if cls else "")
    return f"<td{attrs}>{_e(text)}</td>"


def _img(b64: str | None, alt: str, none_text: str) -> str:
    if b64 is None:
        return f'<p class="muted">{_e(none_text)}</p>'
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


def _summary(run: RunData, ref: RunData | None, tokens: int | None) -> str:
    r = run.report
    cfg = r.get("config") or {}
    st = r.get("step_time_s") or {}
    state = str(r.get("state", "?"))
    recs = r.get("recoveries") or []
    xs, ys = throughput_series(run, tokens)
    rows: list[tuple[str, str, str | None]] = [
        ("state", state, "ok" if state == "done" else "bad"),
        ("run id", str(r.get("run_id", "-")), None),
        ("steps completed", f"{r.get('steps_completed', 0)} of {cfg.get('steps', '?')}", None),
        ("final state sha256", str(r.get("final_state_sha256") or "-"), "mono"),
        ("median step time", f"{fmt_ms(st.get('median'))} ms (p90 {fmt_ms(st.get('p90'))} ms)", None),
    ]
    if ys:
        unit = "tokens/s" if tokens else "steps/s"
        rows.append(("median throughput", f"{statistics.median(ys):,.1f} {unit}", None))
    if val := val_series(run):
        (s0, v0), (s1, v1) = val[0], val[-1]
        rows.append(("validation loss", f"{v1:.4f} at step {s1} (first {v0:.4f} at step {s0}; "
                                        f"{len(val)} evaluation(s))", None))
    rows += [
        (
            "job",
            f"{cfg.get('nodes', '?')} node(s) x {cfg.get('workers_per_node', '?')} worker(s), "
            f"{cfg.get('spares', '?')} spare(s), protect={cfg.get('protect', '?')}, "
            f"{model_label(cfg)}, replicas={cfg.get('replicas', '?')}",
            None,
        ),
        ("faults injected", ", ".join(cfg.get("inject") or []) or "none", None),
        (
            "recoveries",
            f"{len(recs)}; lost steps in all: {sum(x.get('lost_steps') or 0 for x in recs)}; invariants "
            + ("all true" if all(invariants_hold(x) for x in recs) else "VIOLATED"),
            "ok" if all(invariants_hold(x) for x in recs) else "bad",
        ),
    ]
    if r.get("error"):
        rows.append(("error", str(r["error"]), "bad"))
    if ref is not None:
        a, b = r.get("final_state_sha256"), ref.report.get("final_state_sha256")
        same = a is not None and a == b
        rows.append(("reference run", str(ref.run_dir), None))
        rows.append(
            (
                "final state vs reference",
                "bitwise identical" if same else f"DIFFERENT (reference {b or '-'})",
                "ok" if same else "bad",
            )
        )
        rl, ll = ref.report.get("loss") or [], r.get("loss") or []
        if rl and ll:
            n = min(len(rl), len(ll))
            diff = max(abs(x - y) for x, y in zip(ll[:n], rl[:n], strict=True))
            rows.append(
                (
                    "loss vs reference",
                    f"max |difference| over {n} steps: {diff:.3g}",
                    "ok" if diff == 0 else None,
                )
            )
        rst = (ref.report.get("step_time_s") or {}).get("median")
        if rst and st.get("median"):
            rows.append(("median step time vs reference", f"{st['median'] / rst:.3f}x", None))
    body = "".join(
        f"<tr><th>{_e(k)}</th><td{f' class={chr(34)}{c}{chr(34)}' if c else ''}>{_e(v)}</td></tr>"
        for k, v, c in rows
    )
    return f'<table class="kv" id="summary">{body}</table>'


def run_goodput(run: RunData) -> dict[str, Any] | None:
    """The run's goodput: its report's, or (a report written before it had one) computed from its files."""
    g = run.report.get("goodput")
    if isinstance(g, dict):
        return g
    if not run.metrics:
        return None
    return account(run.metrics, [x for x in run.report.get("recoveries") or [] if isinstance(x, dict)], run.events)


def _goodput(run: RunData) -> str:
    """Goodput, and the wall time by cause: a bar (one segment per cause) and a table, largest first."""
    g = run_goodput(run)
    if not g or not g.get("wall_s"):
        return '<p class="muted">No steps recorded: no goodput.</p>'
    wall = float(g["wall_s"])
    parts = [("productive", float(g["productive_s"]))] + sorted(
        ((c, float(v)) for c, v in (g.get("badput_s") or {}).items() if v > 0), key=lambda x: -x[1])
    colors = ["#2a7", "#c33", "#e80", "#36c", "#939", "#c9c", "#7a4", "#a63", "#099", "#666", "#b55", "#58a"]
    bar = "".join(f'<span title="{_e(c)} {v:.3f}s" style="display:inline-block;height:14px;width:{100 * v / wall:.3f}%;'
                  f'background:{colors[i % len(colors)]}"></span>' for i, (c, v) in enumerate(parts))
    gp, gi = g.get("goodput"), g.get("goodput_incl_startup")
    head = (f'<p id="goodput">goodput <b>{"-" if gp is None else f"{gp * 100:.1f}%"}</b> of the wall time since the '
            f'first step ({"-" if gi is None else f"{gi * 100:.1f}%"} with the start-up), '
            f'{wall:.2f} s in all</p>')
    rows = "".join(f"<tr><td>{_e(c)}</td><td>{v:.3f}</td><td>{100 * v / wall:.1f}%</td></tr>" for c, v in parts)
    return (head + f'<div style="width:100%;max-width:900px;white-space:nowrap">{bar}</div>'
            f'<table id="badput"><tr><th>where the time went</th><th>s</th><th>share</th></tr>{rows}</table>')
def _drained(r: dict[str, Any]) -> str:
    """A recovery's drain: the node, why, from whom, and the notice-to-swapped time (or that it fell back)."""
    d = r.get("drain")
    if not isinstance(d, dict):
        return "-"
    t = d.get("notice_to_swapped_s")
    how = (f"notice to swapped {t * 1e3:.0f} ms" if isinstance(t, (int, float)) else "completed") \
        if d.get("completed") else "the node was lost first: failure path"
    return f"{d.get('node')} ({d.get('reason')}; {d.get('source')}): {how}"


def _recoveries_table(run: RunData) -> str:
    """Two tables: what each recovery did (and its invariants), and its stage timings in ms."""
    recs = run.report.get("recoveries") or []
    if not recs:
        return '<p class="muted">No recoveries.</p>'
    head = [
        "#",
        "fault",
        "fault step",
        "class",
        "action",
        "epoch",
        "dead",
        "promoted",
        "restarted in place",
        "drained",
        "lost steps",
        "resumed step",
        "bytes moved",
        "replicas rejected",
        "I1",
        "I2",
        "I3",
        "I4",
        "errors",
    ]
    rows = []
    for i, r in enumerate(recs, 1):
        epoch = str(r.get("epoch", "-"))
        if r.get("completed_in_epoch") not in (None, r.get("epoch")):
            epoch += f" (completed in {r['completed_in_epoch']})"  # interrupted by another failure
        rejected = r.get("replicas_rejected") or []
        cells = [
            _td(i, "index", "num"),
            _td(r.get("fault"), "fault"),
            _td(r.get("fault_step"), "fault_step", "num"),
            _td(r.get("class"), "class"),
            _td(r.get("action"), "action"),
            _td(epoch, "epoch", "num"),
            _td(", ".join(r.get("dead") or []) or "-", "dead"),
            _td(", ".join(r.get("promoted") or []) or "-", "promoted"),
            _td(", ".join(r.get("restarted") or []) or "-", "restarted"),
            _td(_drained(r), "drain"),
            _td(r.get("lost_steps"), "lost_steps", "num"),
            _td(r.get("resumed_step"), "resumed_step", "num"),
            _td(f"{r.get('bytes_moved', 0):,}", "bytes_moved", "num"),
            _td("; ".join(f"dp{x[0]} step {x[1]}" for x in rejected) or "-", "replicas_rejected"),
        ]
        for k in ("I1", "I2", "I3", "I4"):
            ok = k not in failed_invariants(r)
            cells.append(_td("ok" if ok else "FAILED", k, "ok" if ok else "bad"))
        errs = r.get("errors") or []
        detail = "".join(f"<li><code>{_e(x)}</code></li>" for x in errs)
        cells.append(
            f'<td data-key="errors">{len(errs)}'
            + (f"<details><summary>show</summary><ul>{detail}</ul></details>" if errs else "")
            + "</td>"
        )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    what = (
        f'<div class="wide"><table id="recoveries"><tr>{"".join(f"<th>{_e(h)}</th>" for h in head)}</tr>'
        f"{''.join(rows)}</table></div>"
    )
    head = ["#", "fault"] + [f"{h} (ms)" for _, h in TIME_COLUMNS]
    rows = []
    for i, r in enumerate(recs, 1):
        st = r.get("stages") or {}
        cells = [_td(i, "index", "num"), _td(r.get("fault") or "-", "fault")]
        cells += [
            _td(fmt_ms(r.get(k) if k == "recovery_s" else st.get(k)), k, "num") for k, _ in TIME_COLUMNS
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    timings = (
        f'<div class="wide"><table id="recovery-timings"><tr>{"".join(f"<th>{_e(h)}</th>" for h in head)}'
        f"</tr>{''.join(rows)}</table></div>"
        '<p class="muted">detect: fault to the first failure report; decide: to the new topology; join: to '
        "every worker joined (includes reconfigure, restore params and restore optimizer, each the maximum "
        "over workers); first step: to the end of the first step after the join; recovery total = detect + "
        "decide + join + first step.</p>"
    )
    return what + "<h3>Stage timings</h3>" + timings


def _stragglers_table(run: RunData) -> str:
    """The nodes flagged as stragglers: how much slower, since when, and whether a spare replaced them."""
    rows = run.report.get("stragglers") or []
    if not rows:
        return '<p class="muted">No stragglers.</p>'
    body = "".join(
        "<tr>"
        + _td(st.get("class"), "class")
        + _td(st.get("node"), "node")
        + _td(f"{st['ratio']:.2f}x" if isinstance(st.get("ratio"), (int, float)) else "-", "ratio", "num")
        + _td(st.get("first_step"), "first_step", "num")
        + _td(st.get("flagged_step"), "flagged_step", "num")
        + _td(f"after step {st.get('evicted_at_step')}, by {st.get('replaced_by') or '-'}" if st.get("evicted")
              else "no", "evicted", None if st.get("evicted") else "bad")
        + "</tr>" for st in rows)
    head = ["class", "node", "compute vs peers' median", "first slow step", "flagged at step", "evicted"]
    return f'<table id="stragglers"><tr>{"".join(f"<th>{_e(h)}</th>" for h in head)}</tr>{body}</table>'


def _faults_table(run: RunData) -> str:
    pairs = fault_recoveries(run)
    if not pairs:
        return '<p class="muted">No faults.</p>'
    t0 = run.t0 or 0.0
    recs = run.report.get("recoveries") or []
    rows = []
    for f, rec in pairs:
        by = f"#{recs.index(rec) + 1} ({rec.get('action')})" if rec is not None else "-"
        rows.append(
            "<tr>"
            + _td(f.get("index"), "index", "num")
            + _td(f"{f['t'] - t0:.3f}", "t", "num")
            + _td(f.get("spec"), "spec")
            + _td(f.get("fault"), "kind")
            + _td(f.get("node"), "node")
            + _td(f.get("step"), "step", "num")
            + _td(f.get("phase"), "phase")
            + _td(f.get("epoch"), "epoch", "num")
            + _td(by, "recovery")
            + "</tr>"
        )
    head = ["#", "t (s)", "spec", "kind", "node", "step", "phase", "epoch", "recovered by"]
    return f'<table id="faults"><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>{"".join(rows)}</table>'


def _scrub_table(run: RunData) -> str:
    """The scrubber's findings (report `scrub`): each held copy found corrupt at rest and its repair."""
    sc = run.report.get("scrub") or {}
    found = sc.get("findings") or []
    every = sc.get("every")
    if not found:
        how = f" (every held byte re-verified every {every} step(s))" if every else " (scrubbing off)"
        return f'<p class="muted">No corrupt copy found{how}.</p>'
    t0 = run.t0 or 0.0
    rows = []
    for f in found:
        fix = f"from {f.get('repaired_from')}" if f.get("repaired") else f"not repaired: {f.get('why_not')}"
        rows.append("<tr>" + _td(f"{(f.get('t') or t0) - t0:.3f}", "t", "num") + _td(f.get("node"), "node")
                    + _td(f.get("copy"), "copy") + _td(f.get("shard"), "shard") + _td(f.get("step"), "step", "num")
                    + _td(fix, "repair", None if f.get("repaired") else "bad") + "</tr>")
    head = ["t (s)", "node holding it", "copy", "whose shard", "step", "repair"]
    return (f'<p>{len(found)} corrupt cop{"y" if len(found) == 1 else "ies"} found, '
            f'{sum(1 for f in found if f.get("repaired"))} repaired.</p>'
            f'<table id="scrub"><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>{"".join(rows)}</table>')


def _health_tables(run: RunData) -> str:
    """The spares' latest health checks, and each host's failures with its quarantine."""
    health = run.report.get("health") or {}
    quarantine = run.report.get("quarantine") or {}
    spares, hosts = health.get("spares") or [], quarantine.get("hosts") or []
    if not spares and not hosts:
        return '<p class="muted">No spare health checks and no host failures recorded.</p>'
    parts = []
    if spares:
        rows = "".join(
            "<tr>" + _td(sp.get("node"), "node") + _td(sp.get("host"), "host")
            + _td("healthy" if sp.get("ok") else "UNHEALTHY", "state", None if sp.get("ok") else "bad")
            + _td(sp.get("phase"), "phase") + _td(sp.get("reason") or "-", "reason") + "</tr>" for sp in spares)
        parts.append('<table id="spare-health"><tr><th>spare</th><th>host</th><th>state</th><th>last check</th>'
                     f"<th>reason</th></tr>{rows}</table>")
    if hosts:
        rows = "".join(
            "<tr>" + _td(h.get("host"), "host")
            + _td("QUARANTINED" if h.get("quarantined") else "admitted", "state",
                  "bad" if h.get("quarantined") else None)
            + _td(len(h.get("failures") or []), "failures", "num")
            + _td("; ".join(f"{f.get('node')}: {f.get('reason')}" + (f" [injected: {f['injected']}, not counted]"
                                                                      if f.get("injected") else "")
                            for f in h.get("failures") or []) or h.get("reason"), "detail") + "</tr>" for h in hosts)
        parts.append(f'<p>Quarantine: {_e(quarantine.get("after"))} failures within {_e(quarantine.get("window_s"))} '
                     's (a failure an injected fault caused is not counted); quarantined hosts are never admitted '
                     'again.</p>'
                     '<table id="hosts"><tr><th>host</th><th>state</th><th>failures</th><th>what failed</th></tr>'
                     f"{rows}</table>")
    return "\n".join(parts)


def _events_table(run: RunData) -> str:
    if not run.events:
        return '<p class="muted">No events recorded (events.jsonl missing or empty).</p>'
    t0 = run.t0 or 0.0
    rows = []
    for ev in run.events:
        src = ev.get("by") or ev.get("wid") or ev.get("node") or "-"
        rest = {k: v for k, v in ev.items() if k not in ("t", "kind", "by", "wid")}
        detail = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in rest.items())
        cls = "bad" if ev.get("kind") in ("fault", "run_failed", "corrupted_replica", "scrub_found", "spare_unhealthy",
                                          "host_quarantined") else None
        rows.append(
            "<tr>"
            + _td(f"{ev.get('t', t0) - t0:.3f}", "t", "num")
            + _td(ev.get("kind"), "kind", cls)
            + _td(src, "source")
            + f'<td data-key="detail"><code>{_e(detail)}</code></td></tr>'
        )
    return (
        '<table id="events"><tr><th>t (s)</th><th>kind</th><th>source</th><th>details</th></tr>'
        + "".join(rows)
        + "</table>"
    )


def render_html(run: RunData, ref: RunData | None = None) -> str:
    """The whole report as one HTML string."""
    tokens = tokens_per_step(run.report.get("config") or {})
    title = f"phoenixft run {run.report.get('run_id', run.run_dir.name)}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">{_e(run.run_dir)}</p>',
        "<h2>Summary</h2>",
        _summary(run, ref, tokens),
        "<h2>Goodput</h2>",
        _goodput(run),
        "<h2>Throughput over time</h2>",
        _img(
            plot_throughput(run, ref, tokens),
            "throughput over time",
            "No step metrics (metrics.jsonl) recorded.",
        ),
        "<h2>Loss</h2>",
        _img(plot_loss(run, ref), "loss per step", "No loss recorded."),
        "<h2>Recovery time by stage</h2>",
        _img(plot_breakdown(run), "recovery time breakdown", "No recoveries: nothing to break down."),
        "<h2>Recoveries</h2>",
        _recoveries_table(run),
        "<h2>Stragglers</h2>",
        _stragglers_table(run),
        "<h2>Faults</h2>",
        _faults_table(run),
        "<h2>Scrubbing</h2>",
        _scrub_table(run),
        "<h2>Spare health and quarantined hosts</h2>",
        _health_tables(run),
        "<h2>Silent data corruption</h2>",
        sdc_html(run.report),
        "<h2>Events</h2>",
        _events_table(run),
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(run_dir: Path, reference: Path | None = None, out: Path | None = None) -> Path:
    """Write the HTML report of `run_dir` (default `run_dir/report.html`); returns its path."""
    run = load_run(Path(run_dir))
    ref = load_run(Path(reference), "reference run directory") if reference is not None else None
    path = Path(out) if out is not None else run.run_dir / "report.html"
    if path.is_dir():
        raise UserError(f"--out {str(path)!r} is a directory; give a file name")
    text = render_html(run, ref)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        raise UserError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return path
