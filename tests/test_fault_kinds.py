"""The fault-kind registry (faults/kinds.py): every kind writes its specs back as text that parses to the
same spec, and the dispatch it carries (where a fault fires, whom it strikes, what a mode refuses)."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable

import pytest

from phoenixft.distributed.topology import Topology
from phoenixft.errors import UserError
from phoenixft.faults.kinds import KILL_PHASES, KINDS, Point
from phoenixft.faults.spec import parse_fault


def _nodes(rng: random.Random, most: int = 3) -> str:
    return "node=" + ",".join(map(str, rng.sample(range(64), rng.randint(1, most))))


def _secs(rng: random.Random) -> str:
    return rng.choice(["0.5", "60", "1e-3", repr(rng.uniform(0.001, 1e4)), str(rng.randint(1, 999))])


def _opt(rng: random.Random, item: str) -> list[str]:
    return [item] if rng.random() < 0.5 else []


def _kill(rng: random.Random) -> str:
    step = f"step={rng.randint(0, 10**6)}"
    form = rng.choice(["nodes", "rack", "coordinator", "etcd", "recovery", "phase_recovery"])
    if form == "etcd":
        return f"kill:etcd={rng.choice(['leader', str(rng.randint(0, 4))])}@{step}"
    if form == "recovery":
        target = rng.choice([_nodes(rng), f"rack={rng.randint(0, 9)}"])
        return f"kill:{target}@recovery={rng.randint(0, 99)}" + "".join(
            f",phase={p}" for p in _opt(rng, rng.choice(KILL_PHASES)))
    if form == "phase_recovery":
        return f"kill:{_nodes(rng)}@{step},phase=recovery"
    target = {"nodes": _nodes(rng), "rack": f"rack={rng.randint(0, 9)}", "coordinator": "coordinator"}[form]
    when = [step, *_opt(rng, f"phase={rng.choice(KILL_PHASES)}"), *_opt(rng, f"wait={_secs(rng)}")]
    rng.shuffle(when)
    return f"kill:{target}@{','.join(when)}"


def _at_step(kind: str, target: Callable[[random.Random], str]) -> Callable[[random.Random], str]:
    def gen(rng: random.Random) -> str:
        when = [f"step={rng.randint(0, 10**6)}", *_opt(rng, f"phase={rng.choice(KILL_PHASES)}"),
                *_opt(rng, f"wait={_secs(rng)}")]
        rng.shuffle(when)
        return f"{kind}:{target(rng)}@{','.join(when)}"
    return gen


def _corrupt(rng: random.Random) -> str:
    step = f"step={rng.randint(0, 10**6)}"
    node = f"node={rng.randint(0, 63)}"
    if rng.random() < 0.5:
        return f"corrupt:{node}@{step},phase=transfer"
    return f"corrupt:{node}@{','.join([step, *_opt(rng, f'wait={_secs(rng)}')])}"


def _partition(rng: random.Random) -> str:
    when = [f"step={rng.randint(0, 10**6)}", *_opt(rng, f"for={_secs(rng)}"), *_opt(rng, f"wait={_secs(rng)}")]
    rng.shuffle(when)
    return f"partition:node={rng.randint(0, 63)}@{','.join(when)}"


def _slow(rng: random.Random) -> str:
    factor = rng.choice(["3", "1.3", "1000", repr(rng.uniform(1.0001, 999))])
    when = [f"step={rng.randint(0, 10**6)}", f"factor={factor}"]
    rng.shuffle(when)
    return f"slow:node={rng.randint(0, 63)}@{','.join(when)}"


def _sdc(rng: random.Random) -> str:
    target = rng.choice(["param", "grad", "shard"])
    when = [f"step={rng.randint(0, 10**6)}", f"target={target}", *_opt(rng, f"bit={rng.randint(0, 31)}"),
            *(_opt(rng, "persist") if target != "shard" else [])]
    rng.shuffle(when)
    return f"sdc:node={rng.randint(0, 63)}@{','.join(when)}"


def _preempt(rng: random.Random) -> str:
    when = [f"step={rng.randint(0, 10**6)}", f"notice={rng.choice(['0', _secs(rng)])}"]
    rng.shuffle(when)
    return f"preempt:node={rng.randint(0, 63)}@{','.join(when)}"


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "kill": _kill,
    "hang": _at_step("hang", lambda rng: f"node={rng.randint(0, 63)}"),
    "crash": _at_step("crash", lambda rng: f"rank={rng.randint(0, 511)}"),
    "corrupt": _corrupt,
    "nan": lambda rng: f"nan:step={rng.randint(0, 10**6)}",
    "partition": _partition,
    "slow": _slow,
    "sdc": _sdc,
    "preempt": _preempt,
    "sick": lambda rng: f"sick:spare={rng.randint(0, 63)}" + rng.choice(["", f"@step={rng.randint(0, 10**6)}"]),
}


def test_every_registered_kind_has_a_generator() -> None:
    assert set(GENERATORS) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_round_trips_parse_str_parse(kind: str) -> None:
    rng = random.Random(f"fault-kinds/{kind}")
    for i in range(1500):
        text = GENERATORS[kind](rng)
        f = parse_fault(text, i)
        assert f.kind == kind and f.index == i
        # the written spec names the same target (the nodes in their order, the rack, rank, etcd member, spare)
        assert "@" not in text or str(f).split("@")[0] == text.split("@")[0], (text, str(f))
        # wait= and for= as given, else 0.0 (no hold; a partition until its agent gives up)
        when = dict(x.split("=", 1) for x in text.split("@")[-1].split(",") if "=" in x)
        assert (f.wait, f.duration) == (float(when.get("wait", 0)), float(when.get("for", 0))), (text, f)
        # a kind's own settings are set only on its specs (0 / None elsewhere)
        assert ((f.factor > 1) == (kind == "slow") and (f.factor == 0.0) == (kind != "slow")
                and (f.notice is not None) == (kind == "preempt") and (f.spare is not None) == (kind == "sick")), f
        back = parse_fault(str(f), i)
        assert back == dataclasses.replace(f, text=str(f)), (text, str(f))
        assert str(back) == str(f)


def test_the_malformed_spec_error_lists_every_kinds_forms() -> None:
    with pytest.raises(UserError) as e:
        parse_fault("boom:node=1@step=3")
    assert str(e.value) == (
        "--inject='boom:node=1@step=3' is invalid: expected kill:node=I[,J]@step=S[,phase=P], kill:rack=A@step=S, "
        "kill:node=I@recovery=N, kill:node=I@step=S,phase=recovery, kill:coordinator@step=S, "
        "kill:etcd=I|leader@step=S, hang:node=I@step=S, crash:rank=R@step=S, corrupt:node=I@step=S, nan:step=S, "
        "partition:node=I@step=S[,for=SECONDS], slow:node=I@step=S,factor=F, "
        "sdc:node=I@step=S,target=param|grad|shard[,bit=B][,persist], preempt:node=I@step=S,notice=T or "
        "sick:spare=J[@step=S]")
    with pytest.raises(UserError, match="wait=SECONDS is for kill, hang, crash, corrupt and partition faults, not nan"):
        parse_fault("nan:step=3,wait=5")


@pytest.mark.parametrize("text,point", [
    ("kill:node=1@step=3", Point.STEP), ("kill:coordinator@step=3", Point.STEP), ("kill:rack=0@step=3", Point.STEP),
    ("kill:node=1@recovery=2", Point.RECOVERY), ("kill:node=1@step=3,phase=recovery", Point.RECOVERY),
    ("kill:etcd=leader@step=3", Point.PROGRESS), ("hang:node=1@step=3", Point.STEP),
    ("crash:rank=2@step=3", Point.STEP),
    ("corrupt:node=1@step=3", Point.REPLICAS), ("corrupt:node=1@step=3,phase=transfer", Point.TRANSFER),
    ("nan:step=3", Point.LOSS), ("partition:node=1@step=3", Point.HEARTBEAT),
    ("slow:node=1@step=3,factor=2", Point.COMPUTE),
    ("preempt:node=1@step=3,notice=5", Point.NOTICE),
    ("sdc:node=1@step=3,target=grad,bit=30", Point.SDC), ("sdc:node=0@step=3,target=param,persist", Point.SDC),
    ("sdc:node=0@step=3,target=shard", Point.AT_REST),
])
def test_each_spec_fires_at_its_point(text: str, point: Point) -> None:
    assert parse_fault(text).point is point


def test_whom_a_fault_strikes_and_what_it_holds() -> None:
    topo = Topology(epoch=0, nodes=[f"n{i}" for i in range(4)], workers_per_node=1, replicas=1, racks=2,
                    resume_step=0)
    strikes = {text: [s for s in range(4) if parse_fault(text).kind_of.strikes(parse_fault(text), s, s, topo)]
               for text in ("kill:node=1,3@step=3", "kill:rack=1@step=3", "kill:coordinator@step=3",
                            "crash:rank=2@step=3", "hang:node=0@step=3")}
    rack1 = [s for s in range(4) if topo.rack_of(s) == 1]
    assert rack1 and len(rack1) < 4
    assert strikes == {"kill:node=1,3@step=3": [1, 3], "kill:rack=1@step=3": rack1,
                       "kill:coordinator@step=3": [0], "crash:rank=2@step=3": [2], "hang:node=0@step=3": [0]}
    held = {text: [s for s in (3, 4) if parse_fault(text).kind_of.held_at(parse_fault(text), s)]
            for text in ("kill:node=1@step=4,wait=5", "corrupt:node=1@step=4,wait=5", "partition:node=1@step=4,wait=5")}
    # a corruption at rest holds the step before (it hits that step's replicas); a partition holds its own
    # step until its agent has cut the link, with or without wait=
    assert held == {"kill:node=1@step=4,wait=5": [4], "corrupt:node=1@step=4,wait=5": [3],
                    "partition:node=1@step=4,wait=5": [4]}
    # so does a preemption: both are fired by an agent, which looks at the job's progress only now and then
    for text in ("partition:node=1@step=4", "preempt:node=1@step=4,notice=30"):
        assert [s for s in (3, 4, 5) if parse_fault(text).kind_of.held_at(parse_fault(text), s)] == [4], text


@pytest.mark.parametrize("text,why", [
    ("sdc:node=1@step=3", "expected sdc:node=I@step=S,target="),
    ("sdc:node=1@step=3,target=disk", "target='disk': one of param, grad, shard"),
    ("sdc:node=1@step=3,target=grad,bit=32", "bit='32': a bit of a 32-bit element, 0..31"),
    ("sdc:node=1@step=3,target=grad,persist=yes", "persist takes no value"),
    ("sdc:node=1@step=3,target=grad,phase=backward", "expected sdc:node=I@step=S,target="),
    ("sdc:node=1@step=3,target=grad,wait=5", "wait=SECONDS is for"),
    ("kill:node=1@step=3,persist", "expected"),
])
def test_sdc_specs_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(UserError, match=re.escape(why)):
        parse_fault(text)


def test_an_sdc_fault_fires_once_or_from_its_step_on() -> None:
    once, bad = parse_fault("sdc:node=1@step=5,target=grad"), parse_fault("sdc:node=1@step=5,target=grad,persist")
    k = once.kind_of
    assert [s for s in range(1, 10) if k.fires_at(once, s, "grad")] == [5]  # type: ignore[attr-defined]
    assert [s for s in range(1, 10) if k.fires_at(bad, s, "grad")] == [5, 6, 7, 8, 9]  # type: ignore[attr-defined]
    assert not k.fires_at(once, 5, "param")  # type: ignore[attr-defined]
    assert not k.answered_by_recovery(parse_fault("sdc:node=1@step=5,target=shard"))


def test_a_launch_mode_refuses_what_it_cannot_fire() -> None:
    part, coord = parse_fault("partition:node=1@step=3"), parse_fault("kill:coordinator@step=3")
    assert "hosts with their own addresses" in (part.kind_of.refuse(part, True) or "")
    assert part.kind_of.refuse(part, False) is None
    assert "other hosts than the coordinator" in (coord.kind_of.refuse(coord, False) or "")
    assert coord.kind_of.refuse(coord, True) is None
    assert [k for k, x in KINDS.items() if not x.needs_protection] == ["nan", "slow"]


@pytest.mark.parametrize("text,why", [
    ("slow:node=1@step=5", "expected slow:node=I@step=S,factor=F (F > 1: how many times slower its compute is)"),
    ("slow:node=1@step=5,factor=1", "factor=1 must be a number > 1 (how many times as long the compute takes)"),
    ("slow:node=1@step=5,factor=nan", "factor=nan must be a number > 1 (how many times as long the compute takes)"),
    ("slow:node=1@step=5,factor=1001", "factor=1001 must be at most 1000"),
    ("slow:node=1@step=5,factor=x", "factor must be a number, got 'x'"),
    ("slow:node=1@step=5,factor=2,phase=backward",
     "slow:node=I@step=S,factor=F takes no phase (the node's whole compute is slower)"),
    ("slow:node=1@step=5,factor=2,wait=3",
     "wait=SECONDS is for kill, hang, crash, corrupt and partition faults, not slow"),
    ("slow:node=1,2@step=5,factor=2", "expected kill:node=I[,J]@step=S[,phase=P], ..."),
    ("kill:node=1@step=5,factor=2", "factor=F is only for slow faults (how many times slower the node's compute is)"),
])
def test_a_slow_fault_needs_a_factor_above_one(text: str, why: str) -> None:
    with pytest.raises(UserError) as e:
        parse_fault(text)
    msg, head = str(e.value), f"--inject={text!r} is invalid: "
    assert msg.startswith(head + why[:-3]) if why.endswith("...") else msg == head + why, msg
    f = parse_fault("slow:node=2@step=7,factor=2.5")
    assert (f.nodes, f.step, f.factor, str(f)) == ((2,), 7, 2.5, "slow:node=2@step=7,factor=2.5")


@pytest.mark.parametrize("text,why", [
    ("kill:node=1@step=5,notice=5", "notice=SECONDS is only for preempt faults (the time from the notice to the kill)"),
    ("preempt:node=1@step=5,notice=soon", "notice must be seconds, got 'soon'"),
    ("preempt:node=1@step=5,notice=inf", "notice=inf must be a finite number of seconds >= 0"),
    ("preempt:node=1@step=5,notice=-1", "notice=-1 must be >= 0 seconds"),
])
def test_a_preempt_fault_needs_a_notice_of_zero_seconds_or_more(text: str, why: str) -> None:
    with pytest.raises(UserError) as e:
        parse_fault(text)
    assert str(e.value) == f"--inject={text!r} is invalid: {why}"
    f = parse_fault("preempt:node=2@step=7,notice=30")
    assert (f.nodes, f.step, f.notice, str(f)) == ((2,), 7, 30.0, "preempt:node=2@step=7,notice=30.0")


def test_an_etcd_member_is_its_index_and_the_leader_minus_one() -> None:
    """FaultSpec.member: the member's index in the cluster the run started, -1 for its raft leader; a spec
    parsed alone is fault 0."""
    one, leader = parse_fault("kill:etcd=2@step=3"), parse_fault("kill:etcd=leader@step=3")
    assert (one.member, one.index, str(one)) == (2, 0, "kill:etcd=2@step=3")
    assert (leader.member, leader.index, str(leader)) == (-1, 0, "kill:etcd=leader@step=3")
