"""The run flags of `phoenixft run`, `coordinator` and `chaos`: one argparse group per config section,
one flag per field, parsed into a RunConfig."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any

from phoenixft.config.options import add_section_arguments
from phoenixft.config.run import SECTIONS, RunConfig, run_fields

__all__ = ["add_run_arguments", "config_from_args"]


def add_run_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                      exclude: Collection[str] = ()) -> None:
    """Add one flag per RunConfig field (except `exclude`), grouped by section; the field's help text
    becomes its --help line, `defaults` override the fields' own defaults."""
    for _, section, title in SECTIONS:
        add_section_arguments(parser.add_argument_group(title), section, defaults or {}, exclude)


def config_from_args(args: argparse.Namespace, validate: bool = True) -> RunConfig:
    """The RunConfig of parsed flags, validated unless `validate` is False (the caller then checks its own
    requirements first and calls `validate()` itself)."""
    given = {f.name: getattr(args, f.name) for f in run_fields() if hasattr(args, f.name)}
    if isinstance(given.get("workload"), str):  # a file's path absolute: the workers find the same file
        from phoenixft.config.training import absolute_workload

        given["workload"] = absolute_workload(given["workload"])
    cfg = RunConfig(**given)
    if validate:
        cfg.validate()
    return cfg
