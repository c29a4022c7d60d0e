"""Every subcommand's --help renders (argparse formats help texts with %, so a bare % in a field's
help used to crash `phoenixft run --help`)."""

from __future__ import annotations

import contextlib
import io

import pytest

from phoenixft.cli.main import build_parser

COMMANDS = ["run", "chaos", "demo", "report", "status", "prepare-data", "agent", "coordinator", "gc", "export",
            "simulate"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_renders(command: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0
    assert "usage:" in out.getvalue()
    if command == "run":
        assert "last 20%)" in out.getvalue() and "--tp" in out.getvalue() and "--redundancy" in out.getvalue()
