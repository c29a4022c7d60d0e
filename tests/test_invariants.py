"""The recovery invariants I1-I4: `check_invariants` over generated rank states against an oracle written
from the definitions, the one reading of a recovery entry every display uses (`invariants_hold`: missing is
never passing), and I3 on a survivor's own half (a checksum never recorded fails, it is not skipped)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TwoPassGather

from phoenixft.distributed.topology import Topology
from phoenixft.observe.display import Display
from phoenixft.observe.html_report import RunData, render_html
from phoenixft.protect.snapshot import PingPong, checksum
from phoenixft.recovery.invariants import INVARIANTS, check_invariants, failed_invariants, invariants_hold
from phoenixft.recovery.restore import own_half_problem


@dataclasses.dataclass
class _Rank:
    topo: Topology
    param_step: int
    opt_steps: list[int]
    held: tuple[int, int]
    opt_ok: bool


def _draw(rng: random.Random) -> tuple[Topology, int, list[_Rank]]:
    """A job of 1-6 ranks resuming at step r; each rank's state is right, or wrong in one or more ways."""
    nodes, wpn = rng.randint(1, 3), rng.randint(1, 2)
    r = rng.randint(0, 50)
    base = Topology(epoch=rng.randint(1, 9), nodes=[f"n{i}" for i in range(nodes)], workers_per_node=wpn,
                    replicas=min(1, nodes - 1), resume_step=r)
    world = base.world
    bad = rng.random() < 0.7  # most cases break something; the rest are a correct restore
    ranks = []
    for i in range(world):
        topo, param, opt, held, ok = base, r, [r, r - 1] if r else [r], (i, world), True
        for _ in range(rng.randint(1, 3) if bad and rng.random() < 0.4 else 0):
            what = rng.randrange(8)
            if what == 0:
                topo = dataclasses.replace(topo, epoch=topo.epoch + rng.choice([-1, 1]))
            elif what == 1:  # same epoch, another topology (a node renamed): only the digest differs
                topo = dataclasses.replace(topo, nodes=[*topo.nodes[:-1], "spare9"])
            elif what == 2:
                held = (rng.choice([j for j in range(-1, world + 1) if j != i]), world)
            elif what == 3:
                held = (i, world + rng.choice([-1, 1]))
            elif what == 4:
                ok = False
            elif what == 5:
                param = r + rng.choice([-2, -1, 1])
            elif what == 6:  # the interrupted step kept (newest), or the previous step only
                opt = rng.choice([[r + 1, r], [r - 1], []])
            else:
                param, opt = r - 1, [r - 1]
        ranks.append(_Rank(topo, param, opt, held, ok))
    return base, r, ranks


def _oracle(me: int, r: int, world: int, ranks: list[_Rank], topos: list[tuple[str, int]]) -> dict[str, list[int]]:
    """The ranks each invariant fails on, from its definition, as rank `me` sees the job (`topos`: each
    rank's topology digest and epoch)."""
    return {
        "I1": [i for i, t in enumerate(topos) if t != topos[me]],
        "I2": [i for i, x in enumerate(ranks) if x.held != (i, world)],
        "I3": [i for i, x in enumerate(ranks) if not x.opt_ok],
        "I4": [i for i, x in enumerate(ranks) if x.param_step != r or not x.opt_steps or x.opt_steps[0] != r],
    }


def _run(r: int, ranks: list[_Rank]) -> list[tuple[dict[str, bool], str]]:
    g = TwoPassGather()
    wait = lambda work, what: None  # noqa: E731
    for i, x in enumerate(ranks):
        check_invariants(g, x.topo, i, r, x.param_step, x.opt_steps, x.held, x.opt_ok, wait)
    g.full = torch.cat(g.rows)
    return [check_invariants(g, x.topo, i, r, x.param_step, x.opt_steps, x.held, x.opt_ok, wait)
            for i, x in enumerate(ranks)]


def test_each_invariant_is_false_exactly_when_its_condition_is_violated() -> None:
    rng = random.Random(33)
    seen = {k: [0, 0] for k in INVARIANTS}  # (held, failed) counts: both outcomes must be exercised
    for _ in range(2000):
        base, r, ranks = _draw(rng)
        topos = [(x.topo.digest(), x.topo.epoch) for x in ranks]
        for i, (inv, detail) in enumerate(_run(r, ranks)):
            want = _oracle(i, r, base.world, ranks, topos)
            assert inv == {k: not v for k, v in want.items()}, (ranks, inv, want)
            for k, v in want.items():
                seen[k][bool(v)] += 1
                assert (f"{k} fails on ranks {v}" in detail) == bool(v), detail
            assert (detail == "") == all(inv.values())
    assert all(held > 300 and failed > 300 for held, failed in seen.values()), seen


def test_a_rank_id_missing_from_the_job_breaks_i2() -> None:
    topo = Topology(epoch=1, nodes=["n0", "n1"], workers_per_node=1, replicas=1, resume_step=4)
    ranks = [_Rank(topo, 4, [4, 3], (0, 2), True), _Rank(topo, 4, [4, 3], (0, 2), True)]
    g = TwoPassGather()
    wait = lambda work, what: None  # noqa: E731
    for x in ranks:  # both claim rank 0: rank 1 has no member
        check_invariants(g, x.topo, 0, 4, x.param_step, x.opt_steps, x.held, x.opt_ok, wait)
    g.full = torch.cat(g.rows)
    inv, detail = check_invariants(g, topo, 0, 4, 4, [4, 3], (0, 2), True, wait)
    assert inv == {"I1": True, "I2": False, "I3": True, "I4": True}
    assert "I2 fails on ranks [-1]" in detail


ALL_TRUE = {k: True for k in INVARIANTS}


def _html(entry: dict[str, Any]) -> str:
    return render_html(RunData(Path("run"), {"state": "done", "config": {}, "recoveries": [entry]}))


@pytest.mark.parametrize("inv", [None, {}, {"I1": True, "I2": True, "I3": True}, {**ALL_TRUE, "I3": False},
                                 {**ALL_TRUE, "I4": None}, {**ALL_TRUE, "I2": 1}, "all true"])
def test_an_entry_without_all_four_invariants_true_never_passes(inv: Any) -> None:
    entry: dict[str, Any] = {"epoch": 1, "action": "swap", "lost_steps": 1, "stages": {}, "recovery_s": 0.1}
    if inv is not None:
        entry["invariants"] = inv
    assert invariants_hold(entry) is False
    assert failed_invariants(entry)
    assert Display._inv(entry).startswith("FAILED: "), Display._inv(entry)
    html = _html(entry)
    assert "invariants VIOLATED" in html and "all true" not in html
    assert ">FAILED</td>" in html


def test_an_entry_with_all_four_invariants_true_passes() -> None:
    entry = {"epoch": 1, "invariants": dict(ALL_TRUE), "stages": {}}
    assert invariants_hold(entry) is True and failed_invariants(entry) == []
    assert Display._inv(entry) == "ok"
    html = _html(entry)
    assert "invariants all true" in html and "FAILED" not in html and "VIOLATED" not in html
    assert failed_invariants({"invariants": {"I1": True, "I3": False}}) == ["I2", "I3", "I4"]


def _committed(crc_of: Any) -> PingPong:
    st = PingPong(2, 16)
    st.begin_write(0)
    st.data[0].copy_(torch.arange(32, dtype=torch.float32).view(2, 16))
    st.commit(0, 7, crc_of(st), (0, 1))
    return st


def test_i3_on_a_survivors_own_half_never_skips() -> None:
    assert own_half_problem(_committed(lambda st: checksum(st.payload(0))), 0) is None
    # a checksum never recorded (0) is not a pass: nothing independent of these bytes vouches for them
    assert own_half_problem(_committed(lambda st: 0), 0) == "has no recorded checksum to verify it against"
    damaged = _committed(lambda st: checksum(st.payload(0)))
    damaged.data[0, 1, 3] += 1.0
    assert own_half_problem(damaged, 0) == "does not match its committed checksum"
