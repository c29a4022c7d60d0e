"""RunConfig.validate(): bad flags are one line naming the flag, the value and what would be valid."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from conftest import run

from phoenixft.cli.main import main
from phoenixft.config import RunConfig, run_fields
from phoenixft.errors import UserError

FLOATS = [f for f in run_fields() if str(f.type) == "float"]


def _flag(f: dataclasses.Field) -> str:
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def _refused(needle: str, **kw: object) -> str:
    with pytest.raises(UserError) as e:
        RunConfig(**kw).validate()
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    return msg


def test_every_float_flag_is_checked() -> None:
    assert {f.name for f in FLOATS} >= {"lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "momentum",
                                        "clip_grad_norm", "repair_after", "join_timeout", "failure_timeout",
                                        "chunk_mb", "bucket_mb", "timeout"}
    RunConfig().validate()  # the defaults are valid


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_non_finite_float_flags_are_refused(f: dataclasses.Field, value: float) -> None:
    _refused(f"{_flag(f)}={value!r} is invalid: must be a finite number", **{f.name: value})


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_non_finite_lr_from_the_command_line_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--dry-run", "--nodes", "2", "--lr", value]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"--lr={value} is invalid: must be a finite number > 0" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("late", [-1, 8, 99])
def test_spare_arrives_at_step_out_of_range(late: int) -> None:
    msg = _refused(f"--spare-arrives-at-step={late} is invalid: must be 0 (never) or a step in 1..7", steps=8,
                   spare_arrives_at_step=late)
    assert "--steps 8" in msg


@pytest.mark.parametrize("late", [0, 1, 7])
def test_spare_arrives_at_step_in_range(late: int) -> None:
    RunConfig(steps=8, spare_arrives_at_step=late).validate()


def test_spare_arrives_at_step_of_a_one_step_run() -> None:
    _refused("--spare-arrives-at-step=1 is invalid: must be 0 (never):", steps=1, spare_arrives_at_step=1)


# ------------------------------------------------------------------ --resume with another optimizer
def _manifest(root: Path, step: int, rows: int, optimizer: str | None) -> None:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    man = {"step": step, "shards": 2, "shard_numel": 1, "rows": rows,
           "config": {"optimizer": optimizer} if optimizer else None}
    (d / "MANIFEST.json").write_text(json.dumps(man))


def test_resume_refuses_an_optimizer_with_other_state_rows(tmp_path: Path) -> None:
    _manifest(tmp_path, 4, 2, "sgd")
    msg = _refused(f"--optimizer='adamw' is invalid with --resume={tmp_path}: its checkpoint of step 4 was written "
                   "with --optimizer sgd, 2 state rows (param, momentum_buffer); adamw keeps 3 rows (param, exp_avg, "
                   "exp_avg_sq); resume it with --optimizer sgd or lion", steps=8, resume=str(tmp_path))
    assert msg.count("\n") == 0
    RunConfig(steps=8, resume=str(tmp_path), optimizer="lion").validate()  # the same rows: loads


def test_resume_without_the_writers_config_still_names_the_rows(tmp_path: Path) -> None:
    _manifest(tmp_path, 4, 3, None)
    _refused("--optimizer='sgd' is invalid with --resume=", steps=8, resume=str(tmp_path), optimizer="sgd")
    msg = _refused("written with 3 state rows; sgd keeps 2 rows", steps=8, resume=str(tmp_path), optimizer="sgd")
    assert "resume it with --optimizer adamw or adam" in msg


@pytest.fixture(scope="module")
def adamw_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of step 4, written by --optimizer adamw (the default), of the suite's `nano` model."""
    tmp = tmp_path_factory.mktemp("adamw")
    rep = run(tmp / "run", nodes=2, spares=0, steps=4, persist_every=4, persist_dir=str(tmp / "ckpt"))
    assert rep["state"] == "done", rep.get("error")
    return tmp / "ckpt"


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_resume_of_a_real_checkpoint_with_another_optimizer_is_refused_up_front(
        adamw_checkpoint: Path, optimizer: str, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(f"--optimizer={optimizer!r} is invalid with --resume={adamw_checkpoint}: its checkpoint of step 4 was "
             "written with --optimizer adamw, 3 state rows (param, exp_avg, exp_avg_sq)", nodes=2, spares=0, steps=8,
             resume=str(adamw_checkpoint), optimizer=optimizer, model="nano")
    assert main(["run", "--dry-run", "--nodes", "2", "--spares", "0", "--steps", "8", "--model", "nano", "--resume",
                 str(adamw_checkpoint), "--optimizer", optimizer]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "resume it with --optimizer adamw or adam" in lines[0], lines


@pytest.mark.parametrize("kw", [dict(optimizer="adamw"), dict(optimizer="adam"),
                                dict(optimizer="adamw", precision="bf16")], ids=["adamw", "adam", "adamw-bf16"])
def test_resume_of_a_real_checkpoint_with_the_same_state_rows_is_valid(adamw_checkpoint: Path,
                                                                        kw: dict[str, str]) -> None:
    RunConfig(nodes=2, spares=0, steps=8, resume=str(adamw_checkpoint), model="nano", **kw).validate()


def test_one_node_per_replica_ring_says_what_would_work() -> None:
    """The advice names a value the flag accepts (not "need replicas < 1", which --replicas 0 refuses too)."""
    msg = _refused("give --nodes >= 2 or --protect none", nodes=1)
    assert "replicas < 1" not in msg
    _refused("give --nodes >= 4 (2 or more per pipeline stage) or --protect none", nodes=2, pp=2, workers_per_node=2)
    _refused("need replicas < 3", nodes=3, replicas=3)
    RunConfig(nodes=1, protect="none").validate()


def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--report into a directory, or under a file, is found before the run, in one line, nothing started (not
    after the whole run as a traceback, the run's own report.json written and the one asked for not)."""
    (tmp_path / "afile").write_text("")
    for bad, why in ((tmp_path, "it is a directory"), (tmp_path / "afile" / "r.json", "afile is not a directory")):
        with pytest.raises(UserError, match=f"--report='{bad}' is invalid: .*{why}"):
            RunConfig(nodes=2, report=str(bad)).validate()
        for cmd in (["run", "--nodes", "2", "--report", str(bad), "--run-dir", str(tmp_path / "r")],
                    ["chaos", "--nodes", "2", "--report", str(bad), "--run-dir", str(tmp_path / "c")]):
            assert main(cmd) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"--report='{bad}' is invalid" in err[0], err
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()  # nothing started
    RunConfig(nodes=2, report=str(tmp_path / "new" / "r.json")).validate()  # created at the end: fine


@pytest.mark.parametrize("value", [1e20, 357913.0])
def test_a_failure_timeout_too_large_for_the_collectives_is_refused(value: float) -> None:
    """--failure-timeout 1e20 was accepted, then every epoch failed to build its process groups (OverflowError:
    the collectives wait 6x it, in milliseconds gloo keeps in an int): 13 spurious recoveries, a failed run."""
    _refused(f"--failure-timeout={value!r} is invalid: must be a finite number > 0 and at most 86400 seconds",
             failure_timeout=value)
    RunConfig(failure_timeout=86400.0).validate()


@pytest.mark.parametrize("value", [-1, 1025, 100_000_000])
def test_threads_out_of_range_are_refused(value: int) -> None:
    """--threads 100000000 was accepted (every worker would have asked torch for that many threads)."""
    _refused(f"--threads={value!r} is invalid: must be 0 (cores / active workers) to 1024", threads=value)
    RunConfig(threads=1024).validate()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodes": 99_999_999_999}, "--nodes=99999999999 is invalid: must be at most 1,048,576"),
        ({"workers_per_node": 10**11}, "--workers-per-node=100000000000 is invalid: must be at most 1,048,576"),
        ({"spares": 2**21}, "--spares=2097152 is invalid: must be at most 1,048,576"),
        ({"nodes": 500_000, "workers_per_node": 8},
         "--nodes=500000 is invalid: (--nodes + --spares) x --workers-per-node must be at most 1,048,576 workers"),
    ],
)
def test_a_job_beyond_a_million_workers_is_refused(fields: dict[str, int], message: str) -> None:
    """`run --nodes 99999999999 --dry-run` ended in a MemoryError traceback (it built the node list)."""
    _refused(message, **fields)
    RunConfig(nodes=131_071, workers_per_node=8, spares=1).validate()
