"""`phoenixft agent`: a node agent joining a coordinator (multi-host, or a spare started by hand)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run a node agent that joins a running job's coordinator")
    p.add_argument("--store", required=True, help="coordinator store HOST:PORT")
    p.add_argument("--node", required=True, help="node id: n<i> for an active slot, s<i> for a spare")
    p.add_argument("--workers", type=int, default=1, help="workers on this node (must match the job)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--run-id", default="manual", help="tag for shared-memory names (letters, digits, '_')")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the store to answer at start, then fail with one line (10)")
    p.add_argument("--control-plane-timeout", type=float, default=15.0, metavar="S",
                   help="stop the node and free its shared memory after S seconds without the store (15)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from phoenixft.agent import main

    return main(["--store", args.store, "--node", args.node, "--workers", str(args.workers), "--threads",
                 str(args.threads), "--run-id", args.run_id, "--connect-timeout", str(args.connect_timeout),
                 "--control-plane-timeout", str(args.control_plane_timeout)])
