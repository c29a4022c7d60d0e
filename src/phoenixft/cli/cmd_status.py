"""`phoenixft status (--coordinator HOST:PORT | --run-dir DIR)`: membership, epoch, spares, progress and events
of a live run.

Read-only; connects to the coordinator's store with a timeout (`--timeout`, default 5 s) and prints
the status (or `--json`). With `--tls-cert/--tls-key/--tls-ca` it reaches a head started with TLS
through its gateway (a forwarder of its own, as an agent does) and etcd over HTTPS; a local etcd
cluster started with TLS also asks for the job token (`--token-file` or $PHOENIXFT_TOKEN). A wrong
or unreachable address is a one-line error, exit 2. The work is done by `phoenixft.observe.status`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from phoenixft.errors import UserError

__all__ = ["add_parser", "status"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show membership, epoch, spares, progress and last events of a running job",
        description="Connect to a running job's coordinator (read-only) and show its current "
        "epoch and membership, the spare pool, progress, run state and last events. "
        "For a run on this host, --run-dir DIR finds it.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help="address of the coordinator's store (or the job's etcd:// URL)",
    )
    where.add_argument("--run-dir", metavar="DIR", help="the run directory of a live `phoenixft run` (or of a "
                       "`phoenixft coordinator` on this host): its store's address, and its token file when the "
                       "run generated one")
    p.add_argument(
        "--events", type=int, default=10, metavar="N", help="how many of the last events to show (10)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the coordinator, per call (5)",
    )
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.add_argument("--tls-cert", dest="tls_cert", default="", metavar="PATH",
                   help="a certificate signed by --tls-ca: reach a head started with --tls-* through its TLS gateway "
                        "(HOST:PORT as the agents join it), and etcd over HTTPS")
    p.add_argument("--tls-key", dest="tls_key", default="", metavar="PATH", help="the key of --tls-cert (mode 0600)")
    p.add_argument("--tls-ca", dest="tls_ca", default="", metavar="PATH", help="the job CA's certificate")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="the job token (mode 0600; default: $PHOENIXFT_TOKEN): what a local etcd cluster started "
                        "with --tls-* asks of every client")
    p.set_defaults(func=status)


def status(args: argparse.Namespace) -> int:
    from phoenixft.controlplane import describe
    from phoenixft.observe.status import close_relays, connect, format_status, left_behind, parse_address, read_status

    if args.run_dir:  # (this host's run: its store on loopback, or its cluster's URL; its generated token)
        from phoenixft.runtime.rundir import store_address, token_file

        args.coordinator = store_address(args.run_dir)
        args.token_file = args.token_file or token_file(args.run_dir)
    if not describe(args.coordinator).replicated:
        parse_address(args.coordinator)  # (a cluster's URL is checked by connect)
    if not args.timeout > 0:
        raise UserError(f"--timeout={args.timeout} must be > 0")
    if args.events < 0:
        raise UserError(f"--events={args.events} must be >= 0")
    from phoenixft.controlplane import auth, tls

    files = tls.TlsFiles.given(args.tls_cert, args.tls_key, args.tls_ca)
    token = auth.resolve_token(None, args.token_file)
    try:
        store = connect(args.coordinator, args.timeout, files, token)
        st = read_status(store, args.coordinator, args.timeout, events=args.events)
    except UserError as e:
        if args.run_dir and str(e).startswith("cannot reach"):  # (named as the user gave it)
            report = os.path.join(args.run_dir, "report.json")
            ended = f"; it has ended: its report is {report}" if os.path.exists(report) else ""
            e = UserError(f"--run-dir={args.run_dir}: its run does not answer at {args.coordinator}{ended} "
                          f"({str(e).split('(', 1)[-1]}")
        if not left_behind():
            raise e from None
        # a thread is stuck inside the c10d client: the interpreter's shutdown would abort the
        # process (SIGABRT) when it ends that thread, so the error is printed here and the exit is hard
        print(f"phoenixft status: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    finally:
        close_relays()
    if args.json:
        print(json.dumps({"coordinator": args.coordinator, **st}))
    else:
        print(format_status(st, args.coordinator))
    return 0
