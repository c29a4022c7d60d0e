"""The output section: the run directory, the JSON report, and what is printed while the run goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import check_output_file
from phoenixft.config.options import option

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["OutputConfig", "validate_output"]


@dataclass(kw_only=True)
class OutputConfig:
    """Where a run writes what it did, and how it shows it live."""

    report: str = option("", "Write the JSON report to this path.")
    run_dir: str = option("", "Run directory for events.jsonl, metrics.jsonl and report.json (default: runs/<id>).",
                          flag="--run-dir")
    quiet: bool = option(False, "No live progress display (log lines only).", action="store_true")
    json_events: bool = option(False, "Print every event as one JSON line on stdout.", flag="--json-events",
                               action="store_true")


def validate_output(cfg: RunConfig) -> None:
    """The report can be written once the run is over (checked before anything starts)."""
    check_output_file("--report", cfg.output.report)
