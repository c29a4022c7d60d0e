"""`phoenixft agent`: a node agent joining a job's coordinator (another host, or a spare started by hand).

It proves it holds the job token (`--token` or $PHOENIXFT_TOKEN) before it is admitted, then runs
the node's workers. The work is done by `phoenixft.runtime.agent`.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run a node agent that joins a job's coordinator (on this or another host)",
                       description="Join the job served at HOST:PORT (by `phoenixft coordinator`, or a local "
                       "`phoenixft run`) as one node: prove the job token (HMAC challenge-response; the token never "
                       "crosses the network), get a node id, run --workers workers, heartbeat. Refused agents get "
                       "one line saying why (exit code 2).")
    p.add_argument("--coordinator", "--store", dest="store", required=True, metavar="HOST:PORT",
                   help="the job's coordinator (its control-plane store); --store is the old name")
    p.add_argument("--node", required=True, metavar="NAME",
                   help="this node's name (any name; n<i> or s<k> asks for exactly that node id)")
    p.add_argument("--spare", action="store_true", help="join as a warm spare, promoted when a node fails")
    p.add_argument("--workers", type=int, default=1, help="workers on this node (must match --workers-per-node)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--token", default="", help="the job token (default: $PHOENIXFT_TOKEN); prefer the "
                                               "environment: a flag shows in `ps`")
    p.add_argument("--host", default="", metavar="ADDR",
                   help="this host's address for the data plane (default: the one it reaches the coordinator from)")
    p.add_argument("--run-id", default="", help="check that the coordinator runs this run id")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the store to answer at start, then fail with one line (10)")
    p.add_argument("--join-timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the coordinator to admit it (120)")
    p.add_argument("--control-plane-timeout", type=float, default=15.0, metavar="S",
                   help="stop the node and free its shared memory after S seconds without the store (15)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from phoenixft.runtime.agent import main

    flag = "--store" if any(a.startswith("--store") for a in sys.argv[1:]) else "--coordinator"  # errors name it
    argv = [flag, args.store, "--node", args.node, "--workers", str(args.workers), "--threads",
            str(args.threads), "--connect-timeout", str(args.connect_timeout), "--join-timeout",
            str(args.join_timeout), "--control-plane-timeout", str(args.control_plane_timeout)]
    if args.spare:
        argv.append("--spare")
    if args.host:
        argv += ["--host", args.host]
    if args.run_id:
        argv += ["--run-id", args.run_id]
    if args.token:
        argv += ["--token", args.token]
    return main(argv)
