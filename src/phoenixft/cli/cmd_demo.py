"""`phoenixft demo`: the same job twice, failure-free and with a node killed mid-run, side by side."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="failure-free run vs the same run with a node killed: same final state?")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--kill-step", type=int, default=0, help="step at which the node dies (default: mid-run)")
    p.add_argument("--kill-node", type=int, default=1)
    p.add_argument("--phase", default="backward")
    p.add_argument("--run-dir", default="", help="parent folder of the runs (default: runs/)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from phoenixft.runtime.demo import demo

    return demo(steps=args.steps, nodes=args.nodes, model=args.model, kill_step=args.kill_step or args.steps // 2,
                kill_node=args.kill_node, phase=args.phase, run_dir=args.run_dir)
