"""What a running job looks like from its control plane: membership, epoch, spares, progress, events.

    phoenixft status --coordinator HOST:PORT [--events N] [--timeout S] [--json]

(for a local run, HOST:PORT is 127.0.0.1 and the port in RUN_DIR/coordinator.port). It connects
to the coordinator's TCPStore as one more client and only reads: `epoch` and `topo/<epoch>`
(membership), `config` (spare pool: s0..s{S-1}; a spare is used once it appears in any
topology, ready once its workers set `ready/<node>.<i>`), `hb/<node>` and `exit/<node>` (node
health), `progress` and `step/<n>`, `run/state`, `run/error`, and the tail of `events`.
Every read is `check` before `get` (a TCPStore `get` blocks until the key exists) and every
call runs under the store's timeout. The c10d client's own timeout does not cover everything
(against a port that accepts connections but never answers, its handshake waits forever), so
`connect` and `read_status` also run under a hard deadline in a daemon thread: a wrong, dead or
stopped address is a one-line error, never a hang. A closed port is found by a plain TCP connect
first (no c10d client, no thread). A thread left behind inside the c10d client must not meet the
interpreter's shutdown (a daemon thread ended inside C++ aborts the process: SIGABRT instead of
exit 2), so after one `left_behind()` is true and the caller ends with `os._exit`; fd 2 stays
silenced for that thread and `sys.stderr` is moved to the real stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

from phoenixft.config.training import model_label
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.auth import read_topology
from phoenixft.controlplane.signed import env_token, verified
from phoenixft.controlplane.tls import Relay, TlsFiles
from phoenixft.controlplane.values import clean, note_bad, parse_int, parse_json
from phoenixft.errors import UserError

__all__ = [
    "parse_address",
    "connect",
    "close_relays",
    "read_status",
    "left_behind",
    "collect_status",
    "format_status",
    "describe_event",
]

T = TypeVar("T")

_LEFT_BEHIND: list[threading.Thread] = []  # daemon threads still stuck in a c10d call


def left_behind() -> bool:
    """True once a bounded call was given up while its thread still runs (the process must end
    with os._exit: see the module docstring)."""
    return any(th.is_alive() for th in _LEFT_BEHIND)


def parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator={addr!r} is invalid: expected HOST:PORT, e.g. 127.0.0.1:29500")
    return host.strip("[]"), int(port)


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Silence fd 2 for a moment: c10d prints multi-line C++ traces while it retries a connect."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        if left_behind():
            # the stuck thread may still print: fd 2 stays silenced, Python's stderr moves to the saved fd
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            sys.stderr = os.fdopen(saved, "w", buffering=1)
        else:
            os.dup2(saved, 2)
            os.close(saved)


def _bounded(fn: Callable[[], T], deadline_s: float) -> T:
    """Run fn in a daemon thread; TimeoutError if it has not returned after deadline_s.

    A call stuck inside the c10d client cannot be cancelled; its daemon thread is left behind
    and does not keep the process from exiting."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=target, name="phoenixft-status", daemon=True)
    th.start()
    th.join(deadline_s)
    if th.is_alive():
        _LEFT_BEHIND.append(th)
        raise TimeoutError(f"no answer after {deadline_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


def connect(addr: str, timeout_s: float, tls: TlsFiles | None = None, token: str | None = None) -> Store:
    """A client of the coordinator's store; UserError (naming --coordinator) when it cannot be reached.
    With `tls` a `HOST:PORT` is a TLS gateway (a head started with --tls-*): it is reached through a
    forwarder of this process's own (`controlplane.tls`, stopped by `close_relays`), as an agent reaches
    it; a replicated store is spoken to over HTTPS with those files (else the ones the environment names)
    and, if it asks, as the job's user (`token`, else the one in the environment): `controlplane.connect`."""
    from phoenixft.controlplane import connect as open_store
    from phoenixft.controlplane import describe

    where = describe(addr)
    if where.replicated:  # a cluster: its client fails over between members (no single port to probe)
        try:
            where.endpoints()
        except ValueError as e:
            raise UserError(f"--coordinator={addr!r} is invalid: {e}") from None
        target = addr
    else:
        host, port = parse_address(addr)
        target = f"{host}:{port}"
        try:  # a closed port or an unroutable host: answered here, without a c10d client
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as e:
            raise UserError(
                f"cannot reach a phoenixft coordinator at --coordinator={addr} (--timeout {timeout_s:g}s: "
                f"{_why(e) if not isinstance(e, TimeoutError) else 'no answer'})"
            ) from None
        if tls is not None:
            target = _through_tls(addr, host, port, tls, timeout_s)

    def attempt() -> Store:
        # c10d retries a refused connect for up to about twice the client's timeout: half of --timeout
        # each, so that the whole attempt takes about --timeout (a dead port answered after 2x + 2 s)
        store = open_store(target, max(0.5, timeout_s / 2), tls if where.replicated else None, token)
        store.check([keys.CONFIG])  # a round trip: something that is not a TCPStore fails here
        return store

    try:
        with _quiet_fd2():
            return _bounded(attempt, timeout_s + 1.0)
    except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, OSError, TimeoutError...
        raise UserError(
            f"cannot reach a phoenixft coordinator at --coordinator={addr} (--timeout {timeout_s:g}s: "
            f"{_why(e)})"
        ) from None


_RELAYS: list[Relay] = []  # the forwarders `connect` started (stopped by close_relays)


def _through_tls(addr: str, host: str, port: int, files: TlsFiles, timeout_s: float) -> str:
    """The loopback address of a new forwarder to the TLS gateway at host:port; UserError if it lets us not in."""
    from phoenixft.controlplane import tls

    why = tls.probe(host, port, files, timeout_s)
    if why:
        raise UserError(f"--coordinator={addr}: no TLS channel to the coordinator ({why}): is it started with TLS, "
                        "and are --tls-cert and the coordinator's certificate both signed by --tls-ca?")
    relay = tls.start_forwarder(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", files)
    _RELAYS.append(relay)
    return relay.addr


def close_relays() -> None:
    """Stop the forwarders `connect` started."""
    while _RELAYS:
        _RELAYS.pop().stop()


def read_status(store: Store, addr: str, timeout_s: float, events: int = 10) -> dict[str, Any]:
    """`collect_status` under a hard deadline; UserError (naming --coordinator) if the store fails."""
    try:
        return _bounded(lambda: collect_status(store, events=events), 4 * timeout_s + 2.0)
    except Exception as e:  # noqa: BLE001 - the coordinator went away, stopped, or timed out mid-read
        raise UserError(
            f"lost the coordinator at --coordinator={addr} while reading its state ({_why(e)})"
        ) from None


def _get(store: Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


def _json(store: Store, key: str) -> Any:
    return parse_json(_get(store, key), key, None, object)  # (None, logged, if it does not parse)


def _sealed(store: Store, key: str) -> bytes | None:
    """The value of a key the job seals (controlplane.sealed): checked with the run key where this process
    holds the job's token ($PHOENIXFT_TOKEN), else shown unchecked."""
    return sealed.unseal(key, _get(store, key))


def _wall(beat: bytes) -> float:
    """The writer's wall time in a heartbeat's value ("WALL MONOTONIC"), as shown (0: not one)."""
    try:
        return float(beat.split()[0])
    except (IndexError, ValueError):
        return 0.0


def _run_id(store: Store) -> str:
    return clean(_get(store, keys.RUN_ID) or b"", 64)


def _bind(store: Store) -> None:
    """Check what is shown with the run key if the token in the environment is the job's, else show it
    unchecked (status only reads)."""
    if sealed.bound():
        return
    token = env_token()
    run_id = _run_id(store)
    if token and verified(store, token, run_id, keys.CONFIG, note=False) is not None:
        sealed.bind(token, run_id)
    else:
        sealed.read_unchecked()


_SHOWN_ERRORS = (AttributeError, IndexError, KeyError, LookupError, OverflowError, TypeError, ValueError)


def _guarded(what: str, fn: Callable[[], T], default: T) -> T:
    """`fn()`, or `default` where what the store holds there is not of the shape the job writes (logged once:
    without the job's token status shows values unchecked, and anyone reaching the store can write them)."""
    try:
        return fn()
    except _SHOWN_ERRORS as e:
        note_bad(what, f"not shown ({type(e).__name__}: {clean(str(e), 80)})")
        return default


def _cfg_int(cfg: dict[str, Any] | None, name: str, default: int) -> int:
    v = (cfg or {}).get(name, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 else default


def _topologies(store: Store, e: int, st: dict[str, Any]) -> None:
    """The epochs' topologies (signed with the job token where this process holds it) and the membership."""
    now = st["_now"]
    topos = [t for t in (read_topology(store, i, sealed.bound_token()) for i in range(max(0, e - 999), e + 1))
             if t is not None]
    st["history"] = [{"epoch": t.epoch, "nodes": list(t.nodes), "resume_step": t.resume_step,
                      "meta": t.meta} for t in topos]
    topo = topos[-1] if topos and topos[-1].epoch == e else None
    st["topology"] = asdict(topo) if topo is not None else None
    if topo is None:
        return
    g, racks = topo.workers_per_node, max(1, topo.racks)
    for slot, node in enumerate(topo.nodes):
        hb = _sealed(store, keys.heartbeat(node))
        st["members"].append({
            "slot": slot,
            "node": node,
            "ranks": list(range(slot * g, (slot + 1) * g)),
            "rack": slot * racks // len(topo.nodes),
            "heartbeat_age_s": None if hb is None else max(0.0, now - _wall(hb)),
            "exited": sealed.has(store, keys.node_exit(node)),
            "fenced": sealed.has(store, keys.fence(node)),
        })


def _spares(store: Store, cfg: dict[str, Any] | None, st: dict[str, Any]) -> None:
    topo = st["topology"]
    g = topo["workers_per_node"] if topo else _cfg_int(cfg, "workers_per_node", 1)
    used = {n: h["epoch"] for h in reversed(st["history"]) for n in h["nodes"]}  # first epoch it appeared in
    current = list(topo["nodes"]) if topo else []
    for i in range(min(_cfg_int(cfg, "spares", 0), 4096)):
        sid = f"s{i}"
        ready = sealed.all_present(store, [keys.ready(f"{sid}.{j}") for j in range(g)])
        if sid in current:
            state = f"in use (slot {current.index(sid)}, since epoch {used[sid]})"
        elif sid in used:
            state = f"used in epoch {used[sid]}, since lost"
        else:
            state = "ready" if ready else "starting (not ready yet)"
        st["spares"].append({"id": sid, "used": sid in used, "ready": ready, "state": state})


def collect_status(store: Store, events: int = 10, now: float | None = None) -> dict[str, Any]:
    """Read the job's state from the store (read-only) into a plain dict. Total: a value of the wrong shape
    is left out (logged once), never a raise."""
    now = time.time() if now is None else now
    _bind(store)
    cfg = _config(store)
    st: dict[str, Any] = {
        "config": cfg,
        "epoch": None,
        "topology": None,
        "history": [],
        "members": [],
        "spares": [],
        "progress": None,
        "run_state": None,
        "run_error": None,
        "events": [],
        "events_total": 0,
        "_now": now,
    }
    raw = _signed(store, keys.RUN_STATE)
    st["run_state"] = clean(raw, 200) if raw is not None else None
    raw = _sealed(store, keys.RUN_ERROR)
    st["run_error"] = clean(raw, 2000) if raw is not None else None
    e = parse_int(_sealed(store, keys.EPOCH), keys.EPOCH, -1)
    if e >= 0:
        st["epoch"] = e
        _guarded(keys.topo(e), lambda: _topologies(store, e, st), None)
    _guarded(keys.CONFIG, lambda: _spares(store, cfg, st), None)
    n = parse_int(_sealed(store, keys.PROGRESS), keys.PROGRESS, -1)
    if n >= 0:
        rec = parse_json(_sealed(store, keys.step(n)), keys.step(n), None)
        st["progress"] = {"step": n, "steps": _cfg_int(cfg, "steps", 0) or None, "record": rec}
    from phoenixft.health.summary import summarize

    # the spares' health checks, each host's failures, the quarantined hosts
    empty: dict[str, Any] = {}
    st.update(_guarded(keys.HOST_HISTORY, lambda: summarize(store, cfg), empty))
    raw = _get(store, keys.EVENTS)
    if raw is not None:
        recs = sealed.records(keys.EVENTS, raw)
        st["events_total"] = len(recs)
        st["events"] = recs[-events:] if events > 0 else []
    del st["_now"]
    return st


def _config(store: Store) -> dict[str, Any] | None:
    """The job's config: signed with the run key where this process holds the job's token, else unchecked."""
    raw = _signed(store, keys.CONFIG)
    return parse_json(raw, keys.CONFIG, None) if raw is not None else None


def _signed(store: Store, key: str) -> bytes | None:
    """A value signed beside it (controlplane.signed): checked where this process holds the job's token."""
    token = sealed.bound_token()
    if not token:
        return _get(store, key)
    return verified(store, token, _run_id(store), key)


def describe_event(ev: dict[str, Any], width: int = 160) -> str:
    """One line for an event: local time, kind, source, the other fields as key=value (whatever their types:
    an event shown unchecked may hold anything)."""
    t: Any = ev.get("t")
    try:
        stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (TypeError, ValueError, OverflowError, OSError):
        stamp = "--:--:--"
    src = clean(str(ev.get("by") or ev.get("wid") or ev.get("node") or "-"), 40)
    rest = ", ".join(
        f"{clean(str(k), 40)}={clean(v, 200) if isinstance(v, str) else clean(json.dumps(v), 200)}"
        for k, v in ev.items()
        if k not in ("t", "kind", "by", "wid")
    )
    line = f"{stamp}  {clean(str(ev.get('kind', '?')), 40):<17} {src:<12} {rest}"
    return line if len(line) <= width else line[: width - 3] + "..."


def _meta_line(meta: dict[str, Any]) -> str:
    dead = ", ".join(clean(str(n), 64) for n in meta.get("dead") or []) or "-"
    promoted = ", ".join(clean(str(n), 64) for n in meta.get("promoted") or []) or "-"
    return (f"; after a {clean(str(meta.get('class', '?')), 40)} failure -> {clean(str(meta.get('action', '?')), 40)}, "
            f"dead {dead}, promoted {promoted}")


def _age(x: float | None) -> str:
    return "no heartbeat yet" if x is None else f"heartbeat {x:.1f}s ago"


def format_status(st: dict[str, Any], addr: str = "") -> str:
    """The human-readable status, several lines (a part that does not format, from a value shown unchecked,
    is left out and logged once)."""
    out: list[str] = []
    _guarded("status", lambda: _format(st, addr, out), None)
    return "\n".join(out)


def _format(st: dict[str, Any], addr: str, out: list[str]) -> None:
    cfg = st.get("config")
    state = st.get("run_state") or ("running" if st.get("epoch") is not None else "starting")
    out.append(
        f"coordinator {addr}   run state: {state}" + (f" ({st['run_error']})" if st.get("run_error") else "")
    )
    if cfg is None:
        out.append("no phoenixft run has published its config on this store yet")
        return
    c = {k: clean(str(cfg.get(k)), 60) for k in ("nodes", "workers_per_node", "spares", "steps", "protect", "model")}
    out.append(
        f"job: {c['nodes']} node(s) x {c['workers_per_node']} worker(s), {c['spares']} "
        f"spare(s), {c['steps']} steps, protect={c['protect']}, {clean(model_label(cfg), 120)}"
    )
    topo = st.get("topology")
    if st.get("epoch") is None or topo is None:
        out.append("epoch: none yet (waiting for every node to be ready)")
    else:
        g = topo.get("workers_per_node", 1)
        n = len(topo["nodes"])
        meta = topo.get("meta") or {}
        line = f"epoch {st['epoch']}: world {n * g} ({n} node(s) x {g} worker(s)), "
        line += f"resume step {topo.get('resume_step')}"
        if meta:
            line += _guarded(keys.topo(st["epoch"]), lambda: _meta_line(meta), "")
        out.append(line)
        out.append("membership:")
        for m in st["members"]:
            ranks = ",".join(str(r) for r in m["ranks"])
            health = "FENCED" if m.get("fenced") else "EXITED" if m["exited"] else _age(m["heartbeat_age_s"])
            rack = f"rack {m['rack']}  " if int(topo.get("racks", 1)) > 1 else ""
            out.append(f"  slot {m['slot']}  {m['node']:<6} {rack}rank(s) {ranks:<8} {health}")
        if len(st.get("history", [])) > 1:
            out.append("epochs: " + "; ".join(f"{h['epoch']}: {' '.join(h['nodes'])}" for h in st["history"]))
    sp = st.get("spares") or []
    free = sum(1 for s in sp if not s["used"] and s["ready"])
    out.append(
        f"spares: {len(sp)} in the pool, {free} ready and unused"
        + (": " + "; ".join(f"{s['id']} {s['state']}" for s in sp) if sp else "")
    )
    if st.get("health") and st.get("quarantine"):
        from phoenixft.health.summary import format_lines

        out += format_lines({"health": st["health"], "quarantine": st["quarantine"]})
    prog = st.get("progress")
    if prog is None:
        out.append("progress: no step completed yet")
    else:
        rec = prog.get("record") or {}
        total = prog.get("steps")
        pct = f" ({100 * prog['step'] / total:.0f}%)" if total else ""
        line = f"progress: step {prog['step']}/{total or '?'}{pct}"
        if rec:
            line += _guarded(keys.step(prog["step"]), lambda: (
                f", loss {float(rec.get('loss', float('nan'))):.4f}, {float(rec.get('dt', 0)) * 1e3:.0f} ms/step, "
                f"epoch {clean(str(rec.get('epoch')), 20)}, world {clean(str(rec.get('world')), 20)}"), "")
        out.append(line)
    evs = st.get("events") or []
    out.append(f"last events ({len(evs)} of {st.get('events_total', 0)}):" if evs else "events: none yet")
    out += ["  " + describe_event(ev) for ev in evs]
