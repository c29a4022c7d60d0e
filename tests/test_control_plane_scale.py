"""The control plane's load harness at W=64: the real coordinator, a real TCPStore, 8 nodes x 8
simulated workers and a spare node; node n1 is killed and the protocol must complete (epoch 1
published with the spare in n1's slot, every member read it). About 10-15 s.

    .venv/bin/python -m pytest -q tests/test_control_plane_scale.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_harness_w64_completes_the_protocol(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "control_plane.py"), "--sizes", "64", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "control_plane.json").read_text())
    (r,) = res["runs"]
    assert r["workers"] == 64 and r["nodes"] == 8 and not r["errors"]
    assert r["dead"] == ["n1"] and r["promoted"] == ["s0"] and r["action"] == "hotswap"
    assert r["spare_in_slot"] and r["members_read"] == r["members"] == 64  # 7 survivors + the spare, x 8
    assert r["descriptors"] == 56
    assert 0 <= r["detect_s"] < 5 and 0 <= r["decide_s"] < 5 and 0 <= r["publish_s"] < 5
    assert set(res["control_plane_decide_s"]) == {"64"}
