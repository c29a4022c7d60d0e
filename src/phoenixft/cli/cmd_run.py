"""`phoenixft run`: train a job locally under protection, with optional fault injection."""

from __future__ import annotations

import argparse

from phoenixft.config import add_run_arguments, config_from_args

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train N nodes x G workers with S warm spares; inject faults; write a report",
                       description="Train a job as local processes: coordinator, one agent per node, workers, spares.")
    add_run_arguments(p)
    p.add_argument("--token", default="", help="the job token, for agents started by hand to join this run "
                                               "(default: $PHOENIXFT_TOKEN; else a random one)")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="read the job token from the first line of PATH (mode 0600, yours): unlike --token it "
                        "does not show in `ps`")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="Start nothing: print the host memory each node needs (parameters, ping-pong halves, "
                        "replicas or parity) and the bytes each rank sends per step, for these flags.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    flag, path = getattr(args, "token", ""), getattr(args, "token_file", "")
    # the run's own values first, checked before anything imports torch; but a --token first of all (it is
    # scrubbed from the command line as it is checked: `ps` must not show it while the config is checked)
    cfg = None if flag else config_from_args(args)
    from phoenixft.controlplane import auth
    token = auth.resolve_token(flag, path)
    if token:
        auth.check_token(token, auth.token_source(flag, path))
    cfg = cfg or config_from_args(args)
    if getattr(args, "dry_run", False):
        from phoenixft.protect.redundancy.estimate import estimate_config, format_estimate

        print(format_estimate(estimate_config(cfg), cfg))
        return 0
    from phoenixft.runtime.exitcode import command_exit
    from phoenixft.runtime.launcher import run_job

    report = run_job(cfg, token=token)
    return command_exit(report)  # (0, 75, 1, 130 as runtime/exitcode.py says: what a scheduler decides by)
