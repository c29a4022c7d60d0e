"""`phoenixft demo`: the product in one minute.

Three runs of one configuration: unprotected and failure-free (the reference), protected and
failure-free (what protection costs), and protected with a node SIGKILLed mid-run (what a
failure costs). Prints them side by side: same final state? recovery time, lost steps, each
run's median step time. What protection costs per step is measured by `python bench/overhead.py` (runs
interleaved in one invocation): three short runs one after the other cannot say it, so the demo does not
compute it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.observe.display import Display
from phoenixft.recovery.invariants import invariants_hold
from phoenixft.runtime.launcher import INTERRUPTED, check_mode, run_job

__all__ = ["demo"]


def _cfg(base: dict[str, Any], run_dir: Path, **kw: Any) -> RunConfig:
    cfg = RunConfig(**{**base, **kw, "run_dir": str(run_dir), "quiet": True})
    cfg.validate()
    return cfg


def _check_kill(*, steps: int, nodes: int, kill_step: int, kill_node: int, phase: str) -> None:
    """The demo's own flags, named as the user gave them (not as the --inject spec they become)."""
    from phoenixft.errors import UserError
    from phoenixft.faults.spec import KILL_PHASES

    if steps < 2:  # (the kill needs a step after the first; --steps itself is checked by the runs)
        raise UserError(f"--steps={steps} is invalid: the demo kills a node mid-run, so need --steps >= 2")
    if nodes < 2:
        raise UserError(f"--nodes={nodes} is invalid: the killed node's state comes back from a replica on another "
                        "node, so need --nodes >= 2")
    if not 0 <= kill_node < nodes:
        raise UserError(f"--kill-node={kill_node} is invalid: must be in 0..{nodes - 1} (--nodes {nodes})")
    if not 1 <= kill_step <= steps:
        raise UserError(f"--kill-step={kill_step} is invalid: must be in 1..{steps} (--steps {steps}; 0 = mid-run)")
    if phase not in KILL_PHASES:
        raise UserError(f"--phase={phase!r} is invalid: one of {', '.join(KILL_PHASES)}")


def demo(*, steps: int, nodes: int, model: str, kill_step: int, kill_node: int, phase: str, run_dir: str) -> int:
    import time

    _check_kill(steps=steps, nodes=nodes, kill_step=kill_step, kill_node=kill_node, phase=phase)
    root = Path(run_dir or "runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    base = {"nodes": nodes, "workers_per_node": 1, "steps": steps, "model": model, "spares": 1}
    spec = f"kill:node={kill_node}@step={kill_step},phase={phase}"
    plan = [
        ("reference (unprotected, no failure)", _cfg(base, root / "reference", protect="none", spares=0)),
        ("protected, no failure", _cfg(base, root / "protected")),
        (f"protected, {spec}", _cfg(base, root / "faulty", inject=[spec])),
    ]
    for _, cfg in plan:  # (validated by _cfg; what this machine can run, before the first one starts)
        check_mode(cfg, local=True)
    reports = []
    for i, (name, cfg) in enumerate(plan, 1):
        print(f"[{i}/3] {name} ...", file=sys.stderr, flush=True)
        reports.append(run_job(cfg, Display(quiet=True, steps=cfg.steps)))
        if reports[-1].get("state") == INTERRUPTED:  # Ctrl-C stops the demo, not just this one of its runs
            raise KeyboardInterrupt
    ref, clean, faulty = reports
    ok = all(r.get("state") == "done" for r in reports)
    same = ok and ref["final_state_sha256"] == faulty["final_state_sha256"] == clean["final_state_sha256"]
    rec = (faulty.get("recoveries") or [{}])[0]
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f} ms"  # noqa: E731
    med = lambda r: r.get("step_time_s", {}).get("median")  # noqa: E731
    print()
    print(f"{'':34}{'reference':>18}{'protected':>18}{'node killed':>18}")
    print(f"{'steps completed':34}" + "".join(f"{r.get('steps_completed', 0):>18}" for r in reports))
    print(f"{'final state sha256':34}" + "".join(f"{(r.get('final_state_sha256') or '-')[:12]:>18}" for r in reports))
    print(f"{'median step time':34}" + "".join(f"{ms(med(r)):>18}" for r in reports))
    print()
    print(f"identical final state (bitwise):   {'yes' if same else 'NO'}")
    if rec:
        st = rec.get("stages", {})
        print(f"recovery ({rec.get('action')}):               {ms(rec.get('recovery_s'))} from the kill to the end "
              f"of the first step after it (detect {ms(st.get('detect_s'))}, reconfigure "
              f"{ms(st.get('reconfigure_s'))}, params {ms(st.get('restore_params_s'))}, optimizer "
              f"{ms(st.get('restore_optimizer_s'))})")
        print(f"lost steps:                        {rec.get('lost_steps')}   invariants I1-I4: "
              f"{'all true' if invariants_hold(rec) else rec.get('invariants')}")
    print(f"runs: {root}")
    try:
        from phoenixft.observe.html_report import write_report

        html = write_report(Path(faulty["run_dir"]), reference=Path(ref["run_dir"]))
        print(f"report: {html}")
    except ImportError:
        pass
    return 0 if same else 1
