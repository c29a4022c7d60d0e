"""The output section: the run directory, the JSON report, and what is printed while the run goes."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import check_output_file, unwritable
from phoenixft.config.options import option
from phoenixft.errors import UserError

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
    tensorboard: str = option("", "Write TensorBoard event files to this directory as the run goes (loss, lr, "
                              "grad norm, step time, goodput and badput, recoveries); needs "
                              "`pip install 'phoenixft[metrics]'`.")
    metrics_port: int = option(-1, "Serve Prometheus metrics on this port of --metrics-host while the run goes "
                               "(/metrics: steps, recoveries by class, goodput and badput, per-node step and "
                               "compute time; unauthenticated: whoever reaches it reads them); 0 picks a free port "
                               "(printed, and in RUN_DIR/metrics.port); -1: none. Needs "
                               "`pip install 'phoenixft[metrics]'`.", flag="--metrics-port")
    metrics_host: str = option("127.0.0.1", "The address --metrics-port listens on: this host's loopback unless "
                               "you name another (e.g. the head's address, for a Prometheus server elsewhere).",
                               flag="--metrics-host")


def validate_output(cfg: RunConfig) -> None:
    """The report can be written once the run is over, the TensorBoard directory can be written, the
    metrics port is one (checked before anything starts)."""
    check_output_file("--report", cfg.output.report)
    out = cfg.output
    if out.tensorboard:
        if os.path.exists(out.tensorboard) and not os.path.isdir(out.tensorboard):
            raise UserError(f"--tensorboard={out.tensorboard!r} is invalid: it is a file; give a directory")
        why = unwritable(out.tensorboard)
        if why is not None:
            raise UserError(f"--tensorboard={out.tensorboard!r} is invalid: cannot write there ({why})")
    if not -1 <= out.metrics_port <= 65535:
        raise UserError(f"--metrics-port={out.metrics_port} is invalid: a TCP port is 0..65535 (0: any free one; "
                        "-1: none)")
    for flag, given, module in (("--tensorboard", bool(out.tensorboard), "tensorboard"),
                                ("--metrics-port", out.metrics_port >= 0, "prometheus_client")):
        if given and importlib.util.find_spec(module) is None:
            raise UserError(f"{flag} needs the {module!r} package, which is not installed: "
                            "pip install 'phoenixft[metrics]'")
