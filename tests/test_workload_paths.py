"""Where `--workload` finds the user's code: `path/to/file.py:function`, a module in the current directory (what
`python -m` would find), and a module that cannot be imported said in one line that names where it was looked
for and how to fix it. `--model` is free-form with a workload of the user's own, and the reports name it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from phoenixft.cli.main import main

WORKLOAD = '''
import torch
from phoenixft import Workload, WorkloadContext
from {helper} import WIDTH   # a module beside it: found as `python file.py` would find it


def workload(ctx: WorkloadContext) -> Workload:
    assert ctx.model == "{model}", ctx.model  # --model reaches the workload as given
    w_true = torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(99))

    def batch(step, index):
        g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 1009 + index)
        x = torch.randn(ctx.micro_batch, WIDTH, generator=g)
        return x, x @ w_true

    return Workload(build_model=lambda: torch.nn.Linear(WIDTH, 1),
                    loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), batch=batch)
'''


def _project(tmp: Path, model: str) -> tuple[str, Path]:
    """A project with its workload in sub/NAME.py (NAME unique: this process imports each once)."""
    name = f"wl_{uuid.uuid4().hex[:8]}"
    sub = tmp / "sub"
    sub.mkdir()
    (sub / f"{name}_helper.py").write_text("WIDTH = 8\n")
    (sub / f"{name}.py").write_text(WORKLOAD.format(helper=f"{name}_helper", model=model))
    return name, sub


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["run", "--quiet", "--nodes", "2", "--spares", "0", "--steps", "2", "--micro-batch", "2", *args])
    return rc, capsys.readouterr().err


def test_a_file_path_and_a_module_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    name, sub = _project(tmp_path, "cnn-v2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/nonexistent")  # (conftest sets one for the suite's own workloads)
    # a module that is not importable from here: where it was looked for, and the file that was found below
    rc, err = _run(capsys, "--workload", f"{name}:workload", "--model", "cnn-v2", "--run-dir", str(tmp_path / "r0"))
    assert rc == 2, err
    assert err.strip().splitlines()[-1] == (
        f"phoenixft run: error: --workload='{name}:workload': no module named '{name}' (searched the current "
        f"directory ({tmp_path}), PYTHONPATH (/nonexistent) and the installed packages); found sub/{name}.py below the "
        f"current directory: give the file, --workload sub/{name}.py:workload, or put its directory on PYTHONPATH "
        "(PYTHONPATH=sub phoenixft ...)"), err
    # the module from its own directory (where `python -m` would find it)
    monkeypatch.chdir(sub)
    rc, err = _run(capsys, "--workload", f"{name}:workload", "--model", "cnn-v2", "--run-dir", str(tmp_path / "r2"))
    assert rc == 0, err
    by_module = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert by_module["state"] == "done" and by_module["config"]["workload"] == f"{name}:workload"
    monkeypatch.chdir(tmp_path)
    # the file, as the error suggests: it trains, its path made absolute in the config every process reads
    rc, err = _run(capsys, "--workload", f"sub/{name}.py:workload", "--model", "cnn-v2", "--run-dir",
                   str(tmp_path / "r1"))
    assert rc == 0, err
    rep = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert rep["state"] == "done" and rep["config"]["workload"] == f"{sub / name}.py:workload", rep["config"]
    from phoenixft.observe.html_report import write_report

    assert f"workload={sub / name}.py:workload, model=cnn-v2" in write_report(tmp_path / "r1").read_text()
    assert rep["final_state_sha256"] == by_module["final_state_sha256"]  # the same code, the same run


def test_workload_errors_say_what_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_dep.py").write_text("import no_such_package_here\n")
    cases = [
        (["--workload", "no_such_module_anywhere:workload"],
         "no module named 'no_such_module_anywhere' (searched the current directory"),
        (["--workload", "needs_dep:w"], "--workload='needs_dep:w' does not import: it imports "
                                        "'no_such_package_here', which is not installed or not on the path (at "
                                        f"{tmp_path}/needs_dep.py:1 in <module>"),
        (["--workload", "missing/file.py:w"], f"--workload='{tmp_path}/missing/file.py:w' is invalid: there is no "
                                              f"file {tmp_path}/missing/file.py"),
        (["--workload", "user_workload"], "expected 'pkg.module:function' or 'path/to/file.py:function'"),
        (["--workload", "user_workload:nope"], "has no function 'nope' (its functions: "),
        (["--model", "cnn"], "--model='cnn' is invalid: valid presets of the built-in GPT"),
    ]
    for args, needle in cases:
        rc, err = _run(capsys, *args, "--run-dir", str(tmp_path / "r"))
        assert rc == 2 and needle in err.strip().splitlines()[-1], (args, err)
        assert "Traceback (most recent call last)" not in err
