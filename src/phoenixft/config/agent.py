"""The flags of `phoenixft agent`, a node agent joining a job's coordinator.

Defined here once: `phoenixft agent` (`phoenixft.cli.cmd_agent`) and the agent process itself
(`python -m phoenixft.runtime.agent`, as the launcher starts it, which adds its own `--parent-pid`)
parse the same flags with the same help.
"""

from __future__ import annotations

import argparse

__all__ = ["add_agent_arguments"]


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The agent's flags on `p`."""
    p.add_argument("--coordinator", "--store", dest="store", required=True, metavar="HOST:PORT",
                   help="the job's coordinator (its control-plane store); --store is the old name")
    p.add_argument("--node", required=True, metavar="NAME",
                   help="this node's name (any name; n<i> or s<k> asks for exactly that node id)")
    p.add_argument("--spare", action="store_true", help="join as a warm spare, promoted when a node fails")
    p.add_argument("--workers", type=int, default=1, help="workers on this node (must match --workers-per-node)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--token", default="", help="the job token (default: $PHOENIXFT_TOKEN); prefer the "
                                               "environment: a flag shows in `ps`")
    p.add_argument("--token-file", dest="token_file", default="", metavar="PATH",
                   help="read the job token from the first line of PATH (mode 0600, yours): not shown in `ps`")
    p.add_argument("--host", default="", metavar="ADDR",
                   help="this host's address for the data plane (default: the one it reaches the coordinator from)")
    p.add_argument("--run-id", default="", help="check that the coordinator runs this run id")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the store to answer at start, then fail with one line (10)")
    p.add_argument("--join-timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the coordinator to admit it (120)")
    p.add_argument("--control-plane-timeout", type=float, default=15.0, metavar="S",
                   help="stop the node and free its shared memory after S seconds without the store (15)")
    p.add_argument("--tls-cert", dest="tls_cert", default="", metavar="PATH",
                   help="this host's TLS certificate (signed by --tls-ca): reach a coordinator started with TLS "
                        "through a mutually authenticated channel (and etcd over HTTPS)")
    p.add_argument("--tls-key", dest="tls_key", default="", metavar="PATH", help="the key of --tls-cert (mode 0600)")
    p.add_argument("--tls-ca", dest="tls_ca", default="", metavar="PATH", help="the job CA's certificate")
    p.add_argument("--drain-signal", default="SIGUSR1", metavar="SIG",
                   help="the signal that asks for this node to be drained: its role moves to a warm spare at the "
                        "next step boundary and the node leaves with nothing lost (SIGUSR1; e.g. what Slurm's "
                        "--signal=B:USR1@120 sends)")
    p.add_argument("--drain-on-sigterm", action="store_true",
                   help="treat SIGTERM as a drain notice too (Kubernetes: SIGTERM, then SIGKILL after the grace "
                        "period); a second SIGTERM still stops the node at once")
    p.set_defaults(parent_pid=0)  # (--parent-pid: the launcher's, added by phoenixft.runtime.agent)
