"""Goodput and badput: where a run's wall time went, computed from what the run records.

The window runs from the job's launch to the end of its last step (for a live run: now). Every
instant of it gets exactly one label, so the parts always sum to the window and overlapping
records are counted once:

- `productive`: inside a step that counts (each step's last execution: a replayed step's first
  execution is not one), less the straggler slowdown below;
- the badput causes (`CAUSES`), from the intervals the run's records give: `startup` (launch to
  the job's first step), the stages of each recovery (`detection`, `decide`, `reconfigure`,
  `restore_params`, `restore_optimizer`, `join`, `first_step`), `replayed_steps` (the work a
  failure discarded: from the end of the step it resumed from to the fault), `drain` and `grow`
  (recoveries of those kinds, all stages together), `straggler` (the part of slow steps beyond the
  run's median step while a node was reported slow), `health_check`, `spare_wait`, and `overhead`
  (what no record explains: the gaps between steps);
- where intervals overlap, the label earlier in `PRIORITY` wins.

`goodput` is productive time over the wall time since the job's first step (the launch's start-up
excluded); `goodput_incl_startup` over the whole window.

Recoveries are read by class (`CLASS_CAUSE`): a class or (class, action) found there is accounted
as that one cause; any other class is a failure, accounted stage by stage. Events of a kind in
`EVENT_CAUSE` are spans: [t - duration_s, t], [t_start, t] or [t, t_end], or, with only an
`epoch`, from the event to the decision of that epoch's recovery.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["CAUSES", "CLASS_CAUSE", "EVENT_CAUSE", "PRIORITY", "STAGES", "account", "recovery_times",
           "summary_line"]

STAGES = ("detection", "decide", "reconfigure", "restore_params", "restore_optimizer", "join", "first_step")
# highest first: an instant covered by several intervals goes to the first of them
PRIORITY = ("productive", "health_check", "spare_wait", "drain", "grow", *STAGES, "replayed_steps", "startup")
CAUSES = ("startup", *STAGES, "replayed_steps", "drain", "grow", "straggler", "health_check", "spare_wait",
          "overhead")
# a recovery of this class (or this (class, action)) is one cause as a whole; any other is a failure's stages
CLASS_CAUSE: dict[str | tuple[str, str], str] = {
    ("planned", "grow"): "grow",
    ("planned", "drain"): "drain",
    "planned": "drain",
    "straggler": "drain",  # a slow node's eviction is a drain; its slowdown before that is `straggler`
}
# events that are spans of badput
EVENT_CAUSE: dict[str, str] = {
    "health_check": "health_check",
    "spare_health_check": "health_check",
    "waiting_for_spares": "spare_wait",
    "spare_wait": "spare_wait",
}
# events that mark a node as slow from `from_step` (or `step`) to `to_step` (or the end)
SLOW_EVENTS = ("straggler",)
SLOW_CLASSES = ("straggler",)

Span = tuple[float, float, str]


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def recovery_times(rec: Mapping[str, Any]) -> dict[str, float | None]:
    """A report recovery's absolute times (`times` in the report), None where it has none."""
    t = rec.get("times") or {}
    return {k: _num(t.get(k)) for k in ("fault", "first_report", "decided", "joined", "first_step")}


def _cause_of(rec: Mapping[str, Any]) -> str | None:
    klass, action = str(rec.get("class") or ""), str(rec.get("action") or "")
    return CLASS_CAUSE.get((klass, action)) or CLASS_CAUSE.get(klass)


def _recovery_spans(rec: Mapping[str, Any], ends: Mapping[int, float]) -> list[Span]:
    """The labelled intervals of one recovery: its stages in order (or its one cause), the work it discarded."""
    t = recovery_times(rec)
    t0 = t["fault"] if t["fault"] is not None else t["first_report"]
    if t0 is None:
        return []
    st = rec.get("stages") or {}
    marks: list[tuple[str, float | None]] = [("detection", t["first_report"]), ("decide", t["decided"])]
    if t["decided"] is not None and t["joined"] is not None:  # the join, split in the order its stages run
        at = t["decided"]
        for name, key in (("reconfigure", "reconfigure_s"), ("restore_params", "restore_params_s"),
                          ("restore_optimizer", "restore_optimizer_s")):
            d = _num(st.get(key)) or 0.0
            at = min(t["joined"], at + max(0.0, d))
            marks.append((name, at))
        marks.append(("join", t["joined"]))
    marks.append(("first_step", t["first_step"]))
    whole = _cause_of(rec)
    spans: list[Span] = []
    at = t0
    for name, end in marks:
        if end is None:
            continue
        if end > at:
            spans.append((at, end, whole or name))
        at = max(at, end)
    resumed = rec.get("resumed_step")
    if isinstance(resumed, int) and t["fault"] is not None:
        start = ends.get(resumed)
        if start is not None and start < t["fault"]:
            spans.append((start, t["fault"], whole or "replayed_steps"))
    return spans


def _event_spans(events: Iterable[Mapping[str, Any]], decided: Mapping[int, float]) -> list[Span]:
    spans: list[Span] = []
    for ev in events:
        cause = EVENT_CAUSE.get(str(ev.get("kind")))
        t = _num(ev.get("t"))
        if cause is None or t is None:
            continue
        dur, t_start, t_end = _num(ev.get("duration_s")), _num(ev.get("t_start")), _num(ev.get("t_end"))
        epoch = ev.get("epoch")
        if dur is not None:
            spans.append((t - dur, t, cause))
        elif t_start is not None:
            spans.append((t_start, t, cause))
        elif t_end is not None:
            spans.append((t, t_end, cause))
        elif isinstance(epoch, int) and epoch + 1 in decided:
            spans.append((t, decided[epoch + 1], cause))
    return spans


def _label(window: tuple[float, float], spans: list[Span]) -> dict[str, float]:
    """Seconds per label over the window, each instant to its highest-priority span; the rest `overhead`."""
    lo, hi = window
    rank = {c: i for i, c in enumerate(PRIORITY)}
    cuts = sorted({lo, hi, *(min(hi, max(lo, x)) for a, b, _ in spans for x in (a, b))})
    # sweep: the spans open at each elementary segment (few non-step spans; steps are disjoint and sorted)
    opening = sorted((max(lo, a), min(hi, b), rank[c]) for a, b, c in spans if min(hi, b) > max(lo, a))
    out = dict.fromkeys(CAUSES, 0.0)
    out["productive"] = 0.0
    active: list[tuple[float, int]] = []  # (end, rank) of the spans open at the segment
    j = 0
    for a, b in zip(cuts, cuts[1:], strict=False):
        while j < len(opening) and opening[j][0] <= a:
            active.append((opening[j][1], opening[j][2]))
            j += 1
        active = [x for x in active if x[0] > a]
        label = PRIORITY[min(r for _, r in active)] if active else "overhead"
        out[label] += b - a
    return out


def _slow_steps(steps: list[Mapping[str, Any]], recoveries: Iterable[Mapping[str, Any]],
                events: Iterable[Mapping[str, Any]]) -> set[int]:
    """The steps run while a node was reported slow."""
    ranges: list[tuple[int, int | None]] = []
    for ev in events:
        if ev.get("kind") in SLOW_EVENTS:
            a = ev.get("from_step", ev.get("step"))
            if isinstance(a, int):
                b = ev.get("to_step")
                ranges.append((a, b if isinstance(b, int) else None))
    for rec in recoveries:
        if rec.get("class") in SLOW_CLASSES:
            a, b = rec.get("slow_from_step", rec.get("fault_step")), rec.get("resumed_step")
            if isinstance(a, int):
                ranges.append((a, b if isinstance(b, int) else None))
    return {int(r["step"]) for r in steps for a, b in ranges if a <= r["step"] and (b is None or r["step"] <= b)}


def account(steps: Iterable[Mapping[str, Any]], recoveries: Iterable[Mapping[str, Any]] = (),
            events: Iterable[Mapping[str, Any]] = (), *, t_launch: float | None = None,
            t_now: float | None = None) -> dict[str, Any]:
    """Goodput and badput by cause (module docstring). `steps`: step records (`step`, `dt`, `t_end`), each
    step's last execution; `recoveries`: the report's entries (`times`, `stages`, `class`, `action`,
    `resumed_step`); `events`: the run's events; `t_launch`: the job's start (None: its first event or
    step); `t_now`: the end of a live window (None: the end of the last step or record)."""
    latest: dict[int, Mapping[str, Any]] = {}  # each step once: its last execution
    for r in steps:
        if _num(r.get("t_end")) is not None and _num(r.get("dt")) is not None and isinstance(r.get("step"), int):
            if r["step"] not in latest or float(r["t_end"]) >= float(latest[r["step"]]["t_end"]):
                latest[r["step"]] = r
    recs = sorted(latest.values(), key=lambda r: float(r["t_end"]))
    recoveries, events = list(recoveries), list(events)
    ends = {int(r["step"]): float(r["t_end"]) for r in recs}
    decided = {int(r["epoch"]): t for r in recoveries if isinstance(r.get("epoch"), int)
               and (t := recovery_times(r)["decided"]) is not None}
    spans: list[Span] = [(float(r["t_end"]) - max(0.0, float(r["dt"])), float(r["t_end"]), "productive") for r in recs]
    for rec in recoveries:
        spans.extend(_recovery_spans(rec, ends))
    spans.extend(_event_spans(events, decided))
    first = min((a for a, _, c in spans if c == "productive"), default=None)
    times = [x for a, b, _ in spans for x in (a, b)] + [t for ev in events if (t := _num(ev.get("t"))) is not None]
    lo = t_launch if t_launch is not None else min(times, default=0.0)
    if first is not None:
        spans.append((lo, first, "startup"))
    hi = t_now if t_now is not None else max([float(r["t_end"]) for r in recs] + [b for _, b, _ in spans], default=lo)
    hi = max(hi, lo)
    out = _label((lo, hi), spans)
    slow = _slow_steps(recs, recoveries, events)
    if slow:  # the slow steps' time beyond the median of the others is the straggler's
        base = statistics.median([float(r["dt"]) for r in recs if int(r["step"]) not in slow] or [0.0])
        prod = _productive_within(recs, slow, (lo, hi))
        excess = sum(max(0.0, d - base) * f for d, f in prod)
        out["straggler"] += min(excess, out["productive"])
        out["productive"] -= min(excess, out["productive"])
    wall = hi - lo
    since_first = wall - out["startup"]
    productive = out.pop("productive")
    return {
        "goodput": productive / since_first if since_first > 0 else None,
        "goodput_incl_startup": productive / wall if wall > 0 else None,
        "wall_s": wall, "since_first_step_s": since_first, "productive_s": productive,
        "badput_s": out, "steps_counted": len(recs), "t_launch": lo, "t_end": hi,
    }


def _productive_within(recs: list[Mapping[str, Any]], slow: set[int],
                       window: tuple[float, float]) -> list[tuple[float, float]]:
    """(dt, the share of it inside the window) of each slow step (productive ranks first: nothing else
    takes a step's time)."""
    lo, hi = window
    out = []
    for r in recs:
        if int(r["step"]) in slow:
            d = float(r["dt"])
            a, b = float(r["t_end"]) - d, float(r["t_end"])
            inside = max(0.0, min(hi, b) - max(lo, a))
            out.append((d, inside / d if d > 0 else 0.0))
    return out


def summary_line(g: Mapping[str, Any] | None, top: int = 3) -> str:
    """`goodput 93.1% (badput: detection 0.04s, first_step 0.14s, ...)`: the largest causes first."""
    if not g or g.get("goodput") is None:
        return "goodput -"
    bad = sorted(((c, s) for c, s in (g.get("badput_s") or {}).items() if s > 0.0005 and c != "startup"),
                 key=lambda x: -x[1])[:top]
    parts = ", ".join(f"{c} {s:.2f}s" for c, s in bad)
    return f"goodput {g['goodput'] * 100:.1f}%" + (f" (badput {parts})" if parts else "")

