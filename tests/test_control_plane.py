"""The control plane survives its own crash: the coordinator is restarted and reloads its journal."""

from __future__ import annotations

from pathlib import Path

from conftest import run


def test_coordinator_killed_then_node_killed(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=14)
    rep = run(tmp_path, nodes=3, spares=1, steps=14,
              inject=["kill:coordinator@step=4", "kill:node=1@step=9,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (cp,) = rep["control_plane"]
    assert cp["downtime_s"] is not None and cp["downtime_s"] < 30
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["promoted"] == ["s0"] and all(rec["invariants"].values())
    journal = (tmp_path / "coordinator.journal").read_text().splitlines()
    assert len(journal) == 2  # epoch 0, then the hot-swap's epoch 1, written ahead of publishing
