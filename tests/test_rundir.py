"""`--run-dir`: a directory another run used is taken over (its files replaced), a live run's is
refused, one that cannot be created is one line (phoenixft.runtime.rundir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run

from phoenixft.errors import UserError
from phoenixft.runtime import rundir
from phoenixft.runtime.procs import cmdlines


def _old_run(d: Path) -> None:
    (d / "logs").mkdir(parents=True)
    (d / "final").mkdir()
    (d / "final" / "model.safetensors").write_bytes(b"x")
    (d / "logs" / "n0.log").write_text("old\n")
    (d / rundir.JOURNAL).write_text('{"topo": {}}\n')
    (d / "report.json").write_text(json.dumps({"run_id": "0123456789"}))
    (d / "keep.txt").write_text("the user's")


def test_new_directory_is_created(tmp_path: Path) -> None:
    assert rundir.prepare(tmp_path / "a" / "b") is None
    assert (tmp_path / "a" / "b" / "logs").is_dir()


def test_previous_runs_files_are_replaced(tmp_path: Path) -> None:
    _old_run(tmp_path)
    note = rundir.prepare(tmp_path)
    assert note is not None and "0123456789" in note
    assert not (tmp_path / rundir.JOURNAL).exists() and not (tmp_path / "report.json").exists()
    assert not (tmp_path / "final").exists() and list((tmp_path / "logs").iterdir()) == []
    assert (tmp_path / "keep.txt").read_text() == "the user's"  # only a run's own files go


def test_live_runs_directory_is_refused(tmp_path: Path) -> None:
    _old_run(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", rundir.journal_path(tmp_path)],
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 30  # until it has exec'd (before, /proc shows the parent's command line)
        while rundir.journal_path(tmp_path) not in cmdlines().get(p.pid, []):
            assert time.monotonic() < deadline, "the stand-in process never started"
            time.sleep(0.02)
        with pytest.raises(UserError, match="still alive"):
            rundir.prepare(tmp_path)
        assert (tmp_path / rundir.JOURNAL).exists()  # nothing of the live run was touched
    finally:
        os.killpg(p.pid, 9)
        p.wait(timeout=10)


def test_uncreatable_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"--run-dir .*file/x: cannot create it"):
        rundir.prepare(tmp_path / "file" / "x")
    p = subprocess.run([sys.executable, "-m", "phoenixft", "run", "--run-dir", str(tmp_path / "file" / "x"),
                        "--steps", "1", "--quiet"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src")))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "cannot create it" in p.stderr, p.stderr[-2000:]


def test_a_run_directory_can_be_used_again(tmp_path: Path) -> None:
    """The second run in the same directory starts afresh: it must not load the first's coordinator journal
    and refuse every node ("the job has started")."""
    a = run(tmp_path, nodes=2, spares=0, protect="none", steps=2)
    b = run(tmp_path, nodes=2, spares=0, protect="none", steps=2)
    assert a["state"] == b["state"] == "done", b.get("error")
    assert a["run_id"] != b["run_id"]
    assert json.loads((tmp_path / "report.json").read_text())["run_id"] == b["run_id"]


def test_a_directory_taken_by_a_run_that_is_starting_is_refused(tmp_path: Path) -> None:
    """Two runs started at once with one --run-dir: neither's coordinator is up yet when the other looks,
    so without a lock both would take the directory, write one journal, append to the same logs and
    overwrite each other's report. The first launcher holds the directory (a lock, from its start to its report)."""
    from phoenixft.config import RunConfig
    from phoenixft.runtime.launcher import LocalJob

    cfg = RunConfig(nodes=2, spares=0, steps=1, device="cpu", run_dir=str(tmp_path / "r"), quiet=True)
    first = LocalJob(cfg)  # (its processes not started yet: what a second launcher started at the same moment sees)
    try:
        with pytest.raises(UserError, match=r"--run-dir .*r: another run that is still alive uses it"):
            LocalJob(cfg)
    finally:
        rundir.release(first.dir_lock)
    again = LocalJob(cfg)  # once the first run has ended, the directory is free
    rundir.release(again.dir_lock)


def test_a_directory_with_the_users_own_files_is_never_cleared(tmp_path: Path) -> None:
    """`--run-dir` naming a project directory that holds its own config.json (or metrics.jsonl, logs/*.log,
    final/) must keep them: they are not replaced as "the files of the run that used it before" (there was
    none). Only a phoenixft run's files are replaced; anything else is refused with one line, and the
    refused run leaves nothing there."""
    from phoenixft.config import RunConfig
    from phoenixft.runtime.launcher import LocalJob

    (tmp_path / "logs").mkdir()
    (tmp_path / "final").mkdir()
    mine = {"config.json": '{"lr": 0.1}', "metrics.jsonl": "{}\n", "logs/train.log": "epoch 1\n",
            "final/weights.bin": "w"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match=r"--run-dir .*: it holds files that no phoenixft run wrote \(config.json"):
        rundir.prepare(tmp_path)
    cfg = RunConfig(nodes=2, spares=0, steps=1, device="cpu", run_dir=str(tmp_path), quiet=True)
    with pytest.raises(UserError, match="no phoenixft run wrote"):
        LocalJob(cfg)
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()} == set(mine)
    assert all((tmp_path / n).read_text() == t for n, t in mine.items())
    # a run's own config.json (an etcd run has no journal here) is recognised as a run's
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(RunConfig(nodes=2).to_json())
    assert rundir.prepare(other) is not None and not (other / "config.json").exists()
