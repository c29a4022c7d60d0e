"""Every subcommand's --help renders (argparse formats help texts with %, so a bare % in a field's
help would crash `phoenixft run --help`)."""

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


BAD = [
    ["run", "--steps", "x"], ["run", "--bogus-flag"], ["chaos", "--faults", "many"], ["demo", "--nodes", "2.5"],
    ["report"], ["status"], ["status", "--coordinator", "h:1", "--timeout", "soon"], ["prepare-data"],
    ["agent", "--node", "x"], ["coordinator", "--port", "http"], ["gc", "--force"], ["export", "src"],
    ["export", "src", "--out", "m", "--step", "last"], ["simulate", "--bogus-flag"], ["nosuch"], [],
]


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a) or "(none)")
def test_a_bad_command_line_is_one_line(argv: list[str]) -> None:
    """argparse's own errors (a value of the wrong type, an unknown flag, a missing argument) came after the
    whole usage block (about 30 lines for `run`): one line now, naming the flag and the value, exit code 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    lines = err.getvalue().strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "error: " in lines[0], err.getvalue()


@pytest.mark.parametrize("argv, needle", [
    (["--threads", "0"], "--threads=0 is invalid"),
    (["--threads", "-1"], "--threads=-1 is invalid"),
    (["--threads", "5000"], "--threads=5000 is invalid: need 1 to 1024"),
    (["--workers", "99999999"], "--workers=99999999 is invalid: need 1 to 1,048,576"),
    (["--connect-timeout", "1e300"], r"--connect-timeout=1e\+300 is invalid: must be > 0 and at most 86400"),
    (["--join-timeout", "inf"], "--join-timeout=inf is invalid"),
    (["--control-plane-timeout", "nan"], "--control-plane-timeout=nan is invalid"),
])
def test_agent_threads_below_one_are_refused(argv: list[str], needle: str) -> None:
    """`phoenixft agent --threads 0` got past every check and only its workers failed, in their logs;
    `--connect-timeout 1e300` (or inf) made an agent that never gave up on a dead address."""
    from phoenixft.errors import UserError
    from phoenixft.runtime.agent import main

    with pytest.raises(UserError, match=needle):
        main(["--store", "127.0.0.1:1", "--node", "x", "--connect-timeout", "1", *argv])


def test_the_command_line_is_built_without_torch() -> None:
    """The parser took `import torch` (about 3 s here) through `phoenixft.observe.export`, so `phoenixft gc`,
    `status --help`, `simulate` and every bad command line paid for it (`phoenixft gc` took 5 s)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from phoenixft.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout[-500:] + p.stderr[-2000:]


def test_ctrl_c_while_the_command_loads_is_exit_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the first second (while torch loads) ended in a KeyboardInterrupt traceback."""
    import phoenixft.cli.main as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["gc"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while the command loaded escaped main(): a traceback")
    assert code == 130
