"""Erasure-coded protection end to end: real SIGKILLs, shards rebuilt from their group, bitwise-equal results.

With `--redundancy ec:D+H` no shard has a full copy anywhere: a lost member's optimizer shard is
rebuilt from the surviving members' committed state and the parity of the same step. Placement on
4 nodes (tests/test_redundancy.py checks it in general): ec:3+1 and ec:2+2 both give the groups
{n0, n2} and {n1, n3}; ec:3+1 keeps the parity of {n0, n2} on n1 and of {n1, n3} on n2; ec:2+2
keeps {n0, n2}'s two parity blocks on n1 and n3. On 8 nodes ec:4+2 gives {n0, n2, n4, n6} (parity on
n1, n3) and {n1, n3, n5, n7} (parity on n2, n4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SUITE_DEFAULTS, run

NUMEL = 60096  # trained parameters of the suite's `nano` GPT (tests/test_ec.py::test_model_size_assumed_here)
STATE_ROWS = 2  # AdamW's exp_avg and exp_avg_sq: the fp32 optimizer payload a member's shard holds
ALIGN = 64  # elements per shard, and bytes per erasure-code stripe, are multiples of 64


def _up(x: int, to: int) -> int:
    return -(-x // to) * to


def _piece_bytes(world: int, d: int) -> int:
    """Bytes of one block of a d-member group: a member's payload (its optimizer shard in the job of `world`
    ranks) cut into d stripes, each padded to ALIGN bytes."""
    payload = 4 * STATE_ROWS * _up(-(-NUMEL // world), ALIGN)
    return d * max(ALIGN, _up(-(-payload // d), ALIGN))


def _ok(rec: dict, action: str, decoded: list[str], d: list[int] | None = None,  # type: ignore[type-arg]
        workers_per_node: int = 1) -> None:
    """A recovery that rebuilt `decoded`, each from the d pieces of its group (`d`: per decoded shard, 2 by
    default), each piece sent to the rank that rebuilds it; a hot-swap moves, besides the pieces, the
    parameters to each worker of each promoted spare, and nothing else."""
    assert rec["action"] == action, rec
    assert all(rec["invariants"].get(k) is True for k in ("I1", "I2", "I3", "I4")), rec["invariants"]
    assert rec["redundancy"].startswith("ec:")
    assert rec["decoded"] == decoded, rec
    ds = d or [2] * len(decoded)
    worlds = [int(x.rsplit("of", 1)[1]) for x in decoded]
    assert rec["bytes_decoded_from"] == sum(k * _piece_bytes(w, k) for w, k in zip(worlds, ds, strict=True)), rec
    assert rec["decode_s"] > 0.0, rec  # a decode ran (a recovery without one reports 0.0)
    if action == "hotswap":
        params = 4 * _up(-(-NUMEL // worlds[0]), ALIGN) * worlds[0]
        assert rec["bytes_moved"] - rec["bytes_decoded_from"] == len(rec["promoted"]) * workers_per_node * params, rec


def test_model_size_assumed_here() -> None:
    from phoenixft.workload import WorkloadContext, load_workload

    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=1234, micro_batch=8,
                                                                 model=SUITE_DEFAULTS["model"]))
    assert sum(p.numel() for p in wl.build_model().parameters() if p.requires_grad) == NUMEL


def test_ec31_node_killed_mid_run_is_bitwise_invisible(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=1, steps=12, redundancy="ec:3+1",
              inject=["kill:node=2@step=6,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["redundancy"] == "ec:3+1"
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["loss"] == ref["loss"]
    (rec,) = rep["recoveries"]
    _ok(rec, "hotswap", ["pp0.tp0.dp2of4"])
    assert rec["dead"] == ["n2"] and rec["promoted"] == ["s0"] and rec["lost_steps"] <= 1


def test_ec22_two_members_of_one_group_killed_in_the_same_step(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # n0 and n2 form one group: both its data shards are rebuilt from the two Reed-Solomon parity blocks
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=2, steps=12, redundancy="ec:2+2",
              inject=["kill:node=0,2@step=6,phase=optimizer"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    _ok(rec, "hotswap", ["pp0.tp0.dp0of4", "pp0.tp0.dp2of4"])
    assert rec["dead"] == ["n0", "n2"] and sorted(rec["promoted"]) == ["s0", "s1"]


def test_ec_shrink_rebuilds_then_repartitions(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=0, steps=12, redundancy="ec:3+1",
              inject=["kill:node=1@step=6,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    _ok(rec, "shrink", ["pp0.tp0.dp1of4"])
    # the same samples every step; only the reduction order differs (3 ranks instead of 4)
    for s, (x, y) in enumerate(zip(rep["loss"], ref["loss"], strict=True), 1):
        assert abs(x - y) <= 1e-4 * abs(y), f"step {s}: {x} vs {y}"


def test_ec22_corrupt_parity_is_never_used(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # the parity block n1 received during step 5 (that of step 4, the newest) is corrupted at rest; n0 then
    # dies inside its optimizer step 5: its shard must be rebuilt from n2 and the *other* parity block (n3)
    ref = reference(nodes=4, steps=10)
    rep = run(tmp_path, nodes=4, spares=1, steps=10, redundancy="ec:2+2",
              inject=["corrupt:node=1@step=5", "kill:node=0@step=5,phase=optimizer"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    _ok(rec, "hotswap", ["pp0.tp0.dp0of4"])
    assert rec["resumed_step"] == 4 and rec["lost_steps"] == 0, rec
    assert ["parity0:pp0.tp0.dp0of4,pp0.tp0.dp2of4", 4] in rec["replicas_rejected"], rec


def test_ec_cascade_spare_killed_during_its_rebuild(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=2, steps=12, redundancy="ec:3+1",
              inject=["kill:node=3@step=6,phase=optimizer", "kill:node=3@step=6,phase=recovery"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    first, second = rep["recoveries"]
    assert first["promoted"] == ["s0"] and second["dead"] == ["s0"] and second["promoted"] == ["s1"]
    _ok(second, "hotswap", ["pp0.tp0.dp3of4"])


def test_ec_in_place_restart_then_node_loss(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # n1 (which keeps the parity of {n0, n2}) crashes and is restarted in place from shared memory,
    # adopting its parity block; later n0 dies and is rebuilt from n2 and that parity
    ref = reference(nodes=4, steps=12)
    rep = run(tmp_path, nodes=4, spares=1, steps=12, redundancy="ec:3+1",
              inject=["crash:rank=1@step=4,phase=backward", "kill:node=0@step=8,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    inplace, swap = rep["recoveries"]
    assert inplace["action"] == "inplace" and inplace["restarted"] == ["n1.0"] and inplace["decoded"] == []
    assert inplace["bytes_decoded_from"] == 0 and inplace["decode_s"] == 0.0, inplace  # nothing was decoded
    _ok(swap, "hotswap", ["pp0.tp0.dp0of4"])


@pytest.mark.slow
def test_ec42_eight_nodes_two_of_one_group_killed(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=8, steps=10)
    rep = run(tmp_path, nodes=8, spares=2, steps=10, redundancy="ec:4+2", timeout=400.0,
              inject=["kill:node=0,2@step=5,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    _ok(rec, "hotswap", ["pp0.tp0.dp0of8", "pp0.tp0.dp2of8"], d=[4, 4])


def test_ec21_two_workers_per_node_one_ring_per_local_rank(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # 3 nodes x 2 workers: two rings (local rank 0 and 1), each {n0, n2} + parity on n1 and {n1} + parity on
    # n2; killing n1 loses one member in each ring, n1's own one-member group: dp2of6 (ring 0) and dp3of6
    # (ring 1), each rebuilt from its one parity block on n2
    ref = reference(nodes=3, workers_per_node=2, steps=10)
    rep = run(tmp_path, nodes=3, workers_per_node=2, spares=1, steps=10, redundancy="ec:2+1",
              inject=["kill:node=1@step=5,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    _ok(rec, "hotswap", ["pp0.tp0.dp2of6", "pp0.tp0.dp3of6"], d=[1, 1], workers_per_node=2)
