"""Smoke test of the benchmark harness (bench/): the smallest real piece, end to end, in < 60 s.

Runs `python bench/overhead.py --model tiny --dp 2 --rounds 1 --steps 6` (one `--protect none`
run, one `--protect phoenix` run for each replica transport and one torchrun DDP + DCP launch)
into a temporary folder and checks the JSON it writes; then merges it the way `bench/run_all.py` does and checks that
latest.json's top-level keys are there, and that a missing torchft is reported, not crashed on.

    .venv/bin/python -m pytest -q tests/test_bench_smoke.py
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def overhead(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        str(BENCH / "overhead.py"),
        "--model",
        "tiny",
        "--dp",
        "2",
        "--rounds",
        "1",
        "--steps",
        "6",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Failure-free step time" in p.stdout  # the table was printed
    assert (out / "overhead.png").stat().st_size > 0
    res: dict[str, Any] = json.loads((out / "overhead.json").read_text())
    res["_out"] = str(out)
    return res


def _pos(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_overhead_json_has_sane_numbers(overhead: dict[str, Any]) -> None:
    assert _pos(overhead["overhead_ratio_dp2"]) and 0.2 < overhead["overhead_ratio_dp2"] < 5
    assert _pos(overhead["baseline_vs_ddp_dp2"])
    (cfg,) = overhead["configs"]
    assert cfg["dp"] == 2 and set(cfg["modes"]) == {"none", "phoenix_r1", "phoenix_r1_tcp"}
    assert _pos(overhead["overhead_ratio_dp2_tcp"]) and 0.2 < overhead["overhead_ratio_dp2_tcp"] < 5
    for m in cfg["modes"].values():
        assert _pos(m["median_s"]) and m["n"] == 3  # 6 steps, first 3 dropped as warm-up
    b = cfg["bytes_per_step"]["phoenix_r1"]
    shard = math.ceil(cfg["params"] / 2)
    assert b["replicated_per_worker"] == 2 * shard * 4  # exp_avg + exp_avg_sq, one replica
    assert b["replicated_per_worker_measured"] == b["replicated_per_worker"]  # what the probe saw sent
    br = cfg["breakdown"]["phoenix_r1"]
    assert _pos(br["compute_s"]) and _pos(br["replication_s"]) and br["replication_exposed_s"] >= 0
    d = overhead["ddp"]
    for k in ("dcp_sync_every_step", "dcp_async_every_step"):
        assert _pos(d["ratios_vs_plain_ddp"][k])
    assert overhead["machine"]["cpu_count"] >= 1 and overhead["machine"]["torch"]


@pytest.mark.slow
def test_run_all_merge_keeps_the_top_level_keys(
    overhead: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all
    import torchft_peer

    monkeypatch.setattr(torchft_peer, "availability", lambda: (False, "torchft is not installed (test)"))
    tf = torchft_peer.run(True, out=tmp_path)
    assert tf["torchft_heal_s"] is None and "not installed" in tf["torchft_note"]
    res = run_all.merge({"overhead": overhead, "torchft": tf}, True, time.time(), overhead["machine"])
    for key in (
        "overhead_ratio_dp2",
        "baseline_vs_ddp_dp2",
        "resume_speedup_k50",
        "torchft_heal_s",
        "torchft_note",
        "recovery",
        "checkpoint_restart",
        "machine",
        "targets",
    ):
        assert key in res, key
    assert res["overhead_ratio_dp2"] == overhead["overhead_ratio_dp2"]
    assert res["torchft_heal_s"] is None and res["torchft_note"]
    assert isinstance(res["recovery"], list) and isinstance(res["checkpoint_restart"], list)
    text = run_all.summary_md(res)
    assert "| Figure |" in text and "overhead.py" in text
    json.dumps(res)  # serialisable


def test_run_all_merge_reports_the_transfer_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/transfer.py's figure reaches latest.json: on `medium` under its target's key
    (`recovery_transfer_gbps_medium`), on `small` (--quick) only under the part's own key."""
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    machine = {"date": "x", "cpu_count": 2, "cpu_model": "x", "torch": "x"}
    for model, want in (("medium", 1.5), ("small", None)):
        tr = {"model": model, "recovery_transfer_gbps": 1.5, f"recovery_transfer_gbps_{model}": 1.5,
              "recovery_transfer_link_gbps": 2.5, "recovery_transfer_vs_link": 0.6}
        res = run_all.merge({"transfer": tr}, model == "small", time.time(), dict(machine))
        assert res["recovery_transfer_gbps_medium"] == want
        assert res["recovery_transfer_gbps_transfer_part"] == 1.5 and res["recovery_transfer_part_model"] == model
        assert res["recovery_transfer_link_gbps"] == 2.5 and res["recovery_transfer_vs_link"] == 0.6
        assert "transfer" in run_all.summary_md(res)


def test_run_all_merge_reports_the_etcd_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/etcd.py's figures reach latest.json's top level."""
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    machine = {"date": "x", "cpu_count": 2, "cpu_model": "x", "torch": "x"}
    et = {"step_time_ratio_etcd_vs_tcpstore": 1.01, "etcd_server_cpu_cores": 0.06,
          "takeover": {"downtime_s": 2.1}, "rendezvous_s": {"tcpstore": 0.04, "etcd": 0.07}}
    res = run_all.merge({"etcd": et}, False, time.time(), dict(machine))
    assert res["etcd_step_ratio_vs_tcpstore"] == 1.01 and res["etcd_takeover_s"] == 2.1
    assert res["etcd_server_cpu_cores"] == 0.06 and res["etcd_rendezvous_s"]["etcd"] == 0.07
    json.dumps(res)


def test_transfer_link_floor_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/transfer.py's same-run link floor: bench/gloo_link.py really moves the bytes between two
    processes and its GB/s is parsed (a parse that silently gave None would drop the ratio)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import transfer

    gbps = transfer.link_gbps(8_000_000)
    assert _pos(gbps), gbps


def test_every_named_mutation_still_finds_its_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make mutants` applies each named mutation by replacing its text in src/: a change to that code that
    leaves the text behind would make the mutation (and its row in docs/testing.md) stale. Each text is
    there exactly once, each catching test names a test file that exists, and each mutation changes it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import mutants

    assert len(mutants.MUTATIONS) >= 20 and mutants.check_fresh(mutants.MUTATIONS) == []
    for m in mutants.MUTATIONS:
        assert m.old != m.new and m.tests, m.name
        assert all((BENCH.parent / t.split("::")[0]).is_file() for t in m.tests), (m.name, m.tests)
