"""`phoenixft coordinator --host ADDR --port P [run flags]`: the head of a job that spans hosts.

It serves the control-plane store on ADDR:P (that address only) and the coordinator, and writes the
run directory (events, metrics, report) on this host; it starts no node: every host runs
`phoenixft agent --coordinator ADDR:P --node NAME [--spare]`, and the job starts when the `--nodes`
active nodes have joined. The job token comes from `--token` or $PHOENIXFT_TOKEN; without either,
one is generated and printed (to this terminal only). The work is done by `phoenixft.launcher`.
"""

from __future__ import annotations

import argparse

from phoenixft.config import add_run_arguments, config_from_args

__all__ = ["add_parser", "coordinator"]

# the head starts and kills no agent: these run flags mean nothing here (--repair-after and
# --spare-arrives-at-step stay, so that check_mode can say why they are refused)
_LOCAL_ONLY = ("fence_kill", "threads")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "coordinator",
        help="serve a multi-host job: store + coordinator + run directory here; agents join from other hosts",
        description="Serve a job whose nodes run on other hosts: the control-plane store (listening on --host:--port "
        "only), the coordinator, and the run directory (events, metrics, report) on this host. Each host joins "
        "with `phoenixft agent --coordinator HOST:PORT --node NAME [--spare] [--workers G]`, proving it holds the "
        "job token; the job starts when --nodes active nodes have joined (--join-timeout) and reports as "
        "`phoenixft run` does. The store (torch's TCPStore) has no authentication of its own: keep its port on a "
        "private network.",
    )
    p.add_argument("--host", required=True, metavar="ADDR", help="address to serve on (an address of this host)")
    p.add_argument("--port", type=int, default=29500, metavar="P", help="port to serve on (default 29500; 0 = any)")
    p.add_argument("--token", default="", help="the job token (default: $PHOENIXFT_TOKEN; else one is generated "
                                               "and printed); prefer the environment: a flag shows in `ps`")
    add_run_arguments(p, exclude=_LOCAL_ONLY)
    p.set_defaults(func=coordinator)


def coordinator(args: argparse.Namespace) -> int:
    from phoenixft import auth
    from phoenixft.errors import UserError
    from phoenixft.launcher import run_job

    if not 0 <= args.port < 65536:
        raise UserError(f"--port={args.port} is invalid: must be in 0..65535 (0 = any free port)")
    token = auth.resolve_token(args.token)
    if token:
        auth.check_token(token, "--token" if args.token else f"${auth.TOKEN_ENV}")
    cfg = config_from_args(args)
    report = run_job(cfg, host=args.host, port=args.port, token=token, local=False)
    return 0 if report.get("state") == "done" else 1
