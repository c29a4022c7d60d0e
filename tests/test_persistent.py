"""The persistent tier: DCP checkpoints off the critical path, fallback when replicas are lost, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run

from phoenixft.persist import latest_manifest


def test_owner_and_replica_lost_falls_back_to_persistent_tier(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    ckpt = tmp_path / "ckpt"
    rep = run(tmp_path / "run", nodes=4, spares=2, replicas=1, steps=12, persist_every=4, persist_dir=str(ckpt),
              inject=["kill:node=0,1@step=10,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    assert rec["action"] == "persistent"
    # the newest checkpoint complete when the decision was made: 8, or 4 if 8's write was still running
    assert rec["persistent_step"] in (4, 8) and rec["resumed_step"] == rec["persistent_step"]
    assert rec["replayed_steps"] == 9 - rec["persistent_step"]  # only the steps since the checkpoint
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    man = latest_manifest(ckpt)
    assert man is not None and man["step"] == 12 and man["shards"] == 4  # still written after the fallback


def test_torn_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "a", nodes=2, spares=0, steps=8, persist_every=4, persist_dir=str(ckpt))
    assert latest_manifest(ckpt)["step"] == 8  # type: ignore[index]
    (ckpt / "step_00000008" / "MANIFEST.json").unlink()  # as if the write of step 8 had been torn
    assert latest_manifest(ckpt)["step"] == 4  # type: ignore[index]


@pytest.mark.slow  # (a 3D checkpoint resumed data-parallel: tests/test_mesh.py covers a resume on another layout)
def test_resume_onto_a_different_node_count(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    # the global batch must be the same on both sides: 12 microbatches split over 4, then over 3 ranks
    first = run(tmp_path / "a", nodes=4, spares=0, steps=6, microbatches=12, persist_every=6, persist_dir=str(ckpt))
    assert first["state"] == "done"
    ref = reference(nodes=4, steps=8, microbatches=12)
    resumed = run(tmp_path / "b", nodes=3, spares=0, steps=8, microbatches=12, resume=str(ckpt))
    assert resumed["state"] == "done", resumed.get("error")
    assert resumed["first_step"] == 7
    a, b = resumed["loss"][0], ref["loss"][6]
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["nodes"] == 3
