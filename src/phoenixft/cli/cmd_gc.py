"""`phoenixft gc [--dry-run]`: remove shared memory that dead runs left on this machine.

A run's segments (`/dev/shm/phoenixft-<run>-*`) are removed when no process of the run is alive:
no owner in its record (`/dev/shm/phoenixft-<run>.owner`, PIDs with their start times) runs, and
no process names the run id on its command line. A live run's segments are never touched. Prints
how many segments and bytes were freed (or, with `--dry-run`, would be). The work is done by
`phoenixft.protect.shm.sweep`.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "gc"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        help="remove shared memory (/dev/shm) left by runs that are no longer alive",
        description="Remove /dev/shm/phoenixft-<run>-* segments of runs that no live process owns "
        "(owner PIDs and their start times are checked, so a reused PID does not count). "
        "Segments of live runs are never touched.",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.set_defaults(func=gc)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def gc(args: argparse.Namespace) -> int:
    from phoenixft.protect.shm import sweep

    res = sweep(dry_run=args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    runs = f" of {len(res.runs)} dead run(s): {', '.join(res.runs)}" if res.runs else ""
    print(f"phoenixft gc: {verb} {res.segments} segment(s), {res.bytes} bytes ({_mib(res.bytes)}){runs}; "
          f"{len(res.live_runs)} live run(s) left alone")
    for e in res.errors:
        print(f"phoenixft gc: could not remove {e}", file=sys.stderr)
    return 1 if res.errors else 0
