"""`phoenixft chaos`: the seeded schedule (pure, thousands of seeds), the spare repair, and campaigns end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import processes_with

from phoenixft.cli.main import main
from phoenixft.config import RunConfig
from phoenixft.errors import UserError
from phoenixft.faults.chaos import (
    KINDS,
    MAX_COORDINATOR_KILLS,
    MIN_GAP,
    format_verdict,
    judge,
    make_schedule,
    unsurvivable_reason,
)
from phoenixft.faults.spec import parse_fault
from phoenixft.runtime.repair import RepairQueue

INTERRUPTED = "failed: interrupted"  # the state of a run stopped by Ctrl-C, SIGTERM or SIGHUP (report.json)

CONFIGS = [
    dict(nodes=4, spares=2, steps=80),
    dict(nodes=3, spares=2, steps=40),
    dict(nodes=4, spares=2, steps=60, replicas=2),
    dict(nodes=4, spares=2, steps=60, racks=2),
    dict(nodes=2, workers_per_node=2, spares=1, steps=40),
    dict(nodes=4, spares=2, steps=60, persist_every=5, persist_dir="ckpt"),
]


def _cfg(**kw: object) -> RunConfig:
    return RunConfig(**{"repair_after": 5.0, "failure_timeout": 3.0, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_schedule_is_deterministic_spaced_and_valid(kw: dict[str, object]) -> None:
    cfg = _cfg(**kw)
    n = 10
    for seed in range(600):
        sched = make_schedule(cfg, n, seed)
        assert sched == make_schedule(cfg, n, seed)  # a pure function of (seed, config)
        assert len(sched.faults) == n
        steps = [f.step for f in sched.faults]
        assert steps == sorted(steps) and steps[0] >= 3 and steps[-1] + 1 <= cfg.steps - 1
        assert all(b - a >= MIN_GAP for a, b in zip(steps, steps[1:], strict=False)), steps
        assert not sched.unsurvivable, [f.unsurvivable for f in sched.unsurvivable]  # default: survivable only
        assert sum(f.kind == "kill_coordinator" for f in sched.faults) <= MAX_COORDINATOR_KILLS
        specs = [parse_fault(s, i) for i, s in enumerate(sched.inject)]
        assert all(s.step is not None and s.step <= cfg.steps for s in specs)
        RunConfig(**{**kw, "inject": sched.inject}).validate()  # type: ignore[arg-type]
    assert make_schedule(cfg, n, 1).inject != make_schedule(cfg, n, 2).inject


class _FixedRng:
    """A campaign stream that always draws `value` (randrange) and the first element (choice)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def randrange(self, n: int) -> int:
        return self.value

    def choice(self, seq: Any) -> Any:
        return seq[0]


def test_what_each_scenario_draws_and_says() -> None:
    """Each scenario's specs, slots and description for fixed draws: a kill, a crash, two nodes and their
    fallback, a kill during recovery whose second victim is a survivor (renumbered after a shrink, or not)
    or the spare promoted into the slot, and its fallback to a plain kill with neither."""
    from phoenixft.distributed.topology import Topology
    from phoenixft.faults.scenarios import SCENARIOS, Draw

    ring = Topology(epoch=0, nodes=[f"n{i}" for i in range(4)], workers_per_node=1, replicas=2, resume_step=0)

    def draw(kind: str, value: int, spares: int, pairs: list[tuple[int, int]]) -> Any:
        d = Draw(i=1, s=5, n=4, world=4, ring=ring, phase="forward", rng=_FixedRng(value), cfg=_cfg(nodes=4),
                 spares=spares, ok_pairs=lambda s: pairs, pair_ok=lambda p, s: p in pairs)
        fallback = SCENARIOS[kind].fallback(d)  # (drawn only where the scenario can be: no fallback)
        return fallback, SCENARIOS[kind].draw(d) if fallback is None else None

    _, f = draw("kill", 2, 1, [])
    assert (f.kind, f.specs, f.lost, f.what) == ("kill", ("kill:node=2@step=5,phase=forward",), (2,),
                                                 "SIGKILL node 2 in its forward phase")
    _, f = draw("crash", 3, 1, [])
    assert (f.kind, f.specs, f.lost, f.what) == ("crash", ("crash:rank=3@step=5,phase=forward",), (),
                                                 "worker rank 3 exits in its forward phase (restarted in place)")
    _, f = draw("kill_coordinator", 0, 1, [])
    assert (f.specs, f.lost, f.what) == (("kill:coordinator@step=5,phase=forward",), (),
                                         "SIGKILL the coordinator when rank 0 is in its forward phase (restarted "
                                         "from its journal)")
    assert draw("two_nodes", 0, 1, [])[0] == "kill" and draw("two_nodes", 0, 1, [(1, 3)])[0] is None
    _, f = draw("two_nodes", 0, 1, [(1, 3)])
    assert (f.kind, f.specs, f.lost, f.what) == ("two_nodes", ("kill:node=1,3@step=5,phase=forward",), (1, 3),
                                                 "SIGKILL nodes 1 and 3 in the same step (forward phase)")
    _, f = draw("kill_during_recovery", 0, 0, [(0, 2)])  # no spare: node 2 is in slot 1 once node 0 is gone
    assert (f.kind, f.specs, f.lost) == ("kill_during_recovery", ("kill:node=0@step=5,phase=optimizer",
                                                                  "kill:node=1@step=5,phase=recovery"), (0, 2))
    assert f.what == ("SIGKILL node 0 in its optimizer phase, then node 2 (slot 1 once the job has shrunk) during "
                      "that recovery's state transfer"), f.what
    _, f = draw("kill_during_recovery", 2, 0, [(0, 2)])  # node 0 keeps its slot
    assert f.specs[1] == "kill:node=0@step=5,phase=recovery" and "then node 0 during" in f.what, f
    _, f = draw("kill_during_recovery", 2, 1, [])  # no survivor to lose with it: the spare promoted into slot 2
    assert (f.specs, f.lost) == (("kill:node=2@step=5,phase=optimizer", "kill:node=2@step=5,phase=recovery"), (2,))
    assert "then the spare promoted into slot 2 during" in f.what, f.what
    _, f = draw("kill_during_recovery", 1, 0, [])  # neither: a plain kill
    assert (f.kind, f.specs, f.lost, f.what) == ("kill", ("kill:node=1@step=5,phase=forward",), (1,),
                                                 "SIGKILL node 1 in its forward phase")


def test_each_drawn_fault_reports_what_it_is_and_whether_it_is_survivable() -> None:
    """The schedule's JSON form (the campaign report's `schedule`): every field of each fault, the survivable
    ones and the one drawn unsurvivable alike."""
    for allow in (False, True):
        sched = make_schedule(_cfg(nodes=3, spares=2, steps=60), 6, 4, allow_unsurvivable=allow)
        for f in sched.faults:
            assert f.to_json() == {"index": f.index, "kind": f.kind, "step": f.step, "inject": list(f.specs),
                                   "what": f.what, "lost_slots": list(f.lost), "survivable": f.unsurvivable is None,
                                   "unsurvivable": f.unsurvivable}
            assert f.to_json()["index"] >= 1 and f.what and f.specs
    bad = [f.to_json() for f in make_schedule(_cfg(nodes=3, spares=2, steps=60), 6, 4, True).faults if f.unsurvivable]
    assert bad and all(x["survivable"] is False and x["unsurvivable"] for x in bad), bad


@pytest.mark.parametrize("kw", [dict(nodes=3, replicas=1), dict(nodes=4, replicas=2), dict(nodes=5, replicas=2),
                                dict(nodes=6, replicas=1, racks=2)], ids=str)
def test_kill_during_recovery_without_spares_strikes_a_survivor_by_its_slot_after_the_shrink(
        kw: dict[str, object]) -> None:
    # no spare is promoted into the lost node's slot: the job shrinks and the survivors keep their order, so
    # the second kill must name the slot its node holds after the shrink, and that loss must be survivable
    cfg = _cfg(spares=0, steps=40, **kw)
    drawn = 0
    for seed in range(400):
        for f in make_schedule(cfg, 4, seed).faults:
            if f.kind != "kill_during_recovery":
                continue
            drawn += 1
            first, second = (parse_fault(x, i) for i, x in enumerate(f.specs))
            (j,), (slot,) = first.nodes, second.nodes
            other = slot + 1 if slot >= j else slot  # the node in that slot once j is dropped
            assert other != j and f.lost == tuple(sorted((j, other)))
            assert unsurvivable_reason(cfg, f.lost, f.step) is None, f
    assert drawn > 0 or kw["replicas"] == 1  # (with one replica no two nodes can be lost: a plain kill instead)


@pytest.mark.parametrize("kw", [dict(nodes=4, spares=0), dict(nodes=3, spares=1), dict(nodes=5, spares=1, replicas=2),
                                dict(nodes=4, spares=0, racks=2)], ids=str)
def test_without_repairs_faults_are_drawn_against_the_job_the_earlier_ones_leave(kw: dict[str, object]) -> None:
    # --repair-after 0: a loss takes a spare while there is one, then shrinks the job for good; a fault that
    # names a slot the job no longer has never fires (the campaign FAILed), and a gated one waits in vain
    cfg = _cfg(steps=40, repair_after=0.0, **kw)
    for seed in range(300):
        nodes, spares, gated_after_loss = cfg.nodes, cfg.spares, False
        for f in make_schedule(cfg, 5, seed).faults:
            for i, x in enumerate(f.specs):
                spec = parse_fault(x, i)
                assert all(slot < nodes for slot in spec.nodes), (seed, f, nodes)
                assert spec.rank is None or spec.rank < nodes * cfg.workers_per_node, (seed, f)
                gated_after_loss |= nodes < cfg.nodes and spec.wait > 0
            lost = {"kill": 1, "hang": 1, "corrupt": 1, "two_nodes": 2, "kill_during_recovery": 2}.get(f.kind, 0)
            nodes -= max(0, lost - spares)
            spares = max(0, spares - lost)
            assert nodes >= 2, (seed, f)
        assert not gated_after_loss, seed


def test_a_mesh_with_repairs_survives_losses_without_spares() -> None:
    cfg = _cfg(nodes=4, pp=2, spares=0, steps=40)  # the coordinator waits for the repaired node (--repair-after 5)
    assert unsurvivable_reason(cfg, (1,), 10) is None
    no_repairs = _cfg(nodes=4, pp=2, spares=0, steps=40, repair_after=0.0)
    assert unsurvivable_reason(no_repairs, (1,), 10) is None  # it drops node 1's data-parallel replica
    assert "no replica is left whole" in (unsurvivable_reason(no_repairs, (0, 1), 10) or "")  # both replicas hit
    for seed in range(100):
        assert not make_schedule(cfg, 4, seed).unsurvivable


def test_chaos_on_a_mesh_draws_spare_less_losses_and_its_oracle_is_the_planners() -> None:
    """Without spares or repairs a mesh's campaign draws node losses (each drops a data-parallel replica) while a
    whole replica would be left, and its survivability oracle drops the same slots as the planner does."""
    import random

    from phoenixft.distributed.topology import Topology
    from phoenixft.faults.chaos import mesh_gone
    from phoenixft.recovery.planner import Plan, PlanInput, mesh_membership

    cfg = _cfg(nodes=6, pp=2, spares=0, steps=60, repair_after=0.0)
    drawn = 0
    for seed in range(60):
        sched = make_schedule(cfg, 4, seed)
        assert not [f for f in sched.faults if f.unsurvivable], seed
        drawn += sum(1 for f in sched.faults if f.kind in ("kill", "hang", "two_nodes"))
    assert drawn >= 60, drawn
    rng = random.Random(4)
    for _ in range(2000):
        tp, pp, ring = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.randint(1, 4)
        if tp * pp == 1:
            continue
        c = _cfg(nodes=pp * ring, tp=tp, pp=pp, spares=rng.randint(0, 2), steps=40, repair_after=0.0)
        lost = {x for x in range(c.nodes) if rng.random() < 0.3} or {0}
        if len(lost) <= c.spares:
            continue
        nodes = [f"n{i}" for i in range(c.nodes)]
        topo = Topology(epoch=0, nodes=nodes, workers_per_node=tp, replicas=1, resume_step=0, tp=tp, pp=pp)
        cut = mesh_membership(PlanInput(old=topo, dead={nodes[x] for x in lost}, restarted=set(), descs={},
                                        pool=[f"s{i}" for i in range(c.spares)], target_nodes=c.nodes, replicas=1,
                                        racks=1))
        gone = mesh_gone(c, lost)
        if gone is None:
            assert isinstance(cut, Plan) and "every data-parallel replica" in cut.error, cut
        else:  # the slots whose copies leave: the dead ones, and those of the columns it drops
            assert not isinstance(cut, Plan), cut
            _members, _promoted, dropped, released = cut
            assert gone == lost | {nodes.index(n) for n in dropped + released}, (lost, gone, cut)


def test_every_kind_is_drawn_and_counts_are_exact() -> None:
    cfg = _cfg(nodes=4, spares=2, steps=400, replicas=2)  # (a corrupt replica needs a second copy to survive)
    for seed in range(300):
        for n in (1, 3, 7, 12, 50):
            sched = make_schedule(cfg, n, seed)
            assert len(sched.faults) == n and [f.index for f in sched.faults] == list(range(1, n + 1))
            if n >= len(KINDS):
                assert {f.kind for f in sched.faults} == set(KINDS)


def test_survivability_classification() -> None:
    four = _cfg(nodes=4, spares=2, steps=40)
    assert unsurvivable_reason(four, {0, 2}, 10) is None  # node 1 keeps 0's replica, node 3 keeps 2's
    why = unsurvivable_reason(four, {1, 2}, 10)  # node 2 keeps node 1's only replica
    assert why and "pp0.tp0.dp1of4" in why and "no persistent tier" in why
    assert unsurvivable_reason(_cfg(nodes=4, spares=2, steps=40, replicas=2), {1, 2}, 10) is None
    assert unsurvivable_reason(_cfg(nodes=4, spares=2, steps=40, racks=2), {0, 1}, 10) is None  # a whole rack
    assert unsurvivable_reason(_cfg(nodes=4, spares=2, steps=40, racks=2), {0, 2}, 10)
    persist = _cfg(nodes=4, spares=2, steps=40, persist_every=4, persist_dir="x")
    assert unsurvivable_reason(persist, {1, 2}, 20) is None  # the persistent tier has it
    assert "no complete persistent checkpoint yet" in (unsurvivable_reason(persist, {1, 2}, 5) or "")
    # three nodes, one replica: every pair holds a replica of the other, so no pair is drawn by default
    three = _cfg(nodes=3, spares=2, steps=60)
    drawn = [f for s in range(500) for f in make_schedule(three, 12, s).faults]
    assert "two_nodes" not in {f.kind for f in drawn}
    assert all(len(set(f.lost)) == 1 for f in drawn if f.kind == "kill_during_recovery")  # the spare itself
    risky = [f for s in range(500) for f in make_schedule(three, 12, s, allow_unsurvivable=True).faults
             if f.unsurvivable]
    assert risky and all(f.kind in ("two_nodes", "kill_during_recovery", "corrupt") for f in risky)
    # a corrupt replica is the copy recovery needs: with one replica, rejecting it loses the owner's shard, so it
    # is drawn only with --allow-unsurvivable (and is then unsurvivable), or with a second replica
    assert "corrupt" not in {f.kind for f in drawn}
    assert all(f.unsurvivable for f in risky if f.kind == "corrupt") and any(f.kind == "corrupt" for f in risky)
    assert "'corrupt replica' not drawn" in " ".join(make_schedule(three, 12, 0).notes)
    two = [f for s in range(100) for f in make_schedule(_cfg(nodes=3, spares=2, steps=60, replicas=2), 12, s).faults
           if f.kind == "corrupt"]
    assert two and not any(f.unsurvivable for f in two)
    assert all(f.specs[0].split("@step=")[1].split(",")[0] == f.specs[1].split("@step=")[1].split(",")[0] == str(f.step)
               for f in two)  # the corruption and the owner's kill in the same step: the copy is recovery's
    # four nodes: pairs drawn by default never hold each other's replicas; with --allow-unsurvivable some do
    pairs = [f for s in range(500) for f in make_schedule(four, 12, s).faults if len(f.lost) == 2]
    assert pairs and all(abs(f.lost[0] - f.lost[1]) == 2 for f in pairs)
    assert any(f.unsurvivable for s in range(200) for f in make_schedule(four, 12, s, allow_unsurvivable=True).faults)


def test_bad_campaigns_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match="need --steps >= 40"):
        make_schedule(_cfg(nodes=4, steps=30), 12, 1)
    with pytest.raises(UserError, match="--protect phoenix"):
        make_schedule(_cfg(nodes=4, steps=30, protect="none", spares=0), 2, 1)
    assert main(["chaos", "--nodes", "3", "--steps", "10", "--faults", "5"]) == 2
    assert main(["chaos", "--faults", "0"]) == 2
    assert main(["chaos", "--repair-after", "-1"]) == 2
    assert main(["chaos", "--nodes", "1"]) == 2  # the campaign's own message, not --replicas' (need replicas < 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(ln.startswith("phoenixft chaos: error: ") for ln in err), err
    assert "--nodes=1 is invalid: a chaos campaign needs at least 2 nodes" in err[-1], err[-1]


@pytest.mark.parametrize(
    "kw,needles,wrong",
    [
        # a tensor-parallel job drops whole data-parallel replicas; losing both of its two, with no spare and no
        # repairs, leaves none whole
        (dict(nodes=2, tp=2, spares=0, repair_after=0.0),
         ["every data-parallel replica of the 2x1 (tp x pp) mesh loses a node",
          "(use more --nodes, --spares >= 2 or --repair-after S, or"], ["--nodes >= 4", "persistent"]),
        # a persistent tier is configured: the fallback lacks the spares to refill the job after losing two
        (dict(nodes=3, spares=1, persist_every=4, persist_dir="ckpt"),
         ["--persist-every 4) needs a spare per lost node to refill the job (2), but --spares is 1",
          "(use more --nodes or --replicas, --spares >= 2, or"], ["no persistent tier", "--nodes >= 4"]),
        (dict(nodes=3, spares=2), ["losing any two nodes loses every copy of a shard with --replicas 1",
                                   "no persistent tier", "(use more --nodes or --replicas, --persist-every, or"],
         ["--spares >= 2"]),
        (dict(nodes=3, spares=1), ["no persistent tier", "--persist-every with --spares >= 2"], []),
        # the only checkpoint is not complete before the last step a fault can come at
        (dict(nodes=3, spares=2, persist_every=56, persist_dir="ckpt"),
         ["no persistent checkpoint (--persist-every 56) is complete before step 58",
          "a smaller --persist-every or more --steps"], ["no persistent tier", "--spares >= 2"]),
    ],
    ids=["tp2-spares1", "persist-spares1", "no-tier", "no-tier-spares1", "persist-too-late"],
)
def test_note_on_two_nodes_says_the_real_condition(kw: dict[str, object], needles: list[str],
                                                   wrong: list[str]) -> None:
    sched = make_schedule(_cfg(steps=60, **kw), 5, 1)
    (note,) = [n for n in sched.notes if n.startswith("'two nodes at once' not drawn")]
    assert all(x in note for x in needles), note
    assert not any(x in note for x in wrong), note
    why = unsurvivable_reason(_cfg(steps=60, **kw), (0, 1), 58)
    assert why and ("every data-parallel replica of the 2x1 (tp x pp) mesh loses a node" in why) == ("tp" in kw)


def test_recovery_phase_fault_spec() -> None:
    f = parse_fault("kill:node=2@step=9,phase=recovery")
    assert (f.kind, f.nodes, f.step, f.phase) == ("kill", (2,), 9, "recovery")
    for bad in ("hang:node=1@step=4,phase=recovery", "kill:coordinator@step=4,phase=recovery",
                "kill:rack=0@step=4,phase=recovery", "crash:rank=0@step=3,phase=recovery"):
        with pytest.raises(UserError):
            parse_fault(bad)


def test_repair_queue_hands_out_new_spare_ids_once_per_lost_node() -> None:
    now = [0.0]
    q = RepairQueue(5.0, first_index=2, clock=lambda: now[0])
    q.lost("n1")
    q.lost("n1")  # exit and fence of the same node: one repair
    now[0] = 3.0
    q.lost("s0")
    assert q.due({"s0", "s1"}) == []
    now[0] = 5.0
    assert q.due({"s0", "s1", "s2"}) == [("s3", "n1")]
    now[0] = 9.0
    assert q.due({"s0", "s1", "s2", "s3"}) == [("s4", "s0")]
    off = RepairQueue(0.0, first_index=1, clock=lambda: now[0])
    off.lost("n0")
    now[0] = 1e9
    assert off.due(set()) == []


def test_verdicts_from_reports() -> None:
    cfg = _cfg(nodes=4, spares=2, steps=20)
    sched = make_schedule(cfg, 2, 3)
    ref = {"state": "done", "loss": [3.0, 2.0], "final_state_sha256": "a"}
    done = {"state": "done", "steps_completed": 20, "loss": [3.0, 2.0], "final_state_sha256": "a", "recoveries": []}
    assert [f.kind for f in sched.faults] == ["two_nodes", "kill_coordinator"]
    fired = [{"kind": "coordinator_restarted", "t": 100.0}]
    fired += [{"kind": "fault", "spec": s, "index": i, "epoch": 0, "t": float(i)} for i, s in enumerate(sched.inject)]
    after = [{"step": 20, "epoch": 1}]
    assert judge(sched, cfg, ref, done, fired, after)["verdict"] == "pass"
    v = judge(sched, cfg, ref, done, fired[:-1], after)  # a drawn fault that never fired: not a pass
    assert v["verdict"] == "fail" and "never fired" in v["reason"], v["reason"]
    assert judge(sched, cfg, ref, {**done, "final_state_sha256": "b"}, fired, after)["verdict"] == "fail"
    shrunk = {**done, "final_state_sha256": "b", "loss": [3.0, 2.0001],
              "recoveries": [{"action": "shrink", "invariants": dict.fromkeys(("I1", "I2", "I3", "I4"), True),
                              "lost_steps": 1}]}
    v = judge(sched, cfg, ref, shrunk, fired, after)
    assert v["verdict"] == "pass" and v["shrank"] and v["max_loss_rel_dev"] == pytest.approx(5e-5)
    assert judge(sched, cfg, ref, {**shrunk, "loss": [3.0, 2.01]}, fired, after)["verdict"] == "fail"
    # the job had shrunk to 3 nodes (n0, n2, n3) when n0 and n2 died together: on that ring n2 held n0's
    # only replica, so the failure is by design even though the pair was survivable on 4 nodes
    events = [{"kind": "epoch", "epoch": 2, "nodes": ["n0", "n2", "n3"], "t": 10.0},
              {"kind": "fault", "fault": "kill", "spec": "kill:node=0,1@step=9", "index": 0, "node": "n0", "t": 11.0},
              {"kind": "fault", "fault": "kill", "spec": "kill:node=0,1@step=9", "index": 0, "node": "n2", "t": 11.0}]
    failed = {"state": "failed", "error": "in-memory state lost in epoch 2 (lost shards: pp0.tp0.dp0of3) and no "
              "persistent tier (--persist-every)", "loss": [3.0], "recoveries": []}
    v = judge(sched, cfg, ref, failed, events, [{"step": 8, "epoch": 2}])
    assert v["verdict"] == "unsurvivable-by-design" and "after a shrink" in v["reason"], v["reason"]
    events[0]["nodes"] = ["n0", "s1", "n2", "n3"]  # on 4 nodes s1 keeps n0's replica, n3 keeps n2's: a fail
    assert judge(sched, cfg, ref, failed, events, [{"step": 8, "epoch": 2}])["verdict"] == "fail"
    # a campaign may end with a host quarantined: named in the verdict; a shrink for it is judged as any shrink,
    # and a run that then ran out of spares is the policy at work, not a defect
    q = {"quarantine": {"quarantined": ["vm/n1"], "hosts": []}}
    v = judge(sched, cfg, ref, {**shrunk, **q}, fired, after)
    assert v["verdict"] == "pass" and v["quarantined_hosts"] == ["vm/n1"]
    assert "quarantined       vm/n1" in format_verdict(v, ref, {**shrunk, **q}, {"total": 1, "reference": 0,
                                                                                  "campaign": 1})
    lost = {"state": "failed", "error": "every node is lost (n0) and no spare is ready", "loss": [3.0],
            "recoveries": []}
    assert judge(sched, cfg, ref, lost, fired, after)["verdict"] == "fail"
    v = judge(sched, cfg, ref, {**lost, **q}, fired, after)
    assert v["verdict"] == "unsurvivable-by-design" and "vm/n1 were quarantined" in v["reason"], v["reason"]


def _chaos(tmp: Path, capsys: pytest.CaptureFixture[str],
           *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    """`phoenixft chaos` in this process (as `run()` runs its jobs; a new interpreter would spend seconds
    importing torch and starting its zygote first): its exit code, stdout and stderr, and its report."""
    from phoenixft.cli.main import main

    report = tmp / "chaos.json"
    argv = ["chaos", "--quiet", "--micro-batch", "1", "--run-dir", str(tmp / "runs"), "--report", str(report), *args]
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    p = subprocess.CompletedProcess(argv, rc, out, err)
    rep = json.loads(report.read_text())
    for run_id in (rep["run"].get("run_id"), rep["reference"].get("run_id")):
        if run_id:
            assert processes_with(run_id) == [], "processes outlived the campaign"
            assert list(Path("/dev/shm").glob(f"phoenixft-{run_id}-*")) == [], "shared memory outlived it"
    return p, rep


def test_campaign_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # seed 13 on this setup: crash (step 3), corrupt replica + owner killed (8), kill during recovery (11); two
    # replicas, so the owner's shard keeps a good copy when the corrupted one is rejected; 3 spares cover the 3
    # lost nodes, so the job never shrinks and must end bitwise equal to the reference
    p, rep = _chaos(tmp_path, capsys, "--nodes", "3", "--spares", "3", "--replicas", "2", "--steps", "16",
                    "--faults", "3", "--seed", "13")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert [f["kind"] for f in rep["schedule"]] == ["crash", "corrupt", "kill_during_recovery"]
    assert rep["verdict"] == "pass", rep["reason"]
    assert rep["faults"] == rep["recovered"] == 3 and rep["injected"] == 3
    assert rep["bitwise_equal"] is True and rep["shrank"] is False and rep["max_loss_rel_dev"] == 0.0
    assert rep["run"]["final_state_sha256"] == rep["reference"]["final_state_sha256"]
    # the corrupted copy was the one recovery would have used, and it was rejected (never loaded)
    (corrupt,) = [p for p in rep["per_fault"] if p["kind"] == "corrupt"]
    assert corrupt["corrupt_rejected"] is True and len(corrupt["corrupted"]) == 1, corrupt
    assert corrupt["corrupted"] == [["pp0.tp0.dp2of3", 7]], corrupt  # node 0's copy of node 2's shard, step 7
    (rec,) = [r for r in rep["run"]["recoveries"] if ["pp0.tp0.dp2of3", 7] in r["replicas_rejected"]]
    assert rec["resumed_step"] == 7 and rec["dead"] == ["n2"], rec  # from the other holder's copy of step 7
    assert rep["wall_s"] > 0 and rep["run"]["state"] == "done"
    assert "chaos verdict: PASS" in p.stdout and "#" in p.stdout.splitlines()[1]
    fired = {f["spec"]: f for f in rep["run"]["faults"]}
    assert "recovery" in fired["kill:node=0@step=11,phase=recovery"]  # fired mid state transfer


@pytest.mark.slow  # (a minute: two runs of a 6-node pipeline)
def test_a_mesh_campaign_without_spares_or_repairs_drops_replicas_and_passes(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """PP=2 x DP=3, no spares, no repairs (seed 1 on this setup: nodes 2 and 5 at once at step 7, then a crash):
    the two lost nodes are one data-parallel replica's, the mesh drops it and trains on; the verdict passes
    within the shrink's tolerance."""
    p, rep = _chaos(tmp_path, capsys, "--nodes", "6", "--pp", "2", "--spares", "0", "--repair-after", "0",
                    "--steps", "20", "--faults", "2", "--seed", "1")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert [f["kind"] for f in rep["schedule"]] == ["two_nodes", "crash"], rep["schedule"]
    assert rep["verdict"] == "pass", rep["reason"]
    assert rep["faults"] == rep["recovered"] == 2 and rep["shrank"] is True
    shrink = [r for r in rep["run"]["recoveries"] if r["action"] == "shrink"]
    assert len(shrink) == 1 and shrink[0]["dead"] == ["n2", "n5"] and shrink[0]["released"] == [], shrink


def test_a_campaign_that_strikes_one_host_again_and_again_passes_with_every_fault_fired(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seed 7 on 2 nodes + 1 spare, repairs after 1 s: a hang of slot 1 (n1), a kill of slot 1 (s0, in it since),
    a kill of slot 1 (s1: n1's host repaired) and a kill during that recovery: the simulated hosts of n1 and s0
    are struck twice each, and repaired nodes return and are promoted (or grow the job back where a kill came
    before the repair was ready). The quarantine never holds an injected fault against a host: the campaign
    passes with every drawn fault fired, the hosts' failures all listed as injected."""
    p, rep = _chaos(tmp_path, capsys, "--nodes", "2", "--spares", "1", "--steps", "16", "--faults", "3",
                    "--seed", "7", "--model", "nano", "--repair-after", "1")
    assert [f["kind"] for f in rep["schedule"]] == ["hang", "kill", "kill_during_recovery"], rep["schedule"]
    assert p.returncode == 0 and rep["verdict"] == "pass", (rep["verdict"], rep["reason"], p.stdout[-3000:])
    assert rep["faults"] == rep["recovered"] == 3 and rep["run"]["faults_not_fired"] == []
    assert rep["quarantined_hosts"] == [] and rep["run"]["quarantine"]["quarantined"] == []
    hosts = rep["run"]["quarantine"]["hosts"]
    struck = {h["host"]: [f["injected"] for f in h["failures"]] for h in hosts}
    assert max(len(v) for v in struck.values()) >= 2 and all(all(v) for v in struck.values()), struck
    repaired = [n for r in rep["run"]["recoveries"] for n in r["promoted"] if int(n[1:]) >= 1]  # s1, s2, ...
    assert repaired, rep["run"]["recoveries"]


def test_unsurvivable_schedule_is_reported_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # seed 2, one fault, --allow-unsurvivable: nodes 0 and 1 die together, and node 1 keeps node 0's only replica
    p, rep = _chaos(tmp_path, capsys, "--nodes", "3", "--spares", "2", "--steps", "8", "--faults", "1", "--seed", "2",
                    "--allow-unsurvivable")
    assert p.returncode == 3, p.stdout + p.stderr[-3000:]
    assert rep["verdict"] == "unsurvivable-by-design"
    assert rep["schedule"][0]["inject"] == ["kill:node=0,1@step=3,phase=optimizer,wait=60"]
    assert "UNSURVIVABLE BY DESIGN" in p.stdout and "chaos verdict: UNSURVIVABLE-BY-DESIGN" in p.stdout
    assert rep["run"]["state"] == "failed" and "lost shards: pp0.tp0.dp0of3" in rep["run"]["error"]
    assert rep["reference"]["state"] == "skipped"  # nothing to compare: it can never be a pass


def test_a_resumed_campaign_draws_its_faults_after_the_checkpoint_and_counts_it_as_a_tier() -> None:
    """`phoenixft chaos --resume DIR`: the run starts after the checkpoint's step, so faults drawn before it
    never fired and failed the campaign ("never fired: its node ... was not in the job"); and the checkpoint
    the run resumed from is a persistent tier (the fallback uses it), so pairs are survivable with spares."""
    cfg = _cfg(nodes=3, spares=2, steps=40, resume="ckpt")
    for seed in range(200):
        sched = make_schedule(cfg, 6, seed, start=12)
        assert all(f.step >= 12 + 3 for f in sched.faults), [f.step for f in sched.faults]
        assert not sched.unsurvivable
    assert unsurvivable_reason(cfg, (0, 1), 15) is None  # every copy of a shard lost: back to --resume's step
    assert unsurvivable_reason(_cfg(nodes=3, spares=2, steps=40), (0, 1), 15) is not None
    with pytest.raises(UserError, match="--resume starts after step 30"):
        make_schedule(cfg, 6, 1, start=30)


def test_ctrl_c_stops_the_campaign_without_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C (or SIGTERM) during a campaign's run is not judged like a lost run (`chaos verdict: FAIL`, a
    report saying so, exit code 1): it stops the campaign: no verdict, no report, exit code 130."""
    import phoenixft.runtime.launcher
    from phoenixft.faults.chaos import run_campaign

    calls: list[str] = []

    def fake_run_job(cfg: RunConfig, *a: object, **kw: object) -> dict[str, object]:
        calls.append(cfg.run_dir)
        done = {"state": "done", "steps_completed": cfg.steps, "final_state_sha256": "ab", "loss": [1.0] * cfg.steps,
                "run_dir": cfg.run_dir}
        return done if len(calls) == 1 else {"state": INTERRUPTED, "run_dir": cfg.run_dir}

    monkeypatch.setattr(phoenixft.runtime.launcher, "run_job", fake_run_job)
    cfg = _cfg(nodes=2, spares=1, steps=30, run_dir=str(tmp_path / "c"))
    with pytest.raises(KeyboardInterrupt):
        run_campaign(cfg, 1, 1, report=str(tmp_path / "c.json"))
    assert len(calls) == 2 and not (tmp_path / "c.json").exists()
    assert "verdict" not in capsys.readouterr().out
    calls.clear()
    monkeypatch.setattr(phoenixft.runtime.launcher, "run_job",
                        lambda cfg, *a, **kw: calls.append(cfg.run_dir) or {"state": INTERRUPTED})
    with pytest.raises(KeyboardInterrupt):  # stopped during the reference: the campaign run is not started
        run_campaign(cfg, 1, 1)
    assert len(calls) == 1
    # through the command line: exit code 130, like `phoenixft run`
    assert main(["chaos", "--nodes", "2", "--spares", "1", "--steps", "30", "--faults", "1",
                 "--run-dir", str(tmp_path / "d")]) == 130


def test_ctrl_c_stops_the_demo_and_a_run_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`phoenixft demo` went on to its next run after a Ctrl-C (three of them to stop it); `phoenixft run`
    stopped by the user exited 1 like a failed run."""
    import phoenixft.runtime.demo
    import phoenixft.runtime.launcher

    calls: list[str] = []

    def fake_run_job(cfg: RunConfig, *a: object, **kw: object) -> dict[str, object]:
        calls.append(cfg.run_dir)
        return {"state": INTERRUPTED, "run_dir": cfg.run_dir}

    monkeypatch.setattr(phoenixft.runtime.demo, "run_job", fake_run_job)
    monkeypatch.setattr(phoenixft.runtime.launcher, "run_job", fake_run_job)
    monkeypatch.setenv("PHOENIXFT_ZYGOTE", "0")
    assert main(["demo", "--steps", "4", "--run-dir", str(tmp_path / "demo")]) == 130
    assert len(calls) == 1
    assert main(["run", "--steps", "2", "--run-dir", str(tmp_path / "run")]) == 130
    assert main(["coordinator", "--host", "127.0.0.1", "--port", "0", "--run-dir", str(tmp_path / "head")]) == 130


@pytest.mark.parametrize("argv, line", [
    (["--kill-node", "7"], "--kill-node=7 is invalid: must be in 0..2 (--nodes 3)"),
    (["--kill-step", "99"], "--kill-step=99 is invalid: must be in 1..30"),
    (["--phase", "sideways"], "--phase='sideways' is invalid: one of forward, backward, replicate, optimizer"),
    (["--steps", "1"], "--steps=1 is invalid: the demo kills a node mid-run, so need --steps >= 2"),
    (["--nodes", "1"], "--nodes=1 is invalid"),
])
def test_bad_demo_flags_are_named_as_given(argv: list[str], line: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`phoenixft demo --kill-node 7` said "--inject='kill:node=7@step=15,phase=backward' is invalid": a flag
    the user never gave; --steps 1 made it a kill at step 0."""
    assert main(["demo", *argv, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0] and "--inject" not in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_a_large_job_gets_its_schedule_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair of nodes is checked for survivability; the replica ring was built anew per pair, so a
    campaign over a few thousand nodes never got past drawing its schedule (O(n^3)). The ring is built once
    per shape the job takes (the job as each fault leaves it), whatever its size: counted, not timed."""
    from phoenixft.faults import chaos

    built: list[int] = []
    real = chaos.Topology

    def counted(*a: Any, **k: Any) -> Any:
        built.append(len(k.get("nodes", ())))
        return real(*a, **k)

    monkeypatch.setattr(chaos, "Topology", counted)
    chaos._ring.cache_clear()
    try:
        sched = make_schedule(RunConfig(nodes=200, spares=2, steps=40, model="tiny", replicas=1), 4, seed=3)
    finally:
        chaos._ring.cache_clear()
    assert len(sched.faults) == 4
    assert 1 <= len(built) <= 4 + 1, f"{len(built)} rings built for {200 * 199 // 2} pairs of nodes"


def test_a_local_run_that_cannot_fit_this_machine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`phoenixft run --nodes 100000` (or chaos, demo) started forking agents until the OOM killer came."""
    from phoenixft.errors import UserError
    from phoenixft.runtime import launcher

    monkeypatch.setattr(launcher, "_mem_total_mib", lambda: 16 * 1024)
    refused = r"--nodes=200 is invalid here: 201 local node\(s\) .* this machine has 16.0 GiB"
    with pytest.raises(UserError, match=refused):
        launcher.check_mode(RunConfig(nodes=200, spares=1), local=True)
    launcher.check_mode(RunConfig(nodes=100, spares=1), local=True)  # 12.3 GiB of processes: fits
    launcher.check_mode(RunConfig(nodes=200, spares=1), local=False)  # the head starts no agents
    monkeypatch.setattr(launcher, "_mem_total_mib", lambda: None)  # unknown: not refused
    launcher.check_mode(RunConfig(nodes=200, spares=1), local=True)


def test_a_coordinator_kill_counts_as_recovered_only_once_a_coordinator_restarted_after_it() -> None:
    cfg = _cfg(nodes=4, spares=2, steps=20, replicas=2)
    sched = make_schedule(cfg, 2, 0)  # seed 0: a coordinator kill at step 3, then a corrupt replica
    assert [f.kind for f in sched.faults] == ["kill_coordinator", "corrupt"]
    ref = {"state": "done", "loss": [3.0, 2.0], "final_state_sha256": "a"}
    inv = {k: True for k in ("I1", "I2", "I3", "I4")}
    done = {"state": "done", "steps_completed": 20, "loss": [3.0, 2.0], "final_state_sha256": "a",
            "recoveries": [{"action": "swap", "epoch": 1, "invariants": inv, "lost_steps": 1, "resumed_step": 10,
                            "replicas_rejected": [["pp0.tp0.dp0of4", 10]]}]}
    fired = [{"kind": "corrupted_replica", "spec": s, "shard": 0, "step": 10} if s.startswith("corrupt") else
             {"kind": "fault", "spec": s, "index": i, "epoch": 0, "t": 10.0 + i} for i, s in enumerate(sched.inject)]
    after = [{"step": 20, "epoch": 1}]
    restarted = {"kind": "coordinator_restarted", "epoch": 0}
    v = judge(sched, cfg, ref, done, [*fired, {**restarted, "t": 10.5}], after)
    assert v["verdict"] == "pass" and v["recovered"] == 2, v
    # the run finished, but nothing shows the coordinator came back: no restart, or only one before the kill
    for evs in (fired, [{**restarted, "t": 9.0}, *fired]):
        v = judge(sched, cfg, ref, done, evs, after)
        assert v["verdict"] == "fail" and "coordinator kill(s) #1" in v["reason"], v["reason"]
        assert v["recovered"] == 1 and [p["recovered"] for p in v["per_fault"]] == [False, True]


@pytest.mark.parametrize("inv", [None, {}, {"I1": True, "I2": True, "I3": True}])
def test_a_recovery_without_its_four_invariants_fails_the_campaign(inv: dict[str, bool] | None) -> None:
    cfg = _cfg(nodes=4, spares=2, steps=20)
    sched = make_schedule(cfg, 2, 3)
    ref = {"state": "done", "loss": [3.0, 2.0], "final_state_sha256": "a"}
    rec: dict[str, object] = {"action": "swap", "epoch": 1, "lost_steps": 1}
    if inv is not None:
        rec["invariants"] = inv
    done = {"state": "done", "steps_completed": 20, "loss": [3.0, 2.0], "final_state_sha256": "a", "recoveries": [rec]}
    fired = [{"kind": "fault", "spec": s, "index": i, "epoch": 0, "t": float(i)} for i, s in enumerate(sched.inject)]
    fired.append({"kind": "coordinator_restarted", "t": 100.0})
    v = judge(sched, cfg, ref, done, fired, [{"step": 20, "epoch": 1}])
    assert v["verdict"] == "fail" and "invariant" in v["reason"], v
    rec["invariants"] = {k: True for k in ("I1", "I2", "I3", "I4")}
    assert judge(sched, cfg, ref, done, fired, [{"step": 20, "epoch": 1}])["verdict"] == "pass"


def test_a_corrupt_fault_passes_only_when_recovery_rejected_the_copy_it_corrupted() -> None:
    cfg = _cfg(nodes=4, spares=2, steps=20, replicas=2)
    sched = make_schedule(cfg, 2, 0)  # seed 0: its corrupt fault damages node 1's copy of node 0's shard
    corrupt = sched.faults[1]
    # the copy it damages (received during step 11: that of step 10) is the one a kill of its owner in its
    # optimizer step 11 makes recovery resume from
    assert corrupt.specs == ("corrupt:node=1@step=11,wait=60", "kill:node=0@step=11,phase=optimizer,wait=60")
    assert corrupt.lost == (0,) and corrupt.unusable == (1,)
    assert corrupt.what == ("corrupt node 1's replica of node 0's shard of step 10, then SIGKILL node 0 in its "
                            "optimizer step 11: recovery's copy of step 10 is the corrupt one, which the checksum "
                            "must reject"), corrupt.what
    ref = {"state": "done", "loss": [3.0, 2.0], "final_state_sha256": "a"}
    inv = {k: True for k in ("I1", "I2", "I3", "I4")}

    def verdict(rejected: list[list[object]], shards: tuple[int, ...] = (0,), resumed: int = 10) -> dict[str, Any]:
        done = {"state": "done", "steps_completed": 20, "loss": [3.0, 2.0], "final_state_sha256": "a",
                "recoveries": [{"action": "swap", "epoch": 1, "invariants": inv, "lost_steps": 0,
                                "resumed_step": resumed, "replicas_rejected": rejected}]}
        evs: list[dict[str, Any]] = [{"kind": "coordinator_restarted", "t": 20.0}]
        for i, spec in enumerate(sched.inject):
            if spec.startswith("corrupt"):
                evs += [{"kind": "corrupted_replica", "spec": spec, "shard": x, "step": 10, "t": 11.0} for x in shards]
            else:
                evs.append({"kind": "fault", "spec": spec, "index": i, "epoch": 0, "t": 10.0 + i})
        return judge(sched, cfg, ref, done, evs, [{"step": 20, "epoch": 1}])

    v = verdict([["pp0.tp0.dp0of4", 10]])
    assert v["verdict"] == "pass", v["reason"]
    assert v["per_fault"][1]["corrupted"] == [["pp0.tp0.dp0of4", 10]] and v["per_fault"][1]["corrupt_rejected"]
    # nothing rejected (the copy was loaded, or never a candidate), or another step's copy or shard rejected
    for rejected in ([], [["pp0.tp0.dp0of4", 9]], [["pp0.tp0.dp1of4", 10]]):
        v = verdict(rejected)
        assert v["verdict"] == "fail" and "corrupt fault(s) #2" in v["reason"], (rejected, v["reason"])
    # rejected by a recovery that resumed from a newer step: that copy was never a candidate (every descriptor
    # verifies both halves), so the fault did not bite; one that went back further because of it did
    v = verdict([["pp0.tp0.dp0of4", 10]], resumed=11)
    assert v["verdict"] == "fail" and "corrupt fault(s) #2" in v["reason"], v["reason"]
    assert verdict([["pp0.tp0.dp0of4", 10]], resumed=9)["verdict"] == "pass"
    # a copy of a shard whose owner lives on is never needed: only the killed owner's copy must be rejected
    assert verdict([["pp0.tp0.dp0of4", 10]], shards=(0, 3))["verdict"] == "pass"
