"""The control plane survives its own crash: the coordinator is killed, started again by the launcher,
and carries the job on from the journal (a file beside the TCPStore; on etcd, the store itself), then a
node is lost and hot-swapped. Run on both backends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run

from phoenixft.controlplane.etcd_cluster import etcd_binary


@pytest.mark.parametrize("control_plane", ["tcpstore", "etcd"])
def test_coordinator_killed_then_node_killed(tmp_path: Path, reference, control_plane: str) -> None:  # type: ignore[no-untyped-def]
    if control_plane == "etcd" and etcd_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("CI: no etcd binary (apt-get install etcd-server): the etcd backend is untested")
        pytest.skip("no etcd binary (apt-get install etcd-server): the etcd backend is not tested here")
    ref = reference(nodes=3, steps=14)
    rep = run(tmp_path, nodes=3, spares=1, steps=14, control_plane=control_plane,
              inject=["kill:coordinator@step=4", "kill:node=1@step=9,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (cp,) = rep["control_plane"]
    assert cp["downtime_s"] is not None and cp["downtime_s"] < 30
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["promoted"] == ["s0"] and all(rec["invariants"].values())
    if control_plane == "tcpstore":
        journal = (tmp_path / "coordinator.journal").read_text().splitlines()
        assert len(journal) == 2  # epoch 0, then the hot-swap's epoch 1, written ahead of publishing
    else:  # the journal lives in the store, which the run removed at its end
        assert not (tmp_path / "coordinator.journal").exists()
