"""Failure-free training: the distributed optimizer is AdamW, runs are deterministic, user workloads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run

from phoenixft.data import _mix
from phoenixft.workload import WorkloadContext, load_workload


def single_process_losses(steps: int, microbatches: int, micro_batch: int = 8, seed: int = 1234,
                          model: str = "tiny") -> list[float]:
    """The same batches, one process, torch.optim.AdamW (the ground truth)."""
    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=seed, micro_batch=micro_batch, model=model))
    torch.manual_seed(seed)
    model = wl.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for s in range(1, steps + 1):
        opt.zero_grad()
        total = 0.0
        for mb in range(microbatches):
            torch.manual_seed(_mix(seed, s, mb))
            loss = wl.loss(model, wl.batch(s, mb))
            (loss / microbatches).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / microbatches)
    return losses


@pytest.mark.parametrize("nodes,workers", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)], ids=["dp2", "dp4"])
def test_distributed_optimizer_matches_torch_adamw(tmp_path: Path, reference, nodes: int, workers: int) -> None:  # type: ignore[no-untyped-def]
    rep = reference(nodes=nodes, workers_per_node=workers, steps=20)
    assert rep["state"] == "done"
    ref = single_process_losses(20, nodes * workers, micro_batch=rep["config"]["micro_batch"],
                                model=rep["config"]["model"])
    assert len(rep["loss"]) == 20
    for s, (a, b) in enumerate(zip(rep["loss"], ref, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: distributed {a} vs torch.optim.AdamW {b}"


def test_two_runs_same_hash_and_loss_falls(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    a = reference(nodes=2, workers_per_node=1, steps=20)
    b = run(tmp_path, nodes=2, steps=20, protect="none", spares=0)
    assert a["final_state_sha256"] and a["final_state_sha256"] == b["final_state_sha256"]
    assert a["loss"] == b["loss"]
    assert sum(a["loss"][-3:]) / 3 < sum(a["loss"][:3]) / 3 - 0.5
    assert a["step_time_s"]["median"] > 0


def test_user_workload_trains(tmp_path: Path) -> None:
    rep = run(tmp_path, nodes=2, spares=1, steps=15, workload="user_workload:workload", micro_batch=16,
              lr=1e-2, inject=["kill:node=1@step=8,phase=backward"])
    assert rep["state"] == "done", rep
    assert sum(rep["loss"][-3:]) < 0.75 * sum(rep["loss"][:3])
    assert rep["recoveries"] and rep["recoveries"][0]["action"] == "hotswap"
    clean = run(tmp_path / "clean", nodes=2, spares=0, steps=15, workload="user_workload:workload", micro_batch=16,
                lr=1e-2, protect="none")
    assert clean["final_state_sha256"] == rep["final_state_sha256"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "huge"], "--model='huge' is invalid: valid presets of the built-in GPT: nano, tiny, small, "
                              "medium"),
        (["--nodes", "0"], "--nodes=0 is invalid"),
        (["--nodes", "2", "--microbatches", "3"], "--microbatches=3 is invalid: must be a multiple"),
        (["--workload", "no_such_module:fn"], "--workload='no_such_module:fn': no module named 'no_such_module' "
                                              "(searched the current directory"),
        (["--inject", "kill:node=7@step=2"], "node must be in 0..1"),
        (["--inject", "kill:node=0@step=2,phase=lunch"],
         "valid phases: forward, backward, replicate, optimizer, recovery"),
        (["--protect", "magic"], "--protect='magic' is invalid: one of phoenix, none"),
        (["--inject", "crash:rank=0@step=2,phase=copy"], "--inject='crash:rank=0@step=2,phase=copy' is invalid: "
         "phase=copy is the moment a protected script's snapshot has committed its own side"),
        # asked for, silently never done (no val_loss anywhere): a workload without held-out batches
        (["--workload", "user_workload:workload", "--eval-every", "2"],
         "--eval-every=2 is invalid: --workload user_workload:workload has no held-out batches "
         "(Workload.eval_batch) to evaluate on: give it one, or --eval-every 0"),
        (["--workload", "user_workload:bad_factory"], "--workload='user_workload:bad_factory' failed to set up: "
         "FileNotFoundError: no such dataset (deliberate bug)"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.cli.main import main

    assert main(["run", "--nodes", "2", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert needle in lines[-1], err
    # one line, under the traceback of the user's own code where that raised (a workload's factory)
    assert len(lines) == 1 or lines[0].startswith("Traceback of the error in your code"), err
    assert "Traceback (most recent call last)" not in err


def test_bad_input_from_the_shell_exits_2() -> None:
    p = subprocess.run([sys.executable, "-m", "phoenixft", "run", "--model", "huge"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def _one_clear_line(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.cli.main import main

    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_unwritable_persist_dir_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    _one_clear_line(["run", "--nodes", "2", "--persist-every", "2", "--persist-dir", "/proc/x"],
                    "--persist-dir='/proc/x' is invalid: cannot create or write a file there", capsys)


def test_full_persist_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    full.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here: {e}")
    try:
        _one_clear_line(["run", "--nodes", "2", "--persist-every", "2", "--persist-dir", str(full)],
                        "free there, one checkpoint of --model tiny", capsys)
    finally:
        subprocess.run(["umount", str(full)], capture_output=True, timeout=30)


def test_resume_of_another_model_names_both_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ckpt" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "MANIFEST.json").write_text(json.dumps({"step": 4, "shards": 2, "numel": 812_288, "shard_numel": 406_144,
                                                  "epoch": 0, "seed": 1234}))
    _one_clear_line(["run", "--nodes", "2", "--model", "small", "--resume", str(tmp_path / "ckpt")],
                    f"--resume={tmp_path / 'ckpt'}: checkpoint has 812,288 parameters, --model small has ", capsys)


@pytest.mark.serial  # (a wall-clock bound on CPU-bound work: run alone, not beside another test)
def test_agent_without_a_store_fails_in_bounded_time() -> None:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "phoenixft", "agent", "--store", "127.0.0.1:1", "--node", "n9",
                        "--connect-timeout", "2"], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--store=127.0.0.1:1" in p.stderr and "--connect-timeout" in p.stderr and "Traceback" not in p.stderr
    assert took < 2 + 8, took  # the wait is bounded by the flag (plus interpreter start-up)
