"""`phoenixft agent`: a node agent joining a job's coordinator (another host, or a spare started by hand).

It proves it holds the job token (`--token` or $PHOENIXFT_TOKEN) before it is admitted, then runs
the node's workers. The work is done by `phoenixft.runtime.agent`.
"""

from __future__ import annotations

import argparse

from phoenixft.config.agent import add_agent_arguments

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run a node agent that joins a job's coordinator (on this or another host)",
                       description="Join the job served at HOST:PORT (by `phoenixft coordinator`, or a local "
                       "`phoenixft run`) as one node: prove the job token (HMAC challenge-response; the token never "
                       "crosses the network), get a node id, run --workers workers, heartbeat. Refused agents get "
                       "one line saying why (exit code 2).")
    add_agent_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from phoenixft.runtime.agent import run_agent
    from phoenixft.runtime.procs import exit_now

    flag = "--store" if any(a.startswith("--store") for a in sys.argv[1:]) else "--coordinator"  # errors name it
    # the node is cleaned up (workers reaped, its memory freed, its leaving told): exit without the interpreter's
    # finalization, seconds with torch imported on a busy host (a scheduler ending the job SIGKILLs what is left)
    exit_now(run_agent(args, flag))
    return 0  # (not reached)
