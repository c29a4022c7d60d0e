"""Fault-injection specs: `kill:node=I@step=S[,phase=P]`, `corrupt:node=I@step=S`.

A fault fires at most once per run: the first process that reaches it claims it atomically in
the control-plane store (`store.add`), records the fault time, and only then acts, so a replayed
step after recovery never fires the same fault again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from phoenixft.errors import UserError

__all__ = ["FaultSpec", "parse_fault", "KILL_PHASES"]

KILL_PHASES = ("forward", "backward", "replicate", "optimizer")
_SPEC = re.compile(r"^(?P<kind>kill|corrupt):(?P<target>[^@]+)@(?P<when>.+)$")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    text: str
    index: int
    kind: str  # kill | corrupt
    node: int | None
    step: int
    phase: str  # for kill: one of KILL_PHASES


def _kv(part: str, text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in part.split(","):
        if "=" not in item:
            raise UserError(f"--inject={text!r} is invalid: expected key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def parse_fault(text: str, index: int = 0) -> FaultSpec:
    m = _SPEC.match(text.strip())
    valid = "expected kill:node=I@step=S[,phase=forward|backward|replicate|optimizer] or corrupt:node=I@step=S"
    if not m:
        raise UserError(f"--inject={text!r} is invalid: {valid}")
    target = _kv(m["target"], text)
    when = _kv(m["when"], text)
    if set(target) != {"node"}:
        raise UserError(f"--inject={text!r} is invalid: target must be node=I; {valid}")
    if "step" not in when or set(when) - {"step", "phase"}:
        raise UserError(f"--inject={text!r} is invalid: {valid}")
    try:
        node = int(target["node"])
        step = int(when["step"])
    except ValueError:
        raise UserError(f"--inject={text!r} is invalid: node and step must be integers") from None
    phase = when.get("phase", "forward")
    if m["kind"] == "kill" and phase not in KILL_PHASES:
        raise UserError(f"--inject={text!r} is invalid: phase={phase!r}, valid phases: {', '.join(KILL_PHASES)}")
    return FaultSpec(text=text, index=index, kind=m["kind"], node=node, step=step, phase=phase)
