"""No spare left: shrink with a constant global batch; a spare arrives later: grow back."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run


def _close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b)
    for s, (x, y) in enumerate(zip(a, b, strict=True), 1):
        assert abs(x - y) <= rel * abs(y), f"step {s}: {x} vs {y}"


def test_shrink_keeps_the_trajectory(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=12, microbatches=6)
    rep = run(tmp_path, nodes=3, spares=0, steps=12, microbatches=6, inject=["kill:node=1@step=6,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["steps_completed"] == 12
    (rec,) = rep["recoveries"]
    assert rec["action"] == "shrink" and rec["promoted"] == [] and all(rec["invariants"].values())
    # the same samples every step; only the reduction order differs (2 ranks instead of 3)
    _close(rep["loss"], ref["loss"], 1e-4)


@pytest.mark.slow
def test_shrink_then_grow_back(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=30, microbatches=6)
    rep = run(tmp_path, nodes=3, spares=0, steps=30, microbatches=6, spare_arrives_at_step=4,
              inject=["kill:node=1@step=3,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    shrink, grow = rep["recoveries"]
    assert shrink["action"] == "shrink" and grow["action"] == "grow" and grow["promoted"] == ["s0"]
    assert all(grow["invariants"].values())
    _close(rep["loss"], ref["loss"], 1e-4)
