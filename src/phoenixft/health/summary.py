"""The health gate and the quarantine as `phoenixft status`, the JSON report and the HTML report show
them, read from the control-plane store (read-only; malformed values are ignored and logged)."""

from __future__ import annotations

from typing import Any

from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.values import clean
from phoenixft.health.history import host_records, read_history

__all__ = ["summarize", "format_lines"]


def _spare_record(store: Store, node: str, host: str) -> dict[str, Any] | None:
    rec = sealed.get_json(store, keys.health(node))
    if not isinstance(rec, dict) or not isinstance(rec.get("ok"), bool):
        return None
    return {"node": node, "host": str(rec.get("host") or host), "ok": rec["ok"], "reason": str(rec.get("reason", "")),
            "phase": str(rec.get("phase", "")), "t": rec.get("t"), "times": rec.get("times") or {},
            "duration_s": rec.get("duration_s")}


def summarize(store: Store, cfg: dict[str, Any] | None) -> dict[str, Any]:
    """{"health": the spares' latest checks (and the unhealthy ones), "quarantine": each host's failures
    and the quarantined hosts}, by the job's --quarantine-after/--quarantine-window (`cfg`: its config)."""
    cfg = cfg or {}
    after = int(cfg.get("quarantine_after", 2) or 0)
    window = float(cfg.get("quarantine_window", 86400.0) or 86400.0)
    members = sealed.get_json(store, keys.MEMBERS, {}) or {}
    spares = []
    for node in sorted((n for n in members if str(n).startswith("s")), key=lambda n: (len(n), n)):
        m = members[node] if isinstance(members.get(node), dict) else {}
        rec = _spare_record(store, node, str(m.get("hostid", "")))
        if rec is not None:
            spares.append(rec)
    hosts = host_records(read_history(store), after, window)
    return {
        "health": {"gate": bool(cfg.get("health_gate", True)), "check": cfg.get("health_check", ""),
                   "spares": spares, "unhealthy": [s["node"] for s in spares if not s["ok"]]},
        "quarantine": {"after": after, "window_s": window,
                       "hosts": [h.to_json() for h in sorted(hosts.values(), key=lambda h: h.host)],
                       "quarantined": sorted(h for h, r in hosts.items() if r.quarantined is not None)},
    }


def format_lines(summary: dict[str, Any]) -> list[str]:
    """The lines `phoenixft status` prints for `summarize`'s answer."""
    out = []
    spares = summary["health"]["spares"]
    if spares:
        out.append("spare health: " + "; ".join(
            f"{clean(s['node'], 64)} {'healthy' if s['ok'] else 'UNHEALTHY'} ({clean(s['phase'], 40)} check)"
            + ("" if s["ok"] else f": {clean(s['reason'], 160)}") for s in spares))
    q = summary["quarantine"]
    for h in q["hosts"]:
        fails = "; ".join(f"{clean(str(f['node']), 64)}: {clean(str(f['reason']), 100)}"
                          + (f" [injected: {clean(str(f['injected']), 40)}]" if f.get("injected") else "")
                          for f in h["failures"]) or clean(str(h["reason"]), 200)
        state = "QUARANTINED" if h["quarantined"] else "not quarantined"
        injected = sum(1 for f in h["failures"] if f.get("injected"))
        counted = f", {injected} of them injected (not counted)" if injected else ""
        out.append(f"host {clean(str(h['host']), 80)}: {state}, {len(h['failures'])} failure(s){counted} ({fails})")
    if q["quarantined"]:
        shown = ", ".join(clean(str(h), 80) for h in q["quarantined"])
        out.append(f"quarantined hosts: {shown} (never admitted again; rule: "
                   f"{q['after']} failures within {q['window_s']:g}s)")
    return out
