"""`phoenixft coordinator --host ADDR --port P [run flags]`: the head of a job that spans hosts.

It serves the control-plane store on ADDR:P (that address only) and the coordinator, and writes the
run directory (events, metrics, report) on this host; it starts no node: every host runs
`phoenixft agent --coordinator ADDR:P --node NAME [--spare]`, and the job starts when the `--nodes`
active nodes have joined. The job token comes from `--token` or $PHOENIXFT_TOKEN; without either,
one is generated and printed (to this terminal only). The work is done by `phoenixft.runtime.launcher`.
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
    p.add_argument("--host", default="", metavar="ADDR", help="address to serve on (an address of this host; "
                   "required unless --standby)")
    p.add_argument("--standby", default="", metavar="ETCD_URL",
                   help="run only a standby coordinator for the job at this etcd URL (the job's URL as its head "
                        "prints it, etcd://HOST:PORT[,...]/phoenixft/RUN_ID): it takes over if the leader dies, "
                        "also when the head's host is lost; the job's flags come from etcd (other flags are ignored, "
                        "but --tls-cert/--tls-key/--tls-ca, for an etcd that requires client certificates)")
    p.add_argument("--port", type=int, default=29500, metavar="P", help="port to serve on (default 29500; 0 = any)")
    p.add_argument("--token", default="", help="the job token (default: $PHOENIXFT_TOKEN; else one is generated "
                                               "and printed); prefer the environment: a flag shows in `ps`")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="read the job token from the first line of PATH (mode 0600, yours): unlike --token it "
                        "does not show in `ps`")
    p.add_argument("--stop-signal", dest="stop_signal", default="", metavar="SIG[,SIG]",
                   help="signals that mean every node of the job goes (a scheduler's time limit or preemption, e.g. "
                        "SIGUSR1 from Slurm's --signal=B:USR1@120): the job stops at the next step boundary with that "
                        "step saved to --persist-dir, and this command exits 75 (resume with --resume); needs "
                        "--persist-every (default: none). With --persist-every, SIGTERM (Slurm's scancel or time "
                        "limit: no notice, SIGKILL after KillWait) stops the job so too, within 25 s")
    add_run_arguments(p, exclude=_LOCAL_ONLY)
    p.set_defaults(func=coordinator)


def coordinator(args: argparse.Namespace) -> int:
    from phoenixft.errors import UserError

    if args.standby:
        from phoenixft.controlplane.tls import TlsFiles

        files = TlsFiles.given(args.tls_cert, args.tls_key, args.tls_ca)
        if files is not None:  # the cluster over HTTPS with this host's certificate (its clients read the environment)
            import os

            os.environ.update(files.env())
        return standby(args.standby, args.token, args.token_file)
    if not args.host:
        raise UserError("--host is required: the address to serve on (or --standby ETCD_URL for a standby "
                        "coordinator)")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port={args.port} is invalid: must be in 0..65535 (0 = any free port)")
    # the run's own values first, checked before anything imports torch; a --token first of all (it is scrubbed
    # from the command line as it is checked)
    cfg = None if args.token else config_from_args(args)
    from phoenixft.controlplane import auth
    from phoenixft.runtime.exitcode import command_exit
    from phoenixft.runtime.launcher import run_job
    from phoenixft.runtime.stopsignal import parse_stop_signals

    token = auth.resolve_token(args.token, args.token_file)
    if token:
        auth.check_token(token, auth.token_source(args.token, args.token_file))
    cfg = cfg or config_from_args(args)
    stop_signals = parse_stop_signals(args.stop_signal)
    report = run_job(cfg, host=args.host, port=args.port, token=token, local=False, stop_signals=stop_signals)
    return command_exit(report)  # (0 done, 75 stopped with its state saved, 130 interrupted, else 1: exitcode.py)


def standby(url: str, token_flag: str, token_file: str = "") -> int:
    """A standby coordinator on this host for the job at `url` (a replicated store's URL): it
    campaigns for the leadership and, once it leads, carries the job on from the store's state; it
    ends with the run."""
    import os

    from phoenixft.controlplane import auth, connect, describe, keys
    from phoenixft.errors import UserError

    try:
        prefix = describe(url).job_prefix()
    except ValueError as e:
        raise UserError(f"--standby={url!r} is invalid: {e}") from None
    if not prefix:
        raise UserError(f"--standby={url!r} is invalid: it must name the job (etcd://HOST:PORT/phoenixft/RUN_ID, "
                        "as the head prints it)")
    token = auth.resolve_token(token_flag, token_file)
    if not token:
        raise UserError(f"--standby needs the job token (--token-file, --token or ${auth.TOKEN_ENV}): it verifies "
                        "and signs what it publishes")
    source = auth.token_source(token_flag, token_file)
    auth.check_token(token, source)
    try:
        store = connect(url, 10.0, token=token)
        found = store.check([keys.CONFIG])
    except Exception as e:  # noqa: BLE001 - StoreUnavailable, StoreError, OSError
        raise UserError(f"--standby={url}: etcd is not reachable there ({str(e).splitlines()[0][:160]})") from None
    if not found:
        raise UserError(f"--standby={url}: no phoenixft job there (no config under that prefix; use the URL the "
                        "head prints)")
    if store.check([keys.RUN_STATE]):
        from phoenixft.controlplane.values import clean

        raise UserError(f"--standby={url}: that job has ended ({clean(store.get(keys.RUN_STATE), 80)})")
    try:
        matches = auth.token_matches_job(store, token)
    except Exception as e:  # noqa: BLE001 - StoreUnavailable, StoreError, OSError
        raise UserError(f"--standby={url}: etcd is not reachable there ({str(e).splitlines()[0][:160]})") from None
    if matches is None:
        raise UserError(f"--standby={url}: the job there has nothing signed to check the job token ({source}) on "
                        "(its head is an older phoenixft): refusing to stand by unverified")
    if not matches:
        raise UserError(f"{source} is not this job's token: the config of the job at {url} is not signed with it "
                        "(a standby with another token would publish topologies that no worker accepts)")
    os.environ[auth.TOKEN_ENV] = token
    from phoenixft.coordinator import main as coordinator_main

    return coordinator_main(["--store", url, "--announce", f"phoenixft coordinator: standing by for the job at "
                             f"{url} (takes over if the leader dies)"])
