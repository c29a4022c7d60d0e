"""`phoenixft chaos`: a seeded fault campaign against a failure-free reference, with a verdict.

Takes every `phoenixft run` flag (except `--inject`, which the campaign draws, and `--report`,
which here is the campaign's JSON report) plus `--faults N`, `--seed S` (the schedule and the
training), `--allow-unsurvivable`. Defaults differ from `run` where a campaign needs it:
`--failure-timeout 3` (hangs are found quickly) and `--repair-after 5` (lost nodes come back as
spares). Exit code 0 only on a pass; 1 on a fail; 3 when the schedule is unsurvivable by design;
2 for bad flags. The work is done by `phoenixft.faults.chaos`.
"""

from __future__ import annotations

import argparse

from phoenixft.config import add_run_arguments, check_output_file, config_from_args

__all__ = ["add_parser", "chaos"]

CHAOS_DEFAULTS = {"failure_timeout": 3.0, "repair_after": 5.0, "steps": 60, "spares": 2}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="seeded fault campaign: reference run, the same job under N random faults, verdict",
        description="Run the failure-free reference (--protect none --spares 0), then the same job under a "
        "schedule of N faults drawn from --seed (kill in any phase, crash, hang, corrupt replica, kill during "
        "a recovery, coordinator kill, two nodes at once), and judge it: pass (final state bitwise equal, or "
        "within 1e-4 per step of the reference's loss if the run shrank), fail, or unsurvivable by design. "
        "Exit code 0 only on a pass.",
    )
    p.add_argument("--faults", type=int, default=8, metavar="N", help="faults to inject (default: 8)")
    p.add_argument("--seed", type=int, default=1234, metavar="S",
                   help="seed of the fault schedule and of the training run (default: 1234)")
    p.add_argument("--allow-unsurvivable", action="store_true",
                   help="draw 'two nodes at once' from any pair, also pairs that hold each other's only replica "
                   "(reported as unsurvivable by design, never a pass)")
    p.add_argument("--report", default="", metavar="PATH",
                   help="write the campaign (schedule, verdict, both runs' reports) as JSON here")
    add_run_arguments(p, defaults=CHAOS_DEFAULTS, exclude=("inject", "report", "seed"))
    p.add_argument("script", nargs="?", default="", metavar="SCRIPT",
                   help="a training script to run instead of the built-in trainer (as `phoenixft launch`): its "
                        "loop must run --steps steps (pass it the same number)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    p.set_defaults(func=chaos)


def chaos(args: argparse.Namespace) -> int:
    from phoenixft.faults.chaos import EXIT_CODES, check_campaign, run_campaign

    if args.script:
        import os

        from phoenixft.errors import UserError

        path = os.path.abspath(args.script)
        if not os.path.isfile(path):
            raise UserError(f"SCRIPT={args.script!r} is invalid: no such file (the training script to run)")
        args.script, args.script_args = path, list(args.script_args)
    cfg = config_from_args(args, validate=False)
    check_campaign(cfg, args.faults)  # the campaign's own needs first: clearer than what a run would say
    check_output_file("--report", args.report)  # (written at the very end: checked before anything starts)
    cfg.validate()
    result = run_campaign(cfg, args.faults, args.seed, allow_unsurvivable=args.allow_unsurvivable,
                          report=args.report)
    return EXIT_CODES.get(result["verdict"], 1)
