"""What real training scripts use, protected under `phoenixft launch` (tests/scripts/features.py): any
torch.optim optimizer and LR scheduler, gradient accumulation, autocast, an EMA of the weights, BatchNorm
buffers, torchdata's StatefulDataLoader, FSDP2. Each configuration: a node SIGKILLed mid-step, a spare
hot-swapped in, the final state bitwise equal to the failure-free run's; then a shrink that keeps the
global batch and the refusal to shrink a sharded model.

The pure parts (api/loader.py's shares of a global batch, api/packing.py's snapshot format) are checked
here over generated cases."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run

from phoenixft.api.loader import StepLoader
from phoenixft.api.packing import Packer, check_restorable, unpack, used_bytes
from phoenixft.cli.cmd_launch import SCRIPT_STEPS

SCRIPT = Path(__file__).resolve().parent / "scripts" / "features.py"
STEPS = 14

CONFIGS = {
    "sgd-onecycle-accum-amp-ema-batchnorm": ["--opt", "sgd", "--sched", "onecycle", "--accum", "2", "--amp", "--ema",
                                             "--batchnorm"],
    "stateful-loader-adagrad-lambda": ["--loader", "stateful", "--opt", "adagrad", "--sched", "lambda"],
    "fsdp2": ["--fsdp", "--opt", "adam", "--sched", "step"],
}


def launch(tmp: Path, args: list[str], **kw: Any) -> dict[str, Any]:
    kw.setdefault("nodes", 2)
    kw.setdefault("spares", 1)
    return run(tmp, script=str(SCRIPT), script_args=["--steps", str(STEPS), *args], steps=SCRIPT_STEPS, **kw)


def _has_torchdata() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchdata") is not None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_hot_swap_is_bitwise_for(tmp_path: Path, name: str) -> None:
    if "stateful" in name and not _has_torchdata():  # (the `test` extra installs it)
        pytest.skip("torchdata is not importable (its StatefulDataLoader): pip install torchdata")
    nodes = 3 if name == "fsdp2" else 2  # (FSDP2 over 3 ranks: its all-gathers ring through a rank that survives)
    clean = launch(tmp_path / "clean", CONFIGS[name], nodes=nodes)
    assert clean["state"] == "done" and clean["recoveries"] == [], clean["state"]
    rep = launch(tmp_path / "kill", CONFIGS[name], nodes=nodes, inject=["kill:node=1@step=6,phase=backward"])
    assert rep["state"] == "done", rep["state"]
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    assert rep["final_state_sha256"] == clean["final_state_sha256"]


def test_a_shrink_keeps_the_global_batch(tmp_path: Path) -> None:
    """3 nodes, no spare, one killed: the two left draw the global batch of three (each a half of it), the run
    completes, and its loss stays that of the failure-free run within what the reduction's grouping changes."""
    clean = launch(tmp_path / "clean", ["--exact"], nodes=3, spares=0)
    rep = launch(tmp_path / "kill", ["--exact"], nodes=3, spares=0, inject=["kill:node=1@step=6"])
    assert rep["state"] == "done", rep["state"]
    assert [r["action"] for r in rep["recoveries"]] == ["shrink"], rep["recoveries"]
    assert len(rep["loss"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(rep["loss"], clean["loss"], strict=True))
    assert worst < 1e-4, (worst, rep["loss"], clean["loss"])


def test_a_shrink_then_a_grow_back_when_the_node_is_repaired(tmp_path: Path) -> None:
    # paced: the 11 steps after the kill (5.5 s or more) outlast the repaired node's start (a new agent, a worker
    # that imports torch and runs the script up to phoenixft.init()), however loaded the machine
    rep = launch(tmp_path, ["--pace", "0.5"], nodes=3, spares=0, repair_after=0.5, inject=["kill:node=1@step=3"])
    assert rep["state"] == "done", rep["state"]
    assert [r["action"] for r in rep["recoveries"]] == ["shrink", "grow"], rep["recoveries"]
    assert all(all(r["invariants"][k] for k in ("I1", "I2", "I3", "I4")) for r in rep["recoveries"])


def test_a_sharded_model_is_never_shrunk(tmp_path: Path) -> None:
    rep = launch(tmp_path, ["--fsdp"], nodes=2, spares=0, inject=["kill:node=1@step=6"])
    assert rep["state"].startswith("failed"), rep["state"]
    assert "sharded over its ranks (FSDP), which cannot drop one" in rep.get("error", ""), rep.get("error")


# ---------------------------------------------------------------------------- the pure parts
class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_every_world_draws_the_same_global_batches() -> None:
    """Over generated datasets, batch sizes and worlds: the shares of every rank of any world make up exactly the
    global microbatch the starting world draws, contiguous and in order; a cursor past an epoch starts the next
    one in another order (shuffled)."""
    rng = random.Random(7)
    for _ in range(300):
        b, w0 = rng.randint(1, 8), rng.randint(1, 6)
        n = rng.randint(b * w0, b * w0 * 5)
        shuffle = rng.random() < 0.5
        dl = torch.utils.data.DataLoader(_Data(n), batch_size=b, shuffle=shuffle)
        sl = StepLoader(dl, seed=rng.randint(0, 99), world0=w0, rank_share=lambda: (0, 1))
        g = b * w0
        for k in range(3 * sl.per_epoch()):
            cursor = k * g
            whole = sl.indices(cursor, 0, 1)
            assert len(whole) == g and len(set(whole)) == g
            for w in range(1, w0 + 2):
                parts = [sl.indices(cursor, r, w) for r in range(w)]
                assert [i for p in parts for i in p] == whole
                assert max(map(len, parts)) - min(map(len, parts)) <= 1
        epoch0 = [i for k in range(sl.per_epoch()) for i in sl.indices(k * g, 0, 1)]
        epoch1 = [i for k in range(sl.per_epoch(), 2 * sl.per_epoch()) for i in sl.indices(k * g, 0, 1)]
        assert len(set(epoch0)) == len(epoch0)
        if shuffle and len(epoch0) > 8:
            assert epoch0 != epoch1


def _nest(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        dt = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64])
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        return (torch.rand(shape) * 100).to(dt)
    if kind == 1:
        return rng.choice([None, True, 3, -2.5, "adam", (0.9, 0.999), b"x", 1e-8])
    if kind == 2:
        return rng.random()
    if kind == 3:
        return {f"k{i}": _nest(rng, depth + 1) for i in range(rng.randint(0, 4))}
    if kind == 4:
        return [_nest(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return tuple(_nest(rng, depth + 1) for _ in range(rng.randint(0, 3)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b and type(a) is type(b)


def test_packing_round_trips_and_writes_the_same_bytes_for_equal_states() -> None:
    """Over generated nests: unpack(pack(x)) == x; packing an equal nest (fresh objects, no shared ones) into a
    buffer that held something else writes the same bytes; a buffer too small is refused."""
    rng = random.Random(11)
    for _ in range(400):
        nest = {"state": _nest(rng), "step": rng.randint(0, 10**6)}
        p = Packer()
        size = p.size(nest)
        a = torch.full((size + 256,), 0xAB, dtype=torch.uint8)
        used = p.pack(nest, a)
        assert used == size == used_bytes(a)
        assert _same(unpack(a), nest)
        b = torch.randint(0, 255, (size + 512,), dtype=torch.uint8)
        Packer().pack(unpack(a), b)
        assert bytes(a[:used].numpy()) == bytes(b[:used].numpy())
        if size > 64:
            with pytest.raises(ValueError, match="does not fit"):
                Packer().pack(nest, torch.zeros(size - 1, dtype=torch.uint8))


def test_a_state_that_a_snapshot_could_not_restore_is_refused_at_once() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot protect this state"):
        check_restorable({"x": Opaque()})
    with pytest.raises(TypeError, match="does not restore"):  # (a class a peer's snapshot could name)
        check_restorable({"x": _Data(3)})
    check_restorable({"lr": 0.1, "betas": (0.9, 0.99), "t": torch.zeros(3)})


def test_a_chaos_campaign_on_a_script_passes(tmp_path: Path) -> None:
    """`phoenixft chaos ... SCRIPT ARGS`: seeded faults (kills in any phase, crashes, hangs, kills mid-recovery...)
    against the script's failure-free reference; every fault fires and the final state is the reference's."""
    from phoenixft.cli.main import main

    report = tmp_path / "chaos.json"
    rc = main(["chaos", "--nodes", "3", "--spares", "2", "--steps", "24", "--faults", "4", "--seed", "3", "--quiet",
               "--run-dir", str(tmp_path / "runs"), "--report", str(report), str(SCRIPT), "--steps", "24",
               "--pace", "0.02"])
    res = json.loads(report.read_text())
    assert rc == 0 and res["verdict"] == "pass", (res["verdict"], res["reason"])
    assert res["injected"] == res["faults"] == 4 and res["bitwise_equal"], res
