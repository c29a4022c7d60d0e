"""``phoenixft simulate``: command-line front end of the failure simulator and cost model.

Subcommands: ``worked-example``, ``paper-scenario``, ``shard-loss``, ``scale-sweep`` and ``run``.
Each prints a table, writes ``--json PATH`` and a PNG (``--plot PATH``; by default next to the
JSON file). A bad flag value prints one line naming the flag, the value and what is valid, and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

__all__ = ["add_parser", "main"]

_SCALE_FLAGS = ("restart_s", "hotswap_s", "inplace_s", "shrink_s", "overhead_ratio")


# ----------------------------------------------------------------------------------- validation
def _number(kind: str, test: Callable[[float], bool], valid: str) -> Callable[[str], float]:
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected {valid}") from None
        if math.isnan(v) or not test(v):
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected {valid}")
        return v

    conv.__name__ = kind
    return conv


_pos = _number("positive", lambda v: 0 < v < math.inf, "a positive finite number")
_nonneg = _number("non-negative", lambda v: 0 <= v < math.inf, "a finite number >= 0")
_prob = _number("probability", lambda v: 0 <= v <= 1, "a probability in [0, 1]")
_phi = _number("fraction", lambda v: 0 <= v < 1, "a fraction in [0, 1)")
_ratio = _number("ratio", lambda v: 1 <= v < math.inf, "a finite ratio >= 1")
_pos_or_inf = _number("positive-or-inf", lambda v: v > 0, "a positive number or 'inf'")


def _int_at_least(lo: int) -> Callable[[str], int]:
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected an integer >= {lo}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected an integer >= {lo}")
        return v

    conv.__name__ = f"int>={lo}"
    return conv


def _gpus_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(
            f"invalid value {s!r}: expected comma-separated GPU counts >= 1, e.g. 512,8192,131072"
        )
    return vals


def _policies(s: str) -> list[str]:
    from .scenario import POLICY_ALIASES, canonical_policy

    try:
        out = [canonical_policy(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(
            f"invalid value {s!r}: expected a comma-separated list of {', '.join(sorted(POLICY_ALIASES))}"
        )
    return list(dict.fromkeys(out))


def _one_line_error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message.splitlines()[0] if message else 'invalid arguments'}\n")


def _patch(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.error = types.MethodType(_one_line_error, p)  # type: ignore[method-assign]
    return p


class _UserError(Exception):
    """A bad flag combination or input file: one line on stderr, exit status 2."""


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command so that a :class:`_UserError` becomes one stderr line and status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except _UserError as err:
            print(f"phoenixft simulate: error: {err}", file=sys.stderr)
            return 2

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# ------------------------------------------------------------------------------------ parsers
def _add_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    g.add_argument(
        "--plot", metavar="PATH", help="write a PNG plot to PATH (default: the --json path with .png)"
    )
    g.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def _add_mc(p: argparse.ArgumentParser, trajectories: int = 1000) -> None:
    g = p.add_argument_group("Monte Carlo")
    g.add_argument(
        "--trajectories",
        type=_int_at_least(1),
        default=trajectories,
        help=f"simulated runs per policy and point (default {trajectories})",
    )
    g.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed (default 0)")


def _add_scenario(p: argparse.ArgumentParser) -> None:
    from .scenario import DEFAULT_GPU_MTTF_S

    g = p.add_argument_group("scenario (defaults: FT-HSDP-like, 18 min MTTF at 100,000 GPUs)")
    g.add_argument("--gpus-per-node", type=_int_at_least(1), default=8, help="GPUs per node (default 8)")
    g.add_argument("--steps", type=_int_at_least(1), default=100_000, help="training steps (default 100000)")
    g.add_argument("--step-s", type=_pos, default=20.0, help="failure-free step time, s (default 20)")
    g.add_argument(
        "--gpu-mttf-s",
        type=_pos,
        default=DEFAULT_GPU_MTTF_S,
        help=f"MTTF of one GPU, s (default {DEFAULT_GPU_MTTF_S:.3g}); node MTTF = this / GPUs per node",
    )
    g.add_argument(
        "--arrival",
        choices=("exponential", "weibull"),
        default="exponential",
        help="failure inter-arrival law (default exponential)",
    )
    g.add_argument(
        "--weibull-shape", type=_pos, default=0.7, help="Weibull shape, < 1 is bursty (default 0.7)"
    )
    g.add_argument(
        "--transient-frac",
        type=_prob,
        default=0.0,
        help="fraction of node failures that are transient (default 0: all permanent, as in the paper)",
    )
    g.add_argument(
        "--domain-size", type=_int_at_least(1), default=4, help="nodes per rack/switch domain (default 4)"
    )
    g.add_argument(
        "--domain-mttf-s",
        type=_pos_or_inf,
        default=math.inf,
        help="MTTF of one domain (correlated events), s (default inf: none)",
    )
    g.add_argument("--spares", type=_int_at_least(0), default=16, help="spare nodes in the pool (default 16)")
    g.add_argument(
        "--provision-s", type=_nonneg, default=3600.0, help="time to replace a used spare, s (default 3600)"
    )
    g.add_argument(
        "--restart-s", type=_nonneg, help="checkpoint-restart job restart, s (default: fit at the scale)"
    )
    g.add_argument(
        "--ckpt-s", type=_nonneg, default=8.9, help="blocking persistent checkpoint write, s (default 8.9)"
    )
    g.add_argument("--hotswap-s", type=_nonneg, help="hot-swap recovery, s (default: fit at the scale)")
    g.add_argument("--inplace-s", type=_nonneg, help="in-place restart, s (default: the hot-swap time)")
    g.add_argument("--shrink-s", type=_nonneg, help="shrink reconfiguration, s (default: the hot-swap time)")
    g.add_argument(
        "--overhead-ratio", type=_ratio, help="protected / unprotected step time (default 1 or calibrated)"
    )
    g.add_argument("--replicas", type=_int_at_least(1), default=1, help="in-memory replicas k (default 1)")
    g.add_argument(
        "--placement",
        choices=("aware", "unaware"),
        default="aware",
        help="replicas in other failure domains (aware) or on ring neighbours (default aware)",
    )
    g.add_argument(
        "--persist-every",
        type=_int_at_least(0),
        default=5000,
        help="persistent checkpoint interval of phoenix/shrink, steps; 0 = none (default 5000)",
    )
    g.add_argument("--persist-s", type=_nonneg, default=8.9, help="their persistent write, s (default 8.9)")
    g.add_argument(
        "--no-spare",
        choices=("shrink", "wait"),
        default="shrink",
        help="phoenix with an empty spare pool: shrink (default) or wait",
    )
    g.add_argument(
        "--replica-nodes",
        type=_int_at_least(1),
        default=1,
        help="nodes a shrink drops per lost node, its whole data-parallel replica: 1 when data-parallel only, "
        "the pipeline depth PP of a TP x PP mesh with a tensor-parallel group per node (default 1)",
    )
    g.add_argument(
        "--calibrate", metavar="BENCH_JSON", help="measured recovery/overhead figures (bench JSON)"
    )


def _add_worked(sub: argparse._SubParsersAction) -> None:
    """``worked-example``: the review's worked example, Eq. (1)-(5)."""
    p = _patch(
        sub.add_parser(
            "worked-example",
            help="the review's worked example, Eq. (1)-(5)",
            description="The seed review's worked example, term by term, then the same cluster"
            " under the exact model and by Monte Carlo.",
        )
    )
    p.add_argument("--mttf-s", type=_pos, default=1080.0, help="system MTTF, s (default 1080)")
    p.add_argument("--step-s", type=_pos, default=20.0, help="step time, s (default 20)")
    p.add_argument("--k", type=_int_at_least(1), default=100, help="checkpoint interval, steps (default 100)")
    p.add_argument("--restart-s", type=_nonneg, default=600.0, help="restart, s (default 600)")
    p.add_argument("--overhead-s", type=_nonneg, default=5.0, help="checkpoint overhead, s (default 5)")
    p.add_argument("--hotswap-s", type=_nonneg, default=30.0, help="hot-swap, s (default 30)")
    p.add_argument(
        "--phi", type=_phi, default=0.5, help="expected fraction of the interrupted step (default 0.5)"
    )
    p.add_argument(
        "--steps", type=_int_at_least(1), default=20_000, help="steps per simulated run (default 20000)"
    )
    _add_mc(p)
    _add_output(p)
    p.set_defaults(func=_guard(_cmd_worked))


def _add_paper(sub: argparse._SubParsersAction) -> None:
    """``paper-scenario``: the paper's 64-node scenario."""
    p = _patch(
        sub.add_parser(
            "paper-scenario",
            help="the paper's 64-node scenario (18.8x claim)",
            description="The paper's 2.3B / 64-node real-world scenario: the two-failure"
            " arithmetic and its distribution over many runs.",
        )
    )
    p.add_argument("--gpu-mttf-s", type=_pos, help="MTTF of one GPU, s (default: 18 min at 100,000 GPUs)")
    _add_mc(p, trajectories=4000)  # 0.5 failures per run: 4,000 runs give about 2,000 failures
    _add_output(p)
    p.set_defaults(func=_guard(_cmd_paper))


def _add_shard(sub: argparse._SubParsersAction) -> None:
    """``shard-loss``: the shard-loss probability table, Eq. (6)."""
    p = _patch(
        sub.add_parser(
            "shard-loss",
            help="shard-loss probability table, Eq. (6)",
            description="Probability that a shard loses its owner and all k replicas.",
        )
    )
    p.add_argument(
        "--shards", type=_int_at_least(1), default=128, help="data-parallel shards D (default 128)"
    )
    p.add_argument(
        "--p", type=_prob, default=1e-6, help="per-node per-step failure probability (default 1e-6)"
    )
    p.add_argument(
        "--q", type=_prob, default=1e-4, help="per-domain per-step failure probability (default 1e-4)"
    )
    p.add_argument(
        "--steps", type=_int_at_least(1), default=100_000, help="steps of the run (default 100000)"
    )
    p.add_argument("--k-max", type=_int_at_least(1), default=3, help="largest k in the table (default 3)")
    _add_output(p)
    p.set_defaults(func=_guard(_cmd_shard))


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    """``scale-sweep``: ETTR of each policy across scales."""
    p = _patch(
        sub.add_parser(
            "scale-sweep",
            help="ETTR from 512 to 131,072 GPUs",
            description="ETTR of each policy across scales; checkpoint-restart runs at its"
            " exact-optimal (Young/Daly) interval at every scale.",
        )
    )
    p.add_argument(
        "--gpus-list",
        type=_gpus_list,
        default=None,
        help="comma-separated GPU counts (default 512,1024,...,131072)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=["checkpoint-restart", "phoenix"],
        help="comma-separated: cr, phoenix, inplace, shrink (default cr,phoenix)",
    )
    _add_scenario(p)
    _add_mc(p)
    _add_output(p)
    p.set_defaults(func=_guard(_cmd_sweep))


def _add_run(sub: argparse._SubParsersAction) -> None:
    """``run``: a free-form scenario from flags."""
    p = _patch(
        sub.add_parser(
            "run",
            help="free-form scenario from flags",
            description="Simulate one scenario under several policies.",
        )
    )
    p.add_argument("--gpus", type=_int_at_least(1), default=131_072, help="GPUs in the job (default 131072)")
    p.add_argument(
        "--system-mttf-s",
        type=_pos,
        help="set the job's node-failure MTTF directly, s (overrides --gpu-mttf-s)",
    )
    p.add_argument(
        "--ckpt-every",
        type=_int_at_least(1),
        help="checkpoint interval K of cr / inplace, steps (default: exact-optimal)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=["checkpoint-restart", "phoenix", "inplace", "shrink"],
        help="comma-separated: cr, phoenix, inplace, shrink (default all)",
    )
    _add_scenario(p)
    _add_mc(p)
    _add_output(p)
    p.set_defaults(func=_guard(_cmd_run))


def _build(sub: argparse._SubParsersAction) -> None:
    """Add the simulator's subcommands."""
    _add_worked(sub)
    _add_paper(sub)
    _add_shard(sub)
    _add_sweep(sub)
    _add_run(sub)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand (with its own subcommands) to a CLI's subparsers."""
    p = _patch(
        subparsers.add_parser(
            "simulate",
            help="simulate failures at scale: ETTR of checkpoint-restart vs hot-swap",
            description="Analytic cost model and Monte Carlo simulator of training runs under failures.",
        )
    )
    sub = p.add_subparsers(dest="sim_command", metavar="COMMAND")
    _build(sub)

    def _no_command(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=_no_command)


# ------------------------------------------------------------------------------------ helpers
def jsonable(obj: Any) -> Any:
    """Recursively convert numpy values and non-finite floats (to null) for strict JSON."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.bool_ | bool):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        f = float(obj)
        return f if math.isfinite(f) else None
    return obj


def _emit(command: str, args: argparse.Namespace, result: dict[str, Any], text: str, t0: float) -> int:
    print(text)
    result = {"command": f"simulate {command}", "result": result, "elapsed_s": time.perf_counter() - t0}
    if args.json:
        path = Path(args.json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(jsonable(result), indent=1, allow_nan=False) + "\n")
        except OSError as err:
            raise _UserError(f"--json: cannot write {args.json!r}: {err.strerror or err}") from None
        print(f"wrote {path}")
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot_path and not args.no_plot:
        from .plots import plot

        try:
            out = plot(command, jsonable(result["result"]), plot_path)
        except OSError as err:
            raise _UserError(f"--plot: cannot write {plot_path!r}: {err.strerror or err}") from None
        print(f"wrote {out}")
    return 0


def _calibration(args: argparse.Namespace) -> Any:
    from .calibrate import CalibrationError, default_calibration, load_calibration

    if not args.calibrate:
        return default_calibration()
    try:
        return load_calibration(args.calibrate)
    except CalibrationError as err:
        raise _UserError(str(err)) from None


def _base_scenario(args: argparse.Namespace, gpus: int) -> Any:
    from .scenario import Scenario

    return Scenario(
        gpus=gpus,
        gpus_per_node=args.gpus_per_node,
        steps=args.steps,
        step_s=args.step_s,
        gpu_mttf_s=args.gpu_mttf_s,
        arrival=args.arrival,
        weibull_shape=args.weibull_shape,
        transient_frac=args.transient_frac,
        domain_size=args.domain_size,
        domain_mttf_s=args.domain_mttf_s,
        spares=args.spares,
        provision_s=args.provision_s,
        ckpt_s=args.ckpt_s,
        replicas=args.replicas,
        placement=args.placement,
        persist_every=args.persist_every,
        persist_s=args.persist_s,
        no_spare=args.no_spare,
        replica_nodes=args.replica_nodes,
    )


def _overrides(args: argparse.Namespace) -> dict[str, float]:
    out = {k: getattr(args, k) for k in _SCALE_FLAGS if getattr(args, k) is not None}
    if args.hotswap_s is not None:
        out.setdefault("inplace_s", args.hotswap_s)
        out.setdefault("shrink_s", args.hotswap_s)
    return out


# ----------------------------------------------------------------------------------- commands
def _cmd_worked(args: argparse.Namespace) -> int:
    from .experiments import worked_example
    from .report import worked_text

    t0 = time.perf_counter()
    res = worked_example(
        args.mttf_s,
        args.step_s,
        args.k,
        args.restart_s,
        args.overhead_s,
        args.hotswap_s,
        args.phi,
        trajectories=args.trajectories,
        steps=args.steps,
        seed=args.seed,
    )
    return _emit("worked-example", args, res, worked_text(res), t0)


def _cmd_paper(args: argparse.Namespace) -> int:
    from .experiments import paper_scenario
    from .report import paper_text

    t0 = time.perf_counter()
    res = paper_scenario(args.trajectories, args.seed, args.gpu_mttf_s)
    return _emit("paper-scenario", args, res, paper_text(res), t0)


def _cmd_shard(args: argparse.Namespace) -> int:
    from .experiments import shard_loss_table
    from .report import shard_loss_text

    t0 = time.perf_counter()
    res = shard_loss_table(args.shards, args.p, args.q, args.steps, args.k_max)
    return _emit("shard-loss", args, res, shard_loss_text(res), t0)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .experiments import DEFAULT_SWEEP_GPUS, scale_sweep
    from .report import calibration_text, sweep_text

    t0 = time.perf_counter()
    cal = _calibration(args)
    gpus = args.gpus_list or list(DEFAULT_SWEEP_GPUS)
    base = _base_scenario(args, gpus[0])
    res = scale_sweep(
        base,
        gpus,
        args.policies,
        cal=cal,
        overrides=_overrides(args),
        trajectories=args.trajectories,
        seed=args.seed,
    )
    text = calibration_text(res["calibration"]) + "\n" + sweep_text(res)
    return _emit("scale-sweep", args, res, text, t0)


def _cmd_run(args: argparse.Namespace) -> int:
    from .experiments import run_policies, scenario_at_scale
    from .report import calibration_text, run_text

    t0 = time.perf_counter()
    cal = _calibration(args)
    base = _base_scenario(args, args.gpus)
    if args.system_mttf_s is not None:
        base = base.with_(gpu_mttf_s=args.system_mttf_s * base.nodes * base.gpus_per_node)
    sc = scenario_at_scale(base, args.gpus, cal, _overrides(args))
    res = run_policies(
        sc, args.policies, trajectories=args.trajectories, seed=args.seed, ckpt_every=args.ckpt_every
    )
    res["trajectories"] = args.trajectories
    res["calibration"] = cal.as_dict()
    text = calibration_text(res["calibration"]) + "\n" + run_text(res)
    return _emit("run", args, res, text, t0)


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m phoenixft.sim``; ``simulate`` may be omitted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "simulate":
        argv = ["simulate", *argv]
    root = _patch(argparse.ArgumentParser(prog="phoenixft"))
    subs = root.add_subparsers(dest="command")
    add_parser(subs)
    args = root.parse_args(argv)
    return int(args.func(args))
