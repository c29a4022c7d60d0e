"""`phoenixft drain NODE (--run-dir DIR | --coordinator HOST:PORT)`: drain a node of a live run.

The node's role moves to a warm spare at the next step boundary (or, with no spare ready, the job
shrinks without it), nothing is lost, and the node's processes leave cleanly. NODE is a node id of the
current epoch (`n2`, `s0`; `phoenixft status` lists them) or its slot number. The run is found as
`phoenixft status` finds it: by its coordinator's address, or for a local run by its run directory
(`coordinator.port`, or `control_plane` for a run on a replicated control plane). The request is one
store key (`controlplane.keys.drain_key`), sealed with the run key (the coordinator acts on no other), so
the command needs the job token: `--token-file`, `$PHOENIXFT_TOKEN`, or a local run's generated token file
in its run directory. With `--wait` the command waits until the coordinator has acted on it and prints what
it did (exit code 1 if it was not done as a drain).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from phoenixft.errors import UserError

__all__ = ["add_parser", "drain"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "drain",
        help="move a live node's role to a warm spare at the next step boundary, with nothing lost",
        description="Ask a running job's coordinator to drain NODE: at the next step boundary its role moves "
        "to a warm spare (with no spare ready, the job shrinks without it), no step is lost, and the node's "
        "processes exit cleanly. NODE is a node id of the current epoch (n2, s0) or its slot number.",
    )
    p.add_argument("node", metavar="NODE", help="node id of the current epoch (e.g. n2) or its slot number")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", metavar="DIR", help="the run directory of a local `phoenixft run`")
    where.add_argument("--coordinator", metavar="HOST:PORT", help="address of the coordinator's store (or the "
                       "job's etcd:// URL)")
    p.add_argument("--reason", default="requested by an operator", help="why (shown live and in the report)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="the node goes in S seconds (a spare still starting is waited for at most half of it)")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="the job token's file (mode 0600, yours; default: $PHOENIXFT_TOKEN, or the token file "
                   "of --run-dir): the request is signed with it")
    p.add_argument("--wait", action="store_true", help="wait until the coordinator has acted and print what it did")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the coordinator (to connect: at most 5; with --wait: for the drain) (60)")
    p.set_defaults(func=drain)


def _address(args: argparse.Namespace) -> str:
    if args.coordinator:
        return str(args.coordinator)
    from phoenixft.runtime.rundir import store_address

    return store_address(args.run_dir)


def _bind(args: argparse.Namespace, store: Any, addr: str) -> None:
    """Seal what this command writes with the run key: the job token (--token-file, $PHOENIXFT_TOKEN, or the
    run directory's token file) and the run id in the store, which count once the job's config verifies with
    them. UserError (one line) without a token, or with one that is not the job's."""
    from phoenixft.controlplane import auth, keys, sealed
    from phoenixft.controlplane.signed import verified
    from phoenixft.runtime.rundir import TOKEN_FILE

    source = f"--token-file={args.token_file}" if args.token_file else f"${auth.TOKEN_ENV}"
    token = auth.resolve_token(None, args.token_file)
    if not token and args.run_dir and (Path(args.run_dir) / TOKEN_FILE).is_file():
        source = f"--token-file={Path(args.run_dir) / TOKEN_FILE}"
        token = auth.read_token_file(str(Path(args.run_dir) / TOKEN_FILE))
    if not token:
        raise UserError(f"a drain request is signed with the job token: give --token-file PATH or ${auth.TOKEN_ENV} "
                        f"(a local run's generated token is in its run directory, `{TOKEN_FILE}`)")
    run_id = (store.get_nowait(keys.RUN_ID) or b"").decode(errors="replace")
    if verified(store, token, run_id, keys.CONFIG, note=False) is None:
        raise UserError(f"{source}: not the token of the job at {addr} (its config is not signed with it)")
    sealed.bind(token, run_id)


def _slot_of(node: str, nodes: list[str]) -> str:
    """The node id NODE names (a node id, or a slot number) in the current epoch's `nodes`."""
    if node in nodes:
        return node
    if node.isdigit() and int(node) < len(nodes):
        return nodes[int(node)]
    raise UserError(f"NODE={node!r} is not a node of the current epoch (its nodes: {', '.join(nodes) or 'none yet'})")


def drain(args: argparse.Namespace) -> int:
    from phoenixft.controlplane import keys
    from phoenixft.controlplane.drain import current_nodes, request_drain
    from phoenixft.observe.status import connect

    if not args.timeout > 0:
        raise UserError(f"--timeout={args.timeout} must be > 0")
    if args.deadline is not None and not args.deadline >= 0:
        raise UserError(f"--deadline={args.deadline} must be >= 0 seconds")
    from phoenixft.controlplane import sealed
    from phoenixft.controlplane.values import parse_int

    addr = _address(args)
    store = connect(addr, min(5.0, args.timeout))
    _bind(args, store, addr)
    node = _slot_of(args.node, current_nodes(store))
    e0 = parse_int(sealed.get(store, keys.EPOCH), keys.EPOCH, 0)
    deadline = time.time() + args.deadline if args.deadline is not None else None
    slot = request_drain(store, node, args.reason, "cli", deadline)
    if slot is None:
        raise UserError(f"{node} left the job meanwhile: nothing to drain")
    print(f"asked the coordinator at {addr} to drain {node} (slot {slot})", flush=True)
    if not args.wait:
        return 0
    rec = _await_drain(store, node, e0, args.timeout)
    d = rec.get("drain") or {}
    if d.get("completed"):
        to = ", ".join(rec.get("promoted") or []) or "none (the job shrank)"
        print(f"{node} drained at step {rec.get('resume_step')}: class {rec.get('class')}, action {rec.get('action')}, "
              f"spare {to}, lost {rec.get('max_committed', 0) - rec.get('resume_step', 0)} step(s)")
        return 0
    print(f"{node} was not drained: {rec.get('why') or 'it was lost first (the failure path recovered it)'}")
    return 1


def _await_drain(store: Any, node: str, e0: int, timeout_s: float) -> dict[str, Any]:
    """The recovery record of the epoch that answered the drain of `node` (or {"why": ...} if it was not)."""
    from phoenixft.controlplane import keys, sealed
    from phoenixft.controlplane.values import read_raw

    end = time.monotonic() + timeout_s
    e, seen = e0 + 1, 0
    macs: set[bytes] = set()
    while time.monotonic() < end:
        rec = sealed.get_json(store, keys.recovery(e))
        if rec is not None:
            if (rec.get("drain") or {}).get("node") == node:
                return dict(rec)
            e += 1
            continue
        raw = read_raw(store, keys.EVENTS) or b""
        for ev in sealed.records(keys.EVENTS, raw[seen:], macs):
            if ev.get("kind") == "drain_ignored" and ev.get("node") == node:
                return {"why": str(ev.get("why"))}
        seen = len(raw) - len(raw.split(b"\n")[-1])  # (a line still being written is read again)
        time.sleep(0.1)
    raise UserError(f"the coordinator did not act on the drain of {node} within --timeout={timeout_s:g}s")
