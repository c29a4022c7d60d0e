"""The fault kinds of `--inject`, one class each, and the registry every dispatch goes through.

A kind knows its own syntax (which targets it takes, which phases, whether it can wait for the job to
be whole or last for a while), where its faults fire (`Point`: at a training step's phase, mid
recovery, on the replicas at rest, in flight, on the loss, from the node agent's heartbeat, from the
launcher), which processes it strikes, what it does there, what a run needs for it, and how a spec of
it is written back as text. `spec.parse_fault` parses a spec into a `FaultSpec` and the kind checks
what only it knows; `FaultSpec.kind_of` is the one registry lookup (`KINDS`) the injectors, the
launcher, the agent and the config use instead of comparing kind names.
"""

from __future__ import annotations

import enum
import os
import signal
from typing import TYPE_CHECKING, Any, ClassVar

from phoenixft.errors import UserError
from phoenixft.runtime.procs import signal_node

if TYPE_CHECKING:
    from phoenixft.distributed.topology import Topology
    from phoenixft.faults.inject import FaultInjector
    from phoenixft.faults.spec import FaultSpec

__all__ = ["COPY_PHASE", "KILL_PHASES", "MEMBER_TARGET", "SDC_TARGETS", "Point", "FaultKind", "KINDS", "bad_spec",
           "join_or"]

KILL_PHASES = ("forward", "backward", "replicate", "optimizer")
# a script's snapshot (`phoenixft launch`): its own side committed, its parameters' and optimizer state's copy not yet
COPY_PHASE = "copy"
# the --inject target naming a member of the control-plane cluster the run started, by that cluster's software
MEMBER_TARGET = "etcd"


class Point(enum.Enum):
    """Where (and by which process) a fault fires."""

    STEP = "step"  # a worker, at a training step's phase (`FaultInjector.at`)
    RECOVERY = "recovery"  # a worker, mid state transfer of a recovery (`FaultInjector.in_recovery`)
    REPLICAS = "replicas"  # a worker, on the replicas it received during a step (`FaultInjector.corrupt_replicas`)
    AT_REST = "at_rest"  # a worker, on a committed copy it holds, once a step's protection committed (`at_rest`)
    TRANSFER = "transfer"  # a worker, on the optimizer-state transfers it sends (`FaultInjector.corrupts_transfers`)
    LOSS = "loss"  # rank 0, on the loss of a step (`FaultInjector.nan_at`)
    SDC = "sdc"  # a worker, on a tensor it computes with (`FaultInjector.sdc_flip`)
    HEARTBEAT = "heartbeat"  # the node agent, from its heartbeat loop (`partition.PartitionInjector`)
    NOTICE = "notice"  # the node agent, from its heartbeat loop: a preemption notice (`faults/notice.py`)
    PROGRESS = "progress"  # the launcher, from its progress loop (`LocalJob._fire_member_faults`)
    COMPUTE = "compute"  # a worker, on its own compute time from a step on (`FaultInjector.slow_factor`)
    HEALTH = "health"  # a spare's agent, in its health check (`phoenixft.health.spare`)


def bad_spec(text: str, why: str) -> UserError:
    return UserError(f"--inject={text!r} is invalid: {why}")


def _num(x: float) -> str:
    return repr(float(x))  # parses back to the same float


class FaultKind:
    """One fault kind; subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    forms: ClassVar[tuple[str, ...]]  # its syntax, as the error for a malformed spec lists it
    targets: ClassVar[frozenset[str]] = frozenset()  # target keys it takes besides node=
    phases: ClassVar[tuple[str, ...]] = KILL_PHASES  # the phase= values it accepts
    waits: ClassVar[bool] = True  # it takes ,wait=SECONDS
    lasts: ClassVar[bool] = False  # it takes ,for=SECONDS
    during_recovery: ClassVar[bool] = False  # it takes @recovery=N
    needs_protection: ClassVar[bool] = True  # the run needs --protect phoenix for it
    scales: ClassVar[bool] = False  # it takes ,factor=F (and needs it)
    options: ClassVar[frozenset[str]] = frozenset()  # when-part keys it takes besides step, phase, recovery, wait, for
    notices: ClassVar[bool] = False  # it takes ,notice=SECONDS
    needs_when: ClassVar[bool] = True  # its spec has an @when part (sick:spare=J may have none)
    flags: ClassVar[frozenset[str]] = frozenset()  # those of its options written bare (no =VALUE)
    # what it acts on exists only in the built-in trainer's step (its loss, its compute's timing, its tensors):
    # a user's script under `phoenixft launch` cannot have it (the kind says why)
    built_in_only: ClassVar[str] = ""

    # ---------------------------------------------------------------- parsing
    def check_form(self, text: str, when: dict[str, str]) -> None:
        """Refuse a when-part this kind cannot take (before the step and phase are read)."""

    def check_phase(self, text: str, when: dict[str, str]) -> None:
        """Refuse a phase= this kind explains itself (before the generic phase check)."""

    def parse_options(self, text: str, when: dict[str, str]) -> dict[str, Any]:
        """The FaultSpec fields of this kind's own when-part keys (`options`)."""
        return {}

    def has_target(self, nodes: tuple[int, ...], rack: int | None, rank: int | None, coordinator: bool,
                   member: int | None, target: str | None) -> bool:
        return len(nodes) == 1

    def format(self, f: FaultSpec) -> str:
        """The spec as text that parses back to `f` (what `str(f)` writes)."""
        when = [f"step={f.step}" if f.step is not None else f"recovery={f.recovery}"]
        if f.phase != "forward":
            when.append(f"phase={f.phase}")
        if f.wait:
            when.append(f"wait={_num(f.wait)}")
        if f.duration:
            when.append(f"for={_num(f.duration)}")
        target = self.format_target(f)
        return f"{self.name}:{target + '@' if target else ''}{','.join(when)}"

    def format_target(self, f: FaultSpec) -> str:
        return "node=" + ",".join(map(str, f.nodes))

    # ---------------------------------------------------------------- firing
    def point(self, f: FaultSpec) -> Point:
        return Point.STEP

    def held_at(self, f: FaultSpec, step: int) -> bool:
        """Whether the workers hold step `step` for f's `,wait=` (it is due in that step); for a fault its
        agent fires (a partition, a preemption's notice), until that agent has taken it in hand."""
        return f.step == step and f.phase != "transfer"

    def strikes(self, f: FaultSpec, rank: int, slot: int, topo: Topology) -> bool:
        """Whether the worker (rank, node slot) fires f at its step and phase."""
        return slot in f.nodes

    def target_nodes(self, f: FaultSpec, node_id: str, topo: Topology) -> list[str]:
        """The node ids f strikes, from the topology of its first firing."""
        return [topo.nodes[s] for s in f.nodes if s < len(topo.nodes)]

    def act(self, f: FaultSpec, injector: FaultInjector) -> None:
        """What the worker that fires f does, once it claimed and recorded it."""

    def refuse(self, f: FaultSpec, local: bool) -> str | None:
        """Why the launch mode cannot run f (`phoenixft run`: local), or None."""
        return None

    def fails_health_check(self, f: FaultSpec, node: str, progress: int) -> bool:
        """Whether f makes the health check of spare `node` fail now (the job at step `progress`)."""
        return False

    def harms_node(self, f: FaultSpec) -> bool:
        """Whether f, once it struck a node, can make that node fail (killed, stopped, crashed, cut off,
        preempted, convicted of corrupting data, failing its health check): that node's failures are then
        the fault's, never its host's (`faults.struck`)."""
        return True

    def describe(self, f: FaultSpec) -> str:
        """One line for people."""
        return str(f)

    # ---------------------------------------------------------------- reporting
    def answered_by_recovery(self, f: FaultSpec) -> bool:
        """Whether a recovery of the training job answers f (the report pairs them)."""
        return True

    def why_not_fired(self, f: FaultSpec) -> str:
        """Why f can end a run without having fired (its run reached its step)."""
        return "its node, rank or phase was not in the job when its step came"


class Kill(FaultKind):
    name = "kill"
    forms = ("kill:node=I[,J]@step=S[,phase=P]", "kill:rack=A@step=S", "kill:node=I@recovery=N",
             "kill:node=I@step=S,phase=recovery", "kill:coordinator@step=S", "kill:etcd=I|leader@step=S")
    targets = frozenset({"rack", "coordinator", MEMBER_TARGET})
    phases = KILL_PHASES + ("recovery", COPY_PHASE)
    during_recovery = True

    def has_target(self, nodes: tuple[int, ...], rack: int | None, rank: int | None, coordinator: bool,
                   member: int | None, target: str | None) -> bool:
        return bool(nodes) or rack is not None or coordinator or member is not None

    def format_target(self, f: FaultSpec) -> str:
        if f.coordinator:
            return "coordinator"
        if f.member is not None:
            return f"{MEMBER_TARGET}={'leader' if f.member < 0 else f.member}"
        if f.rack is not None:
            return f"rack={f.rack}"
        return super().format_target(f)

    def point(self, f: FaultSpec) -> Point:
        if f.member is not None:
            return Point.PROGRESS
        if f.recovery is not None or f.phase == "recovery":
            return Point.RECOVERY
        return Point.STEP

    def held_at(self, f: FaultSpec, step: int) -> bool:
        if f.coordinator:  # (the step after the kill waits for the coordinator's restart)
            return f.step is not None and step == f.step + 1
        return super().held_at(f, step)

    def strikes(self, f: FaultSpec, rank: int, slot: int, topo: Topology) -> bool:
        if f.coordinator:
            return rank == 0
        if f.rack is not None:
            return topo.rack_of(slot) == f.rack
        return slot in f.nodes

    def target_nodes(self, f: FaultSpec, node_id: str, topo: Topology) -> list[str]:
        if f.coordinator:
            return [node_id]
        if f.rack is not None:
            return [topo.nodes[s] for s in range(len(topo.nodes)) if topo.rack_of(s) == f.rack]
        return super().target_nodes(f, node_id, topo)

    def act(self, f: FaultSpec, injector: FaultInjector) -> None:
        if f.coordinator:
            injector.kill_coordinator()
        else:
            signal_node(os.getppid(), signal.SIGKILL)  # (a worker: its node is its agent and what runs below it)

    def refuse(self, f: FaultSpec, local: bool) -> str | None:
        if not local and f.coordinator:
            return ("the workers that fire it sit on other hosts than the coordinator (use `phoenixft run` for "
                    "coordinator kills)")
        return None

    def answered_by_recovery(self, f: FaultSpec) -> bool:
        return not f.coordinator and f.member is None  # those are the control plane's, answered by a standby

    def harms_node(self, f: FaultSpec) -> bool:
        return not f.coordinator and f.member is None  # (a coordinator kill strikes no node's host)

    def why_not_fired(self, f: FaultSpec) -> str:
        if f.recovery is not None or f.phase == "recovery":
            return "no recovery of a failure (at or after its step) moved state through its node"
        return super().why_not_fired(f)

    def describe(self, f: FaultSpec) -> str:
        if f.coordinator:
            return f"SIGKILL the coordinator when rank 0 is in its {f.phase} phase"
        if f.member is not None:
            return f"SIGKILL {MEMBER_TARGET} member {'leader' if f.member < 0 else f.member}"
        if len(f.nodes) == 2:
            return f"SIGKILL nodes {f.nodes[0]} and {f.nodes[1]} in the same step ({f.phase} phase)"
        if len(f.nodes) == 1 and f.phase != "recovery" and f.recovery is None:
            return f"SIGKILL node {f.nodes[0]} in its {f.phase} phase"
        return super().describe(f)


class Hang(FaultKind):
    name = "hang"
    forms = ("hang:node=I@step=S",)

    def act(self, f: FaultSpec, injector: FaultInjector) -> None:
        signal_node(os.getppid(), signal.SIGSTOP)

    def describe(self, f: FaultSpec) -> str:
        return f"SIGSTOP node {f.node} in its {f.phase} phase"


class Crash(FaultKind):
    name = "crash"
    forms = ("crash:rank=R@step=S",)
    targets = frozenset({"rank"})
    phases = KILL_PHASES + (COPY_PHASE,)

    def has_target(self, nodes: tuple[int, ...], rack: int | None, rank: int | None, coordinator: bool,
                   member: int | None, target: str | None) -> bool:
        return rank is not None

    def format_target(self, f: FaultSpec) -> str:
        return f"rank={f.rank}"

    def strikes(self, f: FaultSpec, rank: int, slot: int, topo: Topology) -> bool:
        return rank == f.rank

    def target_nodes(self, f: FaultSpec, node_id: str, topo: Topology) -> list[str]:
        return [node_id]

    def act(self, f: FaultSpec, injector: FaultInjector) -> None:
        os._exit(17)

    def describe(self, f: FaultSpec) -> str:
        return f"worker rank {f.rank} exits in its {f.phase} phase"


class Corrupt(FaultKind):
    name = "corrupt"
    forms = ("corrupt:node=I@step=S",)
    phases = KILL_PHASES + ("transfer",)

    def check_phase(self, text: str, when: dict[str, str]) -> None:
        if "phase" in when and when["phase"] != "transfer":
            raise bad_spec(text, f"phase={when['phase']!r}: a corruption is at rest (no phase: the replicas node I "
                                 "received during step S) or in flight (phase=transfer)")

    def point(self, f: FaultSpec) -> Point:
        return Point.TRANSFER if f.phase == "transfer" else Point.REPLICAS

    def held_at(self, f: FaultSpec, step: int) -> bool:
        return f.step == step + 1 and f.phase != "transfer"  # it hits the replicas received during `step`

    def answered_by_recovery(self, f: FaultSpec) -> bool:
        return False  # a corruption kills nothing: the kill it comes with is what a recovery answers

    def harms_node(self, f: FaultSpec) -> bool:
        return False  # (the replicas it flips are repaired or rejected; the node it hits runs on)

    def why_not_fired(self, f: FaultSpec) -> str:
        if f.phase == "transfer":
            return "no recovery at or after its step took a copy of the optimizer state from its node"
        return "its node received no replica during its step (not in the job, or the run ended first)"

    def describe(self, f: FaultSpec) -> str:
        if f.phase == "transfer":
            return f"corrupt the optimizer-state transfers node {f.node} sends"
        return f"corrupt node {f.node}'s replicas of step {(f.step or 0) - 1}"


class Nan(FaultKind):
    name = "nan"
    forms = ("nan:step=S",)
    built_in_only = "it poisons the built-in trainer's loss; a script's loss is its own"
    waits = False
    needs_protection = False

    def check_phase(self, text: str, when: dict[str, str]) -> None:
        if "phase" in when:
            raise bad_spec(text, "nan:step=S takes no phase (the loss of step S is NaN)")

    def has_target(self, nodes: tuple[int, ...], rack: int | None, rank: int | None, coordinator: bool,
                   member: int | None, target: str | None) -> bool:
        return not target

    def format_target(self, f: FaultSpec) -> str:
        return ""

    def point(self, f: FaultSpec) -> Point:
        return Point.LOSS

    def held_at(self, f: FaultSpec, step: int) -> bool:
        return False

    def why_not_fired(self, f: FaultSpec) -> str:
        return "the run ended before its step"

    def describe(self, f: FaultSpec) -> str:
        return f"the loss of step {f.step} is NaN"


class Partition(FaultKind):
    name = "partition"
    forms = ("partition:node=I@step=S[,for=SECONDS]",)
    lasts = True

    def check_form(self, text: str, when: dict[str, str]) -> None:
        if "step" not in when or "phase" in when:
            raise bad_spec(text, "expected partition:node=I@step=S[,for=SECONDS][,wait=SECONDS]")

    def point(self, f: FaultSpec) -> Point:
        return Point.HEARTBEAT

    def refuse(self, f: FaultSpec, local: bool) -> str | None:
        if local:
            return ("a partition needs hosts with their own addresses (`phoenixft coordinator` on one host, "
                    "`phoenixft agent` on the others), not one machine's loopback")
        return None

    def describe(self, f: FaultSpec) -> str:
        return f"cut the host of node {f.node} off the network" + (f" for {f.duration:g}s" if f.duration else "")


class Slow(FaultKind):
    """A straggler: from step S on, the node's compute takes F times as long (a thermally throttled GPU, a
    noisy neighbour). It fires once (recorded at step S); a spare that later takes the node's slot is not
    slow (the fault strikes the node it first struck, by id)."""

    name = "slow"
    forms = ("slow:node=I@step=S,factor=F",)
    built_in_only = "it stretches the built-in trainer's compute, which a script's loop replaces"
    waits = False
    scales = True
    needs_protection = False  # (detection needs none; evicting the straggler is a hot-swap)

    def check_form(self, text: str, when: dict[str, str]) -> None:
        if "step" not in when or "factor" not in when:
            raise bad_spec(text, "expected slow:node=I@step=S,factor=F (F > 1: how many times slower its compute is)")

    def check_phase(self, text: str, when: dict[str, str]) -> None:
        if "phase" in when:
            raise bad_spec(text, "slow:node=I@step=S,factor=F takes no phase (the node's whole compute is slower)")

    def format(self, f: FaultSpec) -> str:
        return f"{self.name}:{self.format_target(f)}@step={f.step},factor={_num(f.factor)}"

    def point(self, f: FaultSpec) -> Point:
        return Point.COMPUTE

    def held_at(self, f: FaultSpec, step: int) -> bool:
        return False

    def why_not_fired(self, f: FaultSpec) -> str:
        return "its node was not in the job when its step came, or the run ended first"

    def describe(self, f: FaultSpec) -> str:
        return f"node {f.node}'s compute {f.factor:g}x slower from step {f.step} on"


class Preempt(FaultKind):
    """A preemption with notice (a spot instance's two minutes, Slurm's `--signal`, Kubernetes' grace period):
    the node's agent receives its drain signal once the job reaches step S, and T seconds later the node's
    every process is SIGKILLed unless it has left. Fired by the agent (`faults/notice.py`)."""

    name = "preempt"
    forms = ("preempt:node=I@step=S,notice=T",)
    waits = False
    notices = True

    def check_form(self, text: str, when: dict[str, str]) -> None:
        if "step" not in when or "phase" in when or "notice" not in when:
            raise bad_spec(text, "expected preempt:node=I@step=S,notice=SECONDS")

    def format(self, f: FaultSpec) -> str:
        return f"{self.name}:{self.format_target(f)}@step={f.step},notice={_num(f.notice or 0.0)}"

    def point(self, f: FaultSpec) -> Point:
        return Point.NOTICE

    def describe(self, f: FaultSpec) -> str:
        return f"preemption notice to node {f.node} ({f.notice or 0:g}s before its SIGKILL)"

    def why_not_fired(self, f: FaultSpec) -> str:
        return "its slot's agent did not see the job reach its step (the run ended first)"


SDC_TARGETS = ("param", "grad", "shard")
SDC_BITS = {"param": 32, "grad": 32, "shard": 32}  # bits of an element (bf16 parameters: 16, checked on the rank)


class Sdc(FaultKind):
    """Silent data corruption: one bit flipped in a tensor of a node, nothing crashes. The training
    process carries out `param` and `grad` (phoenixft.sdc); `shard` (a snapshot half or a replica at
    rest) is the scrubber's."""

    name = "sdc"
    forms = ("sdc:node=I@step=S,target=param|grad|shard[,bit=B][,persist]",)
    built_in_only = "it flips a bit where the built-in trainer's checks look (they are off for a script)"
    options = frozenset({"target", "bit", "persist"})
    flags = frozenset({"persist"})
    waits = False

    def check_form(self, text: str, when: dict[str, str]) -> None:
        if "step" not in when or "phase" in when or "target" not in when:
            raise bad_spec(text, "expected " + self.forms[0])

    def parse_options(self, text: str, when: dict[str, str]) -> dict[str, Any]:
        target = when["target"]
        if target not in SDC_TARGETS:
            raise bad_spec(text, f"target={target!r}: one of {', '.join(SDC_TARGETS)}")
        bit = None
        if "bit" in when:
            if not when["bit"].isdigit() or int(when["bit"]) >= SDC_BITS[target]:
                raise bad_spec(text, f"bit={when['bit']!r}: a bit of a {SDC_BITS[target]}-bit element, "
                                     f"0..{SDC_BITS[target] - 1}")
            bit = int(when["bit"])
        if when.get("persist", "") != "":
            raise bad_spec(text, "persist takes no value (write ,persist)")
        if target == "shard" and "persist" in when:
            raise bad_spec(text, "persist is for target=param or target=grad (a unit that computes wrong); a copy at "
                                 "rest is flipped once")
        return {"target": target, "bit": bit, "persist": "persist" in when}

    def format(self, f: FaultSpec) -> str:
        when = [f"step={f.step}", f"target={f.target}"]
        if f.bit is not None:
            when.append(f"bit={f.bit}")
        if f.persist:
            when.append("persist")
        return f"{self.name}:{self.format_target(f)}@{','.join(when)}"

    def point(self, f: FaultSpec) -> Point:
        # shard: a committed copy at rest, flipped once the protection of step S-1 committed (faults/at_rest.py)
        return Point.AT_REST if f.target == "shard" else Point.SDC

    def held_at(self, f: FaultSpec, step: int) -> bool:
        return False

    def fires_at(self, f: FaultSpec, step: int, target: str) -> bool:
        """Whether f corrupts `target` in step `step` (once at its step, or every step from it on)."""
        return f.target == target and f.step is not None and (step == f.step or (f.persist and step > f.step))

    def act(self, f: FaultSpec, injector: FaultInjector) -> None:
        if f.target == "shard":
            injector.flip_at_rest(f)  # (param and grad are flipped where the worker computes: sdc_flip)

    def answered_by_recovery(self, f: FaultSpec) -> bool:
        return f.target != "shard"  # a corrupt copy at rest is repaired, not recovered from

    def why_not_fired(self, f: FaultSpec) -> str:
        if f.target == "shard":
            return "its node committed no protected copy during its step (not in the job, or the run ended first)"
        return "its node computed nothing at its step (not in the job, or the run ended first)"

    def describe(self, f: FaultSpec) -> str:
        what = {"param": "its copy of the parameters", "grad": "a microbatch's gradient",
                "shard": "a snapshot half or replica it holds"}[f.target]
        bit = f"bit {f.bit}" if f.bit is not None else "a drawn bit"
        return f"flip {bit} of {what} on node {f.node}" + (" every step" if f.persist else "") + \
            f" from step {f.step}"


class Sick(FaultKind):
    """A spare whose health checks fail: its matrix product computes a wrong checksum (one operand entry
    off by one, as a faulty unit would), from the start or, with @step=S, in every check it starts once the
    job has reached step S (a background re-check, or the one before its promotion)."""

    name = "sick"
    forms = ("sick:spare=J[@step=S]",)
    targets = frozenset({"spare"})
    phases = ("forward",)
    waits = False
    needs_when = False

    def check_form(self, text: str, when: dict[str, str]) -> None:
        if set(when) - {"step"}:
            raise bad_spec(text, "expected sick:spare=J or sick:spare=J@step=S")

    def check_phase(self, text: str, when: dict[str, str]) -> None:
        if "phase" in when:
            raise bad_spec(text, "sick:spare=J takes no phase (its health checks fail)")

    def has_target(self, nodes: tuple[int, ...], rack: int | None, rank: int | None, coordinator: bool,
                   member: int | None, target: str | None) -> bool:
        return bool(target) and str(target).startswith("spare=")

    def format(self, f: FaultSpec) -> str:
        return f"sick:spare={f.spare}" + (f"@step={f.step}" if f.step is not None else "")

    def format_target(self, f: FaultSpec) -> str:
        return f"spare={f.spare}"

    def point(self, f: FaultSpec) -> Point:
        return Point.HEALTH

    def held_at(self, f: FaultSpec, step: int) -> bool:
        return False

    def strikes(self, f: FaultSpec, rank: int, slot: int, topo: Topology) -> bool:
        return False  # no worker fires it: the spare's agent does, in its health check

    def target_nodes(self, f: FaultSpec, node_id: str, topo: Topology) -> list[str]:
        return [f"s{f.spare}"]

    def fails_health_check(self, f: FaultSpec, node: str, progress: int) -> bool:
        return node == f"s{f.spare}" and (f.step is None or progress >= f.step)

    def answered_by_recovery(self, f: FaultSpec) -> bool:
        return False  # the gate answers it: the spare is never promoted

    def why_not_fired(self, f: FaultSpec) -> str:
        return f"spare s{f.spare} ran no health check after its step (not started, or the run ended first)"

    def describe(self, f: FaultSpec) -> str:
        return f"spare s{f.spare}'s health checks fail" + (f" from step {f.step} on" if f.step is not None else "")


KINDS: dict[str, FaultKind] = {k.name: k for k in (Kill(), Hang(), Crash(), Corrupt(), Nan(), Partition(), Slow(),
                                                    Sdc(), Preempt(), Sick())}


def join_or(items: list[str], last: str) -> str:
    """"a, b and c" (last="and")."""
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else "".join(items)

