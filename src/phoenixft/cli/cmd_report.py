"""`phoenixft report RUN_DIR [--reference REF_RUN_DIR] [--out FILE]`: one self-contained HTML report.

Writes RUN_DIR/report.html by default (plots embedded; opens with no network) and prints its path.
The work is done by `phoenixft.observe.html_report.write_report`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "report"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="write one self-contained HTML report of a finished run",
        description="Write one HTML file (no network needed to open it) with throughput over time, "
        "faults and recovery intervals, the loss curve (over a failure-free reference "
        "run's), the recovery-time breakdown per fault, a summary and the tables of "
        "recoveries and events.",
    )
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="run directory written by `phoenixft run` (holds report.json)"
    )
    p.add_argument(
        "--reference",
        metavar="REF_RUN_DIR",
        default=None,
        help="run directory of a failure-free run of the same job: its loss is drawn under this one's",
    )
    p.add_argument(
        "--out", metavar="FILE", default=None, help="where to write the HTML (default RUN_DIR/report.html)"
    )
    p.set_defaults(func=report)


def report(args: argparse.Namespace) -> int:
    from phoenixft.observe.html_report import write_report

    path = write_report(
        Path(args.run_dir),
        reference=Path(args.reference) if args.reference else None,
        out=Path(args.out) if args.out else None,
    )
    print(path)
    from phoenixft.observe.goodput import summary_line
    from phoenixft.observe.html_report import load_run, run_goodput

    print(summary_line(run_goodput(load_run(Path(args.run_dir)))), file=sys.stderr)  # (stdout: the path alone)
    return 0
