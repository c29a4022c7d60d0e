"""Entry point of the `phoenixft` command: dispatches to the subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, cast

from phoenixft.errors import UserError

__all__ = ["main", "build_parser", "CONFIG_COMMANDS"]

CONFIG_COMMANDS = ("run", "launch", "coordinator", "chaos", "agent")  # the commands that read --config FILE


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
        cmd_launch,
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
    cmd_launch.add_parser(sub)
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
    from phoenixft.config.tomlfile import add_config_arguments

    for name in CONFIG_COMMANDS:  # (--config FILE, --print-config)
        add_config_arguments(sub.choices[name])
    from phoenixft.observe import export
    export.add_parser(sub)
    try:
        from phoenixft.sim.cli import add_parser as add_sim
    except ImportError:
        pass
    else:
        add_sim(sub)
    return ap


def _subparser(ap: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return cast("argparse.ArgumentParser", sub.choices[command])


def _config_given(ap: argparse.ArgumentParser, argv: list[str]) -> tuple[str, str] | None:
    """(command, path) when `argv` runs a command that reads --config and gives one (found before parsing: the
    file may hold the flags the command requires). `launch`'s flags end at the script: what follows is the
    script's own (its --config is not ours)."""
    if not argv or argv[0] not in CONFIG_COMMANDS:
        return None
    flags = _subparser(ap, argv[0])._option_string_actions
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--" or argv[0] == "launch" and not a.startswith("-"):
            break
        if a == "--config" and i + 1 < len(argv):
            return argv[0], argv[i + 1]
        if a.startswith("--config="):
            return argv[0], a.split("=", 1)[1]
        act = flags.get(a)
        i += 2 if act is not None and act.nargs != 0 else 1  # (a flag's value is never the script)
    return None


def _error(command: str, e: UserError) -> int:
    if e.detail:  # (the traceback of the user's own code that failed)
        print(e.detail, file=sys.stderr)
    print(f"phoenixft {command}: error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # (Ctrl-C while the subcommand's modules load, e.g. torch: exit 130 like later, not a traceback)
        ap = build_parser()
        given = _config_given(ap, argv)
        if given is not None:  # the file's values become the command's defaults; the command line overrides them
            from phoenixft.config.tomlfile import use_config_file

            try:
                lists = use_config_file(_subparser(ap, given[0]), given[0], given[1])
            except UserError as e:
                return _error(given[0], e)
        args = ap.parse_args(argv)
        if given is not None:
            for dest, value in lists.items():  # (a repeatable flag given on the command line replaces the file's)
                if getattr(args, dest, None) is None:
                    setattr(args, dest, value)
    except KeyboardInterrupt:
        return 130
    try:
        if getattr(args, "print_config", False):
            from phoenixft.config.tomlfile import print_config

            print(print_config(_subparser(ap, args.command), args.command, args), end="")
            return 0
        return int(args.func(args))
    except UserError as e:
        return _error(args.command, e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
