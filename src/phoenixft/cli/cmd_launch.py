"""`phoenixft launch [flags] train.py [script args]`: protect a user's own training script.

Like `torchrun`, it runs the script on every worker (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT` set; torchrun's `--nnodes` and `--nproc-per-node` are accepted for `--nodes` and
`--workers-per-node`), with warm spares that run it up to `phoenixft.init()` and wait there to be
promoted. The script keeps its own loop, model, optimizer and data; `phoenixft.init()` and the `job`
it returns (docs/script.md) protect every step and recover every failure inside the running
processes. Every flag before the script's path is phoenixft's, every one after it the script's.

With `--head`, this host is the head of a job across hosts (as `phoenixft coordinator`): it serves the
control plane on `--host:--port`, and each host joins with `phoenixft agent --coordinator HOST:PORT`;
the script must be at the same path on every host.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from phoenixft.config import add_run_arguments, config_from_args
from phoenixft.config.training import TrainingConfig

__all__ = ["add_parser", "launch"]

# the run flags that describe the built-in trainer (its model, data, recipe and checks): the script has its own
_BUILT_IN_ONLY = tuple(f.name for f in dataclasses.fields(TrainingConfig) if f.name not in ("seed",)) + (
    "tp", "pp", "bucket_mb", "sdc_check_every", "spike_threshold", "spike_window", "sdc_audit", "sdc_audit_every")
SCRIPT_STEPS = 1 << 30  # the run's step count as the launcher sees it: the script's loop decides (job.steps(n))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch", help="protect your own training script: run it on N nodes x G workers with warm spares",
        description="Run a training script on every worker, as torchrun does, under phoenixft's protection: the "
        "script calls phoenixft.init() and wraps its model, optimizer and loader (docs/script.md); every step is "
        "snapshotted and replicated to peers, and a failure is recovered inside the running processes (a spare "
        "hot-swapped in, a crashed worker restarted in place, the job shrunk with its global batch kept). Flags "
        "before the script are phoenixft's; the script's own come after its path.")
    p.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    p.add_argument("--head", action="store_true",
                   help="serve a job across hosts from here (as `phoenixft coordinator`): agents on other hosts "
                        "join with `phoenixft agent --coordinator HOST:PORT`; needs --host")
    p.add_argument("--host", default="", metavar="ADDR", help="with --head: the address to serve on")
    p.add_argument("--port", type=int, default=29500, metavar="P", help="with --head: the port (default 29500)")
    p.add_argument("--token", default="", help="the job token (default: $PHOENIXFT_TOKEN; else a random one)")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="read the job token from the first line of PATH (mode 0600, yours): unlike --token it "
                        "does not show in `ps`")
    add_run_arguments(p, exclude=_BUILT_IN_ONLY)
    # torchrun's names for the same things
    p.add_argument("--nnodes", dest="nodes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="workers_per_node", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=launch)


def launch(args: argparse.Namespace) -> int:
    from phoenixft.controlplane import auth
    from phoenixft.errors import UserError

    path = os.path.abspath(args.script)
    if not os.path.isfile(path):
        raise UserError(f"SCRIPT={args.script!r} is invalid: no such file (the training script to run, a .py file)")
    token = auth.resolve_token(args.token, args.token_file)
    if token:
        auth.check_token(token, auth.token_source(args.token, args.token_file))
    args.script, args.script_args = path, list(args.script_args)
    args.steps = SCRIPT_STEPS
    cfg = config_from_args(args)
    from phoenixft.runtime.exitcode import command_exit
    from phoenixft.runtime.launcher import run_job

    if args.head:
        if not args.host:
            raise UserError("--head needs --host: the address of this host to serve the job on")
        report = run_job(cfg, host=args.host, port=args.port, token=token, local=False)
    else:
        report = run_job(cfg, token=token)
    return command_exit(report)  # (0 done, 75 stopped with its state saved, 130 interrupted, else 1: exitcode.py)
