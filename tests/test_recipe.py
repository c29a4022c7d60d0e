"""The training recipe under protection: schedules, clipping, bf16, optimizers, buffers, data, export.

Every option must keep the guarantee: a recovered run ends bitwise identical to the failure-free
run of the same configuration. And the numbers must be the ones torch computes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_hotswap, on_pythonpath, run
from safetensors.torch import load_file

from phoenixft.data import _mix
from phoenixft.optim import lr_at
from phoenixft.workload import WorkloadContext, load_workload

HERE = Path(__file__).parent

RECIPES = {
    "adamw-bf16-cosine-clip": {"optimizer": "adamw", "precision": "bf16", "lr_schedule": "cosine",
                               "warmup_steps": 4, "clip_grad_norm": 1.0},
    "sgd-nesterov-linear": {"optimizer": "sgd", "nesterov": True, "lr": 0.05, "lr_schedule": "linear",
                            "warmup_steps": 2, "clip_grad_norm": 0.5},
    "lion-bf16-wsd": {"optimizer": "lion", "precision": "bf16", "lr": 3e-4, "lr_schedule": "wsd",
                      "decay_steps": 4},
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_survives_a_node_kill_bitwise(tmp_path: Path, reference, name: str) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = RECIPES[name]
    ref = reference(nodes=2, steps=10, **kw)
    rep = run(tmp_path, nodes=2, spares=1, steps=10, inject=["kill:node=1@step=6,phase=optimizer"], **kw)
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["loss"] == ref["loss"]
    rec = assert_one_hotswap(rep, ["n1"], 6)
    want = _hotswap_bytes(kw, world=2, model=rep["config"]["model"])
    assert rec["bytes_moved"] == want, (rec["bytes_moved"], want)
    assert rec["decoded"] == [] and rec["bytes_decoded_from"] == 0 and rec["decode_s"] == 0.0  # replicas: no decode
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [lr_at(s, schedule=kw["lr_schedule"], lr=kw.get("lr", 1e-3), min_lr=0.0,
                         warmup=kw.get("warmup_steps", 0), decay=kw.get("decay_steps", 0), total=10)
                   for s in range(1, 11)]


def _hotswap_bytes(kw: dict[str, Any], world: int, model: str) -> int:
    """What a hot-swap of one rank of `world` moves, from the model's size alone: the whole parameter buffer
    in the training dtype to the spare, and the lost rank's optimizer shard in fp32 (its state tensors, and
    with bf16 its fp32 master weights as well). Shards are multiples of 64 elements."""
    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=1234, micro_batch=8, model=model))
    numel = sum(p.numel() for p in wl.build_model().parameters() if p.requires_grad)
    shard = -(-numel // (world * 64)) * 64
    bf16 = kw.get("precision") == "bf16"
    rows = {"adamw": 2, "sgd": 1, "lion": 1}[kw.get("optimizer", "adamw")] + bf16
    return shard * world * (2 if bf16 else 4) + rows * shard * 4


def test_clipping_and_schedule_match_torch(reference) -> None:  # type: ignore[no-untyped-def]
    """DP=2 with a cosine schedule and global-norm clipping against one process running
    torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ on the same batches."""
    steps, clip = 10, 0.3
    kw = {"lr_schedule": "cosine", "warmup_steps": 3, "clip_grad_norm": clip, "min_lr": 1e-4}
    rep = reference(nodes=2, steps=steps, **kw)
    metrics = [json.loads(x) for x in (Path(rep["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=1234, micro_batch=rep["config"]["micro_batch"],
                                                                 model=rep["config"]["model"], microbatches=2))
    torch.manual_seed(1234)
    model = wl.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(1, steps + 1):
        lr = lr_at(s, schedule="cosine", lr=1e-3, min_lr=1e-4, warmup=3, decay=0, total=steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for mb in range(2):
            torch.manual_seed(_mix(1234, s, mb))
            loss = wl.loss(model, wl.batch(s, mb))
            (loss / 2).backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        m = metrics[s - 1]
        assert m["lr"] == pytest.approx(lr, rel=1e-12)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-4), s
        assert m["loss"] == pytest.approx(total / 2, rel=1e-5), s
    assert any(m["grad_norm"] > clip for m in metrics)  # clipping was active
    assert rep["lr"] == [m["lr"] for m in metrics] and rep["grad_norm"] == [m["grad_norm"] for m in metrics]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_buffers_are_protected_restored_and_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """BatchNorm running statistics change every step and differ per rank before the broadcast:
    a hot-swap of rank 0 keeps them exact, and the export carries them."""
    monkeypatch.syspath_prepend(str(HERE))
    on_pythonpath(str(HERE), monkeypatch)
    kw: dict[str, Any] = {"workload": "user_workload:bn_workload", "micro_batch": 16, "lr": 1e-2, "steps": 10,
                          "nodes": 2, "eval_every": 5}
    clean = run(tmp_path / "clean", spares=0, protect="none", **kw)
    rep = run(tmp_path / "swap", spares=1, inject=["kill:node=0@step=6,phase=backward"],
              persist_every=5, persist_dir=str(tmp_path / "ckpt"), **kw)
    assert rep["state"] == "done" and clean["state"] == "done", rep.get("error")
    assert_one_hotswap(rep, ["n0"], 6)
    assert rep["final_state_sha256"] == clean["final_state_sha256"]
    a = load_file(str(tmp_path / "clean" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "swap" / "final" / "model.safetensors"))
    assert set(a) == set(b) and "1.running_mean" in a and int(a["1.num_batches_tracked"]) == 10
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the export loads into the user's model, from the run directory and from the persistent checkpoint (in this
    # process, which imports the workload's module as the command would; the check below runs the command)
    wl = load_workload("user_workload:bn_workload", WorkloadContext(seed=1234, micro_batch=16, model="tiny"))
    for src in (tmp_path / "swap", tmp_path / "ckpt"):
        out = tmp_path / f"export-{src.name}.pt"
        _export(capsys, str(src), "--out", str(out), "--format", "pt")
        model = wl.build_model()
        model.load_state_dict(torch.load(out))
        differ = [k for k in a if not torch.equal(model.state_dict()[k], a[k])]
        assert not differ, (src, differ)
    # the checkpoint's workload module not importable where it is exported: one line saying where the name came from
    bare = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-m", "phoenixft", "export", str(tmp_path / "ckpt"), "--out",
                        str(tmp_path / "x.pt")], capture_output=True, text=True, timeout=120, env=bare, cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert ("the checkpoint was written by a run of --workload='user_workload:bn_workload': no module named "
            "'user_workload' (searched the current directory") in p.stderr, p.stderr
    val = [json.loads(x).get("val_loss") for x in (tmp_path / "swap" / "metrics.jsonl").read_text().splitlines()]
    assert val[4] is not None and val[9] is not None and val[0] is None


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> None:
    """`phoenixft export ARGS` in this process, which must succeed: a new interpreter would spend seconds
    importing torch first (test_buffers_are_protected_restored_and_exported runs the command)."""
    from phoenixft.cli.main import main

    capsys.readouterr()
    assert main(["export", *args]) == 0, capsys.readouterr().err


def test_real_data_trains_evaluates_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prepare-data -> --data with evaluation -> the validation loss falls -> the exported model
    reproduces the run's last validation loss."""
    import sysconfig

    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    data = tmp_path / "tokens.bin"
    p = subprocess.run([sys.executable, "-m", "phoenixft", "prepare-data", *map(str, src), "--out", str(data)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=30, data=str(data), eval_every=5, eval_batches=4)
    assert rep["state"] == "done", rep.get("error")
    val = [m["val_loss"] for m in (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in m]
    assert len(val) == 6 and val[-1] < val[0] - 0.3, val
    out = tmp_path / "model.safetensors"
    _export(capsys, str(tmp_path / "run"), "--out", str(out))
    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=1234, micro_batch=rep["config"]["micro_batch"],
                                                                 model=rep["config"]["model"], microbatches=2,
                                                                 data=str(data)))
    model = wl.build_model()
    model.load_state_dict(load_file(str(out)))
    assert wl.eval_batch is not None
    total = 0.0
    with torch.no_grad():
        for i in range(4):
            torch.manual_seed(_mix(1234, -1, i))
            total += float(wl.loss(model, wl.eval_batch(i)))
    assert math.isclose(total / 4, val[-1], rel_tol=1e-6), (total / 4, val[-1])


def _swapped_equals_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: str, node: int, step: int,
                          phase: str) -> None:
    """`tests/user_workload.py:<workload>` on 2 nodes for 6 steps: with a spare, node `node` killed at `step`
    in `phase` (and hot-swapped: the kill fired and bit), it ends bitwise where the failure-free unprotected
    run ends."""
    fault = f"kill:node={node}@step={step},phase={phase}"
    monkeypatch.syspath_prepend(str(HERE))
    on_pythonpath(str(HERE), monkeypatch)
    kw: dict[str, Any] = {"workload": f"user_workload:{workload}", "steps": 6, "nodes": 2}
    clean = run(tmp_path / "clean", spares=0, protect="none", **kw)
    rep = run(tmp_path / "swap", spares=1, inject=[fault], **kw)
    assert rep["state"] == "done" and clean["state"] == "done", rep.get("error") or clean.get("error")
    assert_one_hotswap(rep, [f"n{node}"], step)
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


def test_a_noncontiguous_buffer_is_protected_and_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer registered as a transposed tensor: its bytes went in and out of the flat buffers through
    `.view(-1)`, which a non-contiguous tensor refuses, so no run of such a model got past its first step
    (every worker crashed, "in-memory state lost")."""
    _swapped_equals_clean(tmp_path, monkeypatch, "noncontiguous_buffer_workload", 0, 4, "backward")
    seen = load_file(str(tmp_path / "swap" / "final" / "model.safetensors"))["seen"]
    assert seen.shape == (3, 4) and torch.equal(seen, torch.full((3, 4), 6.0))


def test_a_nonpersistent_buffer_is_protected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-persistent buffer the forward changes and computes with (a counter, a cache) is state as well:
    it was left out of the flat buffers, so the promoted spare computed with it as built and the run
    reported `done` with a final state that differs from the failure-free run's."""
    _swapped_equals_clean(tmp_path, monkeypatch, "nonpersistent_buffer_workload", 1, 3, "optimizer")
    sd = load_file(str(tmp_path / "swap" / "final" / "model.safetensors"))
    assert "calls" not in sd and "net.0.weight" in sd  # the export stays the model's state_dict


def test_frozen_parameters_train_in_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--precision bf16 turned the trained parameters and the floating buffers into bf16 but left frozen
    parameters in fp32, so a model with a frozen layer failed in its first step ("mat1 and mat2 must have
    the same dtype, but got Float and BFloat16"). They follow as model.to(bf16) would; the final model
    and the export of the persistent checkpoint agree on them."""
    monkeypatch.syspath_prepend(str(HERE))
    on_pythonpath(str(HERE), monkeypatch)
    kw: dict[str, Any] = {"workload": "user_workload:frozen_layer_workload", "steps": 6, "nodes": 2,
                          "precision": "bf16"}
    clean = run(tmp_path / "clean", spares=0, protect="none", **kw)
    rep = run(tmp_path / "swap", spares=1, inject=["kill:node=1@step=5,phase=optimizer"], persist_every=3,
              persist_dir=str(tmp_path / "ckpt"), **kw)
    assert rep["state"] == "done" and clean["state"] == "done", rep.get("error") or clean.get("error")
    assert_one_hotswap(rep, ["n1"], 5)
    assert rep["final_state_sha256"] == clean["final_state_sha256"]
    out = tmp_path / "ckpt.safetensors"
    _export(capsys, str(tmp_path / "ckpt"), "--out", str(out))
    a, b = load_file(str(tmp_path / "swap" / "final" / "model.safetensors")), load_file(str(out))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["0.weight"].dtype == torch.bfloat16 and a["2.weight"].dtype == torch.float32
