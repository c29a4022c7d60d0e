"""Fault-injection specs, parsed from `--inject` (repeatable).

    kill:node=I[,J...]@step=S[,phase=P]   SIGKILL every process of the nodes in slots I, J
    kill:rack=A@step=S[,phase=P]          SIGKILL every node of rack A
    kill:node=I@recovery=N                SIGKILL slot I during the N-th recovery (its state transfer;
                                          the node in slot I may be the promoted spare itself)
    kill:node=I@step=S,phase=recovery     SIGKILL slot I during the state transfer of the first recovery
                                          of a failure (not a planned grow) whose resume step is >= S-1
                                          (no epoch number needed)
    kill:coordinator@step=S               SIGKILL the coordinator process (the launcher restarts it); with
                                          --coordinators N the one that leads at that moment (a standby
                                          takes over)
    kill:etcd=I@step=S                    SIGKILL member I of the etcd cluster the run started
                                          (--control-plane etcd); kill:etcd=leader@step=S: its raft leader.
                                          Fired by the launcher once the job has completed step S-1
    hang:node=I@step=S[,phase=P]          SIGSTOP every process of node I (only a timeout finds it)
    crash:rank=R@step=S[,phase=P]         worker R exits with an error; its node stays healthy
                                          (phase=copy, under `launch`: between its snapshot's own-side commit
                                          and the copy of its parameters; kill takes it too)
    corrupt:node=I@step=S                 flip bytes in the replicas node I received during step S
    corrupt:node=I@step=S,phase=transfer  flip bytes in every optimizer-state transfer node I sends in
                                          recoveries whose resume step is >= S-1 (corruption in flight)
    nan:step=S                            the loss of step S is NaN (not ours to heal: clean stop)
    slow:node=I@step=S,factor=F           from step S on, node I's compute takes F (> 1) times as long (a
                                          straggler; a spare that replaces it is not slow)
    preempt:node=I@step=S,notice=T        a preemption notice: once the job reaches step S, the agent of
                                          slot I gets its drain signal (a planned drain moves its role to a
                                          spare), and T seconds later every process of the node is
                                          SIGKILLed if it has not left by then
    sick:spare=J[@step=S]                 spare sJ's health checks fail (its matrix product is wrong): it is
                                          never promoted; with @step=S only its checks once the job reached S
    sdc:node=I@step=S,target=T[,bit=B][,persist]
                                          silent data corruption: flip one bit (B, else one drawn from the
                                          run's seed) of a tensor on node I, nothing crashes: T=param its copy
                                          of the full parameters after the gather, before the forward;
                                          T=grad one microbatch's gradient before the reduction; T=shard a
                                          committed snapshot half or a replica it holds, at rest. persist: the
                                          node corrupts every time it computes from step S on (a bad unit)
    partition:node=I@step=S[,for=T]       cut the host of slot I off the network (its link down) once the
                                          job reaches step S, its processes left running; the link comes
                                          back after T seconds (default: when its agent gives up and exits).
                                          Fired by that host's agent, so it needs hosts with their own
                                          addresses (`phoenixft coordinator` + agents), not `phoenixft run`

P is one of forward, backward, replicate, optimizer (default forward); recovery for kill; a corrupt
fault takes none (at rest) or transfer; nan takes none. `,wait=SECONDS` (kill, hang, crash,
corrupt, partition at a step): the fault holds its step (a corruption at rest: the step before,
whose replication it corrupts; every rank waits before the step begins, as it does for every
partition until its agent has cut the link) - training pauses there - until the job is whole again
(full size, and a warm spare ready if the job was given spares), at most that long, then fires;
`phoenixft chaos` uses it so that repaired spares can return between faults. A fault fires at
most once per (fault, node): the first process that reaches it claims it atomically in the store
(`store.add`), records the time, and only then acts, so a replayed step never fires it again.

What each kind accepts beyond this grammar, where it fires and what it does there live with the kind
(kinds.py); `FaultSpec.kind_of` is the lookup.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from phoenixft.faults.kinds import KILL_PHASES, KINDS, MEMBER_TARGET, FaultKind, Point, bad_spec, join_or

__all__ = ["FaultSpec", "parse_fault", "KILL_PHASES", "FAULT_KINDS"]

FAULT_KINDS = tuple(KINDS)
_SPEC = re.compile(r"^(?P<kind>[a-z]+):(?:(?P<target>[^@]+)@)?(?P<when>.+)$")
_VALID = "expected " + join_or([form for k in KINDS.values() for form in k.forms], "or")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    text: str
    index: int
    kind: str
    nodes: tuple[int, ...] = ()
    rack: int | None = None
    rank: int | None = None
    step: int | None = None
    recovery: int | None = None
    phase: str = "forward"
    coordinator: bool = False
    member: int | None = None  # a member of the control-plane cluster the run started (-1: its leader)
    wait: float = 0.0  # seconds the fault may hold its step until the job is whole again (chaos campaigns)
    duration: float = 0.0  # partition: seconds until the link comes back (0 = when the agent exits)
    factor: float = 0.0  # slow: how many times as long the node's compute takes (0 = not a slow fault)
    notice: float | None = None  # preempt: seconds from the drain signal to the SIGKILL of the node
    spare: int | None = None  # sick: the spare id's number (s<J>)
    target: str = ""  # sdc: the tensor it corrupts (param, grad, shard)
    bit: int | None = None  # sdc: the bit it flips (None: drawn from the run's seed)
    persist: bool = False  # sdc: every time the node computes from its step on, not once

    @property
    def node(self) -> int | None:
        return self.nodes[0] if self.nodes else None

    @property
    def kind_of(self) -> FaultKind:
        """The kind's behaviour (kinds.py): the one lookup every dispatch on the kind goes through."""
        return KINDS[self.kind]

    @property
    def point(self) -> Point:
        """Where, and by which process, this fault fires."""
        return self.kind_of.point(self)

    def __str__(self) -> str:
        return self.kind_of.format(self)


_bad = bad_spec


def _ints(text: str, value: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise _bad(text, f"{what} must be integers, got {value!r}") from None


def _distinct(text: str, value: str, what: str) -> tuple[int, ...]:
    """A target list (node=I,J,...): each member once, or "several at once" would wait for arrivals that never come."""
    got = _ints(text, value, what)
    dup = sorted({x for x in got if got.count(x) > 1})
    if dup:
        raise _bad(text, f"{what}={value} names {what} {', '.join(map(str, dup))} more than once; list each {what} "
                         f"once, e.g. {what}={','.join(map(str, dict.fromkeys(got)))}")
    return got


def _one(text: str, value: str, what: str, kind: str) -> int:
    """A single-valued target (rack=A, rank=R): a list is refused rather than cut to its first member."""
    got = _ints(text, value, what)
    if len(got) != 1:
        raise _bad(text, f"{what}={value}: a {kind} fault takes one {what}; give one --inject per {what}")
    return got[0]


def _seconds(text: str, key: str, value: str, valid: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise _bad(text, f"{key} must be seconds, got {value!r}") from None
    if not math.isfinite(x):
        raise _bad(text, f"{key}={value} must be a finite number of seconds {valid}")
    return x


def _notice(text: str, fk: FaultKind, when: dict[str, str]) -> float | None:
    """preempt's notice=SECONDS (None when not given)."""
    if "notice" not in when:
        return None
    if not fk.notices:
        raise _bad(text, "notice=SECONDS is only for preempt faults (the time from the notice to the kill)")
    notice = _seconds(text, "notice", when["notice"], ">= 0")
    if notice < 0:
        raise _bad(text, f"notice={when['notice']} must be >= 0 seconds")
    return notice


def _factor(text: str, fk: FaultKind, when: dict[str, str]) -> float:
    """slow's factor=F (0.0 when not given)."""
    if "factor" not in when:
        return 0.0
    if not fk.scales:
        raise _bad(text, "factor=F is only for slow faults (how many times slower the node's compute is)")
    try:
        factor = float(when["factor"])
    except ValueError:
        raise _bad(text, f"factor must be a number, got {when['factor']!r}") from None
    if not (math.isfinite(factor) and factor > 1):
        raise _bad(text, f"factor={when['factor']} must be a number > 1 (how many times as long the compute takes)")
    if factor > 1000:
        raise _bad(text, f"factor={when['factor']} must be at most 1000")
    return factor


def parse_fault(text: str, index: int = 0) -> FaultSpec:
    head, colon, rest = text.strip().partition(":")
    if colon and head in KINDS and not KINDS[head].needs_when and "@" not in rest:
        text_m = f"{head}:{rest}@"  # a target alone (sick:spare=J): no when part
        m = re.match(r"^(?P<kind>[a-z]+):(?P<target>[^@]+)@(?P<when>)$", text_m)
    else:
        m = _SPEC.match(text.strip())
    if not m or m["kind"] not in KINDS:
        raise _bad(text, _VALID)
    kind = m["kind"]
    fk = KINDS[kind]
    # target: one key whose value may hold commas (node=1,2)
    nodes: tuple[int, ...] = ()
    rack = rank = None
    coordinator = False
    member: int | None = None
    spare: int | None = None
    if m["target"] == "coordinator" and "coordinator" in fk.targets:
        coordinator = True
    elif MEMBER_TARGET in fk.targets and m["target"] and m["target"].startswith(MEMBER_TARGET + "="):
        v = m["target"][len(MEMBER_TARGET) + 1:]
        if v != "leader" and not v.isdigit():
            raise _bad(text, f"etcd={v!r}: expected a member index (0, 1, 2) or leader")
        member = -1 if v == "leader" else int(v)
    elif m["target"]:
        key, _, value = m["target"].partition("=")
        if key == "node":
            nodes = _distinct(text, value, "node")
        elif key == "rack" and "rack" in fk.targets:
            rack = _one(text, value, "rack", kind)
        elif key == "rank" and "rank" in fk.targets:
            rank = _one(text, value, "rank", kind)
        elif key == "spare" and "spare" in fk.targets:
            spare = _one(text, value, "spare", kind)
            if spare < 0:
                raise _bad(text, f"spare={value}: a spare's number (s0, s1, ...) is >= 0")
        else:
            raise _bad(text, f"target {m['target']!r}; {_VALID}")
    when: dict[str, str] = {}
    for item in m["when"].split(",") if m["when"] else []:
        k, sep, v = item.partition("=")
        if not sep and k.strip() in fk.flags:  # a bare flag (sdc's persist)
            sep, v = "=", ""
        if not sep:
            raise _bad(text, f"expected key=value, got {item!r}")
        if k.strip() in when:
            raise _bad(text, f"{k.strip()}= is given twice; give it once")
        when[k.strip()] = v.strip()
    known = {"step", "phase", "recovery", "wait", "for", "factor", "notice"} | fk.options
    if set(when) - known or (("step" in when) == ("recovery" in when) and (fk.needs_when or when)):
        raise _bad(text, _VALID)
    fk.check_form(text, when)
    notice = _notice(text, fk, when)
    if "for" in when and not fk.lasts:
        raise _bad(text, "for=SECONDS is only for partition faults (how long the host stays cut off)")
    factor = _factor(text, fk, when)
    step = _ints(text, when["step"], "step")[0] if "step" in when else None
    recovery = _ints(text, when["recovery"], "recovery")[0] if "recovery" in when else None
    fk.check_phase(text, when)
    phase = when.get("phase", "forward")
    valid = fk.phases
    if phase not in valid:
        raise _bad(text, f"phase={phase!r}, valid phases: {', '.join(valid)}")
    if phase == "recovery" and (not nodes or "step" not in when):  # it fires only for node slots, by step
        raise _bad(text, "phase=recovery is only for kill:node=I@step=S,phase=recovery")
    if not fk.has_target(nodes, rack, rank, coordinator, member, m["target"]):
        raise _bad(text, _VALID)
    if recovery is not None and not fk.during_recovery:
        raise _bad(text, "only kill faults can fire during a recovery (@recovery=N)")
    if coordinator and step is None:
        raise _bad(text, "kill:coordinator needs @step=S")
    if member is not None and (step is None or "phase" in when or "wait" in when):
        raise _bad(text, "expected kill:etcd=I@step=S or kill:etcd=leader@step=S (no phase, no wait)")
    wait = 0.0
    if "wait" in when:
        wait = _seconds(text, "wait", when["wait"], ">= 0")
        if wait < 0:
            raise _bad(text, f"wait={when['wait']} must be >= 0 seconds")
        if not fk.waits:
            raise _bad(text, f"wait=SECONDS is for {join_or([n for n, x in KINDS.items() if x.waits], 'and')} "
                             f"faults, not {kind}")
        if step is None:
            raise _bad(text, "wait=SECONDS cannot be combined with recovery=N: that fault fires in the middle of a "
                             "recovery, not at a step boundary where training could hold; drop wait")
        if phase in ("recovery", "transfer"):
            raise _bad(text, f"wait=SECONDS cannot be combined with phase={phase}: that fault fires in the middle of "
                             "a recovery's state transfer, not at a step boundary where training could hold; drop "
                             f"wait or phase={phase}")
    duration = 0.0
    if "for" in when:
        duration = _seconds(text, "for", when["for"], "> 0 (leave it out: until the agent gives up)")
        if not duration > 0:
            raise _bad(text, f"for={when['for']} must be > 0 seconds (leave it out: until the agent gives up)")
    return FaultSpec(text=text, index=index, kind=kind, nodes=nodes, rack=rack, rank=rank, step=step,
                     recovery=recovery, phase=phase, coordinator=coordinator, member=member, wait=wait,
                     duration=duration, factor=factor, notice=notice, spare=spare, **fk.parse_options(text, when))
