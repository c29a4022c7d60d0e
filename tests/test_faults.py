"""`--inject` fault specs: what parses, and one-line errors that say what is actually wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phoenixft.cli.main import main
from phoenixft.errors import UserError
from phoenixft.faults.spec import parse_fault


@pytest.mark.parametrize(
    "spec,needle",
    [
        # a key given twice is refused, not silently overridden by the last one
        ("kill:node=1@step=4,phase=forward,phase=optimizer", "phase= is given twice; give it once"),
        ("hang:node=0@step=3,wait=5,wait=9", "wait= is given twice; give it once"),
        # a node listed twice: "several nodes at once" would wait for an arrival that never comes
        ("kill:node=1,1@step=4", "node=1,1 names node 1 more than once; list each node once, e.g. node=1"),
        ("kill:node=0,2,0@step=4,phase=backward",
         "node=0,2,0 names node 0 more than once; list each node once, e.g. node=0,2"),
        # single-valued targets are refused as lists instead of silently cut to their first member
        ("kill:rack=0,1@step=3", "rack=0,1: a kill fault takes one rack; give one --inject per rack"),
        ("crash:rank=1,2@step=3", "rank=1,2: a crash fault takes one rank; give one --inject per rank"),
        # wait=SECONDS: the message names what is actually wrong
        ("kill:node=1@step=5,phase=recovery,wait=5",
         "wait=SECONDS cannot be combined with phase=recovery: that fault fires in the middle of a recovery's state "
         "transfer, not at a step boundary"),
        ("corrupt:node=1@step=5,phase=transfer,wait=5", "wait=SECONDS cannot be combined with phase=transfer"),
        ("kill:node=1@recovery=2,wait=5",
         "wait=SECONDS cannot be combined with recovery=N: that fault fires in the middle of a recovery"),
        ("nan:step=3,wait=5", "wait=SECONDS is for kill, hang, crash, corrupt and partition faults, not nan"),
        ("kill:node=1@step=3,wait=-1", "wait=-1 must be >= 0 seconds"),
        ("kill:node=1@step=3,wait=inf", "wait=inf must be a finite number of seconds >= 0"),
        ("hang:node=1@step=3,wait=nan", "wait=nan must be a finite number of seconds >= 0"),
        ("partition:node=1@step=3,for=inf",
         "for=inf must be a finite number of seconds > 0 (leave it out: until the agent gives up)"),
        # a phase that means nothing for the kind was accepted and ignored
        ("corrupt:node=1@step=3,phase=optimizer", "phase='optimizer': a corruption is at rest (no phase"),
        ("nan:step=3,phase=backward", "nan:step=S takes no phase"),
        # every other refusal names what is wrong, in its own words
        ("kill:etcd=two@step=3", "etcd='two': expected a member index (0, 1, 2) or leader"),
        ("kill:etcd=1@step=3,phase=backward", "expected kill:etcd=I@step=S or kill:etcd=leader@step=S (no phase, no"),
        ("kill:etcd=1@recovery=2", "expected kill:etcd=I@step=S or kill:etcd=leader@step=S"),
        ("kill:etcd=1@step=3,wait=5", "expected kill:etcd=I@step=S or kill:etcd=leader@step=S (no phase, no wait)"),
        ("kill:slot=1@step=3", "target 'slot=1'; expected "),
        ("kill:node=1@step", "expected key=value, got 'step'"),
        ("kill:node=1@step=3,for=2", "for=SECONDS is only for partition faults (how long the host stays cut off)"),
        ("kill:node=1@step=3,phase=sideways", "phase='sideways', valid phases: forward, backward, replicate"),
        ("kill:rack=1@step=3,phase=recovery", "phase=recovery is only for kill:node=I@step=S,phase=recovery"),
        ("crash:rank=1@recovery=1", "only kill faults can fire during a recovery (@recovery=N)"),
        ("kill:coordinator@recovery=1", "kill:coordinator needs @step=S"),
        ("kill:node=a@step=3", "node must be integers, got 'a'"),
        ("kill:rack=x@step=3", "rack must be integers, got 'x'"),
        ("kill:node=1,1,2,2@step=4", "node=1,1,2,2 names node 1, 2 more than once; list each node once, e.g. node=1,2"),
        ("kill:node=1@step=x", "step must be integers, got 'x'"),
        ("kill:node=1@recovery=x", "recovery must be integers, got 'x'"),
        ("kill:node=1@step=3,wait=soon", "wait must be seconds, got 'soon'"),
        ("partition:node=1@step=3,for=0", "for=0 must be > 0 seconds (leave it out: until the agent gives up)"),
        ("partition:node=1@step=3,for=-2", "for=-2 must be > 0 seconds"),
        ("bogus:node=1@step=3", "is invalid: expected kill:node=I"),
        ("kill:node=1@step=3@step=4", "is invalid: "),
        # a target's value is everything after its first "=" (and a spec's kind what comes before its first ":")
        ("kill:node=1=2@step=3", "node must be integers, got '1=2'"),
        ("sick:spare=1:x", "spare must be integers, got '1:x'"),
        # a target key the kind does not take is named, whatever other targets the kind takes
        ("crash:slot=1@step=3", "target 'slot=1'; expected "),
        ("kill:rank=1@step=3", "target 'rank=1'; expected "),
        ("sick:slot=1", "target 'slot=1'; expected "),
        ("kill:spare=1@step=3", "target 'spare=1'; expected "),
        ("sick:spare=1,2", "spare=1,2: a sick fault takes one spare; give one --inject per spare"),
        ("sick:spare=-1", "spare=-1: a spare's number (s0, s1, ...) is >= 0"),
        # an unknown key, or a when part without its step (sick's @step=S is optional, not its other keys)
        ("kill:node=1@step=3,colour=red", "is invalid: expected kill:node=I[,J]@step=S[,phase=P], "),
        ("sick:spare=1@phase=forward", "is invalid: expected kill:node=I[,J]@step=S[,phase=P], "),
        ("sdc:node=1@step=3,target=foo", "target='foo': one of param, grad, shard"),
    ],
)
def test_bad_spec_is_one_line_saying_what_is_wrong(spec: str, needle: str) -> None:
    with pytest.raises(UserError) as e:
        parse_fault(spec)
    msg = str(e.value)
    head = f"--inject={spec!r} is invalid: "
    # the reason comes first, in the words given (a needle starting "is invalid: " gives the reason's start)
    assert msg.startswith(head + needle.removeprefix("is invalid: ")) and "\n" not in msg, msg
    assert "is for kill, hang, crash and corrupt faults at a step" not in msg  # the old, misleading message


@pytest.mark.parametrize("spec", ["kill:node=0,1@step=4", "kill:node=1,0,2@step=4,wait=5", "kill:rack=1@step=3",
                                  "crash:rank=3@step=3,wait=0", "kill:node=1@step=5,phase=recovery",
                                  "partition:node=1@step=3,for=2.5,wait=10", "corrupt:node=1@step=3,phase=transfer",
                                  "corrupt:node=1@step=3,wait=5"])
def test_good_specs_still_parse(spec: str) -> None:
    assert parse_fault(spec).coordinator is False


def test_duplicate_node_from_the_command_line_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--dry-run", "--nodes", "2", "--inject", "kill:node=1,1@step=4"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--inject='kill:node=1,1@step=4' is invalid: node=1,1 names node 1" in lines[0], err
    assert "Traceback" not in err


def test_a_recovery_phase_kill_waits_for_the_recovery_of_a_failure_not_a_planned_grow() -> None:
    from types import SimpleNamespace

    from phoenixft.distributed.topology import Topology
    from phoenixft.faults.inject import FaultInjector

    spec = parse_fault("kill:node=0@step=7,phase=recovery", 0)
    fired: list[int] = []
    inj = FaultInjector(SimpleNamespace(faults=[spec], node_id="n2"))  # type: ignore[arg-type]
    inj.fire = lambda f, **where: fired.append(where["recovery"])  # type: ignore[method-assign]

    def recovery(epoch: int, klass: str, resume: int) -> None:
        inj.in_recovery(Topology(epoch=epoch, nodes=["n2", "n3"], workers_per_node=1, replicas=1, racks=1,
                                 resume_step=resume, transfers=[], meta={"class": klass}, tp=1, pp=1))

    recovery(1, "permanent", 5)  # before step 7: not yet
    recovery(2, "planned", 6)  # a grow that resumes from step 6 answers no failure
    assert fired == []
    recovery(3, "permanent", 6)  # the recovery of the failure at step 7
    assert fired == [3]


def test_the_same_fault_given_twice_is_refused() -> None:
    from phoenixft.config import RunConfig

    with pytest.raises(UserError, match="given twice: each fault fires once per run"):
        RunConfig(nodes=2, steps=8, inject=["kill:node=1@step=4", " kill:node=1@step=4"]).validate()


def test_a_fault_the_run_never_reached_says_the_run_ended_first(capsys: pytest.CaptureFixture[str]) -> None:
    """A run that timed out (or was stopped) at step 100 said of its `kill:node=1@step=1500`: "its node, rank
    or phase was not in the job when its step came", which sends the user looking for a bug that is not there."""
    from phoenixft.observe.display import Display

    specs = ["kill:node=1@step=1500", "kill:node=0@step=50", "kill:node=1@recovery=2"]
    Display(quiet=True).done({"state": "failed: timeout after 6s", "steps_completed": 100, "faults_not_fired": specs})
    err = capsys.readouterr().err
    assert "kill:node=1@step=1500 (the run ended (failed: timeout after 6s) after step 100, before step 1500)" in err
    assert "kill:node=0@step=50 (its node, rank or phase was not in the job when its step came)" in err, err
    assert "kill:node=1@recovery=2 (the run ended (failed: timeout after 6s) after step 100)" in err, err
    Display(quiet=True).done({"state": "done", "steps_completed": 100, "faults_not_fired": specs[:1]})
    assert "(its node, rank or phase was not in the job when its step came)" in capsys.readouterr().err


def test_a_fault_at_or_before_the_resumed_checkpoint_is_refused(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--resume from step 4 trains steps 5..8: a fault at step 4 was accepted, then reported "never fired"
    ("its node, rank or phase was not in the job"). It is refused at the start, naming the fault, its step
    and the checkpoint's step."""
    from phoenixft.config import RunConfig

    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000004").mkdir(parents=True)
    (ckpt / "step_00000004" / "MANIFEST.json").write_text(json.dumps({"step": 4}))
    for spec in ("kill:node=1@step=4,phase=optimizer", "crash:rank=0@step=1", "nan:step=3", "corrupt:node=0@step=4",
                 "kill:coordinator@step=2"):
        with pytest.raises(UserError) as e:
            RunConfig(nodes=2, steps=8, resume=str(ckpt), inject=[spec]).validate()
        msg = str(e.value)
        assert spec in msg and f"its step {parse_fault(spec).step} is at or before step 4" in msg \
            and "give a step in 5..8" in msg and "\n" not in msg, msg
    for spec in ("kill:node=1@step=5", "kill:node=1@recovery=1", "nan:step=8"):  # still fine
        RunConfig(nodes=2, steps=8, resume=str(ckpt), inject=[spec]).validate()
    capsys.readouterr()
    assert main(["run", "--dry-run", "--nodes", "2", "--steps", "8", "--resume", str(ckpt),
                 "--inject", "kill:node=1@step=3"]) == 2  # from the command line: one line, exit 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its step 3 is at or before step 4" in err, err
