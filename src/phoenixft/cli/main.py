"""Entry point of the `phoenixft` command: dispatches to the subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, cast

from phoenixft.errors import UserError

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the flag, the value and why (argparse's own message), and where the valid
    values are; not the usage block (for `run`, some 30 lines above the one that matters). Every subcommand's
    parser is one of these (add_subparsers makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (valid flags and values: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from phoenixft import __version__
    from phoenixft.cli import (
        cmd_agent,
        cmd_certs,
        cmd_chaos,
        cmd_coordinator,
        cmd_demo,
        cmd_drain,
        cmd_gc,
        cmd_prepare_data,
        cmd_report,
        cmd_run,
        cmd_status,
    )

    ap = _Parser(prog="phoenixft", description="Keep PyTorch training alive through node failures.")
    ap.add_argument("--version", action="version", version=f"phoenixft {__version__}")
    # (its parsers are _Parsers: add_subparsers makes them of the parent's class)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               ap.add_subparsers(dest="command", metavar="COMMAND", required=True))
    cmd_run.add_parser(sub)
    cmd_chaos.add_parser(sub)
    cmd_demo.add_parser(sub)
    cmd_report.add_parser(sub)
    cmd_status.add_parser(sub)
    cmd_drain.add_parser(sub)
    cmd_prepare_data.add_parser(sub)
    cmd_agent.add_parser(sub)
    cmd_coordinator.add_parser(sub)
    cmd_gc.add_parser(sub)
    cmd_certs.add_parser(sub)
    from phoenixft.observe import export
    export.add_parser(sub)
    try:
        from phoenixft.sim.cli import add_parser as add_sim
    except ImportError:
        pass
    else:
        add_sim(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:  # (Ctrl-C while the subcommand's modules load, e.g. torch: exit 130 like later, not a traceback)
        ap = build_parser()
        args = ap.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    try:
        return int(args.func(args))
    except UserError as e:
        if e.detail:  # (the traceback of the user's own code that failed)
            print(e.detail, file=sys.stderr)
        print(f"phoenixft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
