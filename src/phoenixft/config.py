"""Typed, validated run configuration.

`RunConfig` is the single source of truth for a training job: the launcher builds it from the
command line (each field's `help` becomes its `--help` line), validates it, and publishes it to
the control-plane store as JSON, where every agent and worker reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from phoenixft.errors import UserError
from phoenixft.faults import FaultSpec, parse_fault

__all__ = ["RunConfig", "add_run_arguments", "config_from_args", "PROTECT_MODES"]

PROTECT_MODES = ("phoenix", "none")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; immutable once published to the store."""

    nodes: int = _f(2, "Number of active nodes (failure domains) at start.")
    workers_per_node: int = _f(1, "Worker processes per node (one per accelerator).", flag="--workers-per-node")
    spares: int = _f(1, "Spare nodes started warm (torch imported, model built) and promoted on a failure.")
    steps: int = _f(20, "Training steps to complete.")
    model: str = _f("tiny", "GPT size preset for the default workload: tiny (~1M), small (~11M), medium (~100M).")
    workload: str = _f(
        "phoenixft.gpt:workload",
        "Workload factory 'pkg.module:function' returning phoenixft.Workload (default: the built-in GPT).",
    )
    data: str = _f("", "Token file to train on: a flat uint16/uint32 array of token ids (nanoGPT's train.bin "
                       "format; its last 5 percent held out), or a directory holding train.bin and val.bin. "
                       "Make one from text with `phoenixft prepare-data`. '' = the built-in stdlib corpus.")
    data_dtype: str = _f("uint16", "Token id type of --data when it has no sidecar JSON (<file>.json or "
                                   "meta.json): uint16 or uint32.", flag="--data-dtype")
    micro_batch: int = _f(8, "Sequences per microbatch.", flag="--micro-batch")
    microbatches: int = _f(
        0,
        "Microbatches per step across all data-parallel ranks (0 = one per worker). "
        "Global batch = micro-batch x microbatches.",
    )
    lr: float = _f(1e-3, "AdamW learning rate.")
    weight_decay: float = _f(0.1, "AdamW weight decay.", flag="--weight-decay")
    seed: int = _f(1234, "Seed of the model init and of the (pure) batch function.")
    protect: str = _f("phoenix", "Per-step protection: phoenix (in-memory snapshot + peer replicas) or none.")
    replicas: int = _f(1, "Peer replicas of each optimizer shard, placed on other nodes (k).")
    racks: int = _f(1, "Failure domains above nodes: nodes spread evenly (in contiguous blocks) over R racks; "
                       "replicas go to other racks first.")
    inject: list[str] = _f(
        None,
        "Fault to inject, repeatable: kill:node=I[,J]@step=S[,phase=forward|backward|replicate|optimizer], "
        "kill:rack=A@step=S, kill:node=I@recovery=N, hang:node=I@step=S, crash:rank=R@step=S, "
        "corrupt:node=I@step=S, nan:step=S.",
        action="append",
    )
    persist_every: int = _f(0, "Write a persistent DCP checkpoint every K steps, off the critical path (0 = never).",
                            flag="--persist-every")
    persist_dir: str = _f("", "Directory of the persistent checkpoints (needed with --persist-every).",
                          flag="--persist-dir")
    resume: str = _f("", "Start from the newest complete checkpoint in this directory (any node count).")
    spare_arrives_at_step: int = _f(0, "Start one more spare node when the run reaches this step (tests of "
                                    "growing back after a shrink; 0 = never).", flag="--spare-arrives-at-step")
    failure_timeout: float = _f(10.0, "Seconds without a heartbeat or answer before a node is declared failed.",
                                flag="--failure-timeout")
    fence_kill: bool = _f(True, "Fence a failed node by SIGKILL of its process group in local runs, besides the "
                          "logical fence every process obeys; off (--no-fence-kill) = logical fence only, as for a "
                          "host that cannot be reached.", flag="--no-fence-kill", action="store_false")
    threads: int = _f(0, "torch intra-op threads per worker (0 = cores / active workers, at least 1).")
    chunk_mb: float = _f(4.0, "Replication chunk size in MiB.", flag="--chunk-mb")
    report: str = _f("", "Write the JSON report to this path.")
    run_dir: str = _f("", "Run directory for events.jsonl, metrics.jsonl and report.json (default: runs/<id>).",
                      flag="--run-dir")
    quiet: bool = _f(False, "No live progress display (log lines only).", action="store_true")
    json_events: bool = _f(False, "Print every event as one JSON line on stdout.", flag="--json-events",
                           action="store_true")
    timeout: float = _f(600.0, "Give up (and tear everything down) if the run takes longer than this, seconds.")

    # ------------------------------------------------------------------ derived
    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def total_microbatches(self) -> int:
        return self.microbatches or self.world

    @property
    def faults(self) -> list[FaultSpec]:
        return [parse_fault(s, i) for i, s in enumerate(self.inject or [])]

    def validate(self) -> None:
        """Raise UserError naming the option, the value and what would be valid."""
        from phoenixft.workload import check_workload_path

        def need(cond: bool, flag: str, value: Any, valid: str) -> None:
            if not cond:
                raise UserError(f"{flag}={value!r} is invalid: {valid}")

        need(self.nodes >= 1, "--nodes", self.nodes, "need at least 1 node")
        need(self.workers_per_node >= 1, "--workers-per-node", self.workers_per_node, "need at least 1")
        need(self.spares >= 0, "--spares", self.spares, "must be >= 0")
        need(self.steps >= 1, "--steps", self.steps, "must be >= 1")
        from phoenixft.gpt import PRESETS

        need(self.model in PRESETS, "--model", self.model, f"valid presets: {', '.join(PRESETS)}")
        need(self.micro_batch >= 1, "--micro-batch", self.micro_batch, "must be >= 1")
        need(self.microbatches >= 0, "--microbatches", self.microbatches, "must be >= 0 (0 = one per worker)")
        need(
            self.total_microbatches % self.world == 0,
            "--microbatches",
            self.microbatches,
            f"must be a multiple of nodes x workers-per-node = {self.world} so every rank gets the same count",
        )
        need(self.lr > 0, "--lr", self.lr, "must be > 0")
        need(self.weight_decay >= 0, "--weight-decay", self.weight_decay, "must be >= 0")
        need(self.protect in PROTECT_MODES, "--protect", self.protect, f"one of {', '.join(PROTECT_MODES)}")
        need(self.replicas >= 1, "--replicas", self.replicas, "must be >= 1")
        if self.protect == "phoenix":
            need(
                self.replicas < self.nodes,
                "--replicas",
                self.replicas,
                f"replicas live on other nodes, so need replicas < nodes (= {self.nodes})",
            )
        need(self.failure_timeout > 0, "--failure-timeout", self.failure_timeout, "must be > 0 seconds")
        need(self.threads >= 0, "--threads", self.threads, "must be >= 0")
        need(self.chunk_mb > 0, "--chunk-mb", self.chunk_mb, "must be > 0")
        need(self.timeout > 0, "--timeout", self.timeout, "must be > 0 seconds")
        need(1 <= self.racks <= self.nodes and self.nodes % self.racks == 0, "--racks", self.racks,
             f"must divide --nodes={self.nodes} (racks are equal blocks of nodes)")
        for f in self.faults:  # parse errors raise UserError themselves
            for n in f.nodes:
                need(0 <= n < self.nodes, "--inject", f.text, f"node must be in 0..{self.nodes - 1}")
            if f.rack is not None:
                need(0 <= f.rack < self.racks, "--inject", f.text, f"rack must be in 0..{self.racks - 1} (--racks)")
            if f.rank is not None:
                need(0 <= f.rank < self.world, "--inject", f.text, f"rank must be in 0..{self.world - 1}")
            if f.step is not None:
                need(1 <= f.step <= self.steps, "--inject", f.text, f"step must be in 1..{self.steps}")
            if f.recovery is not None:
                need(f.recovery >= 1, "--inject", f.text, "recovery must be >= 1 (the first recovery is 1)")
            if f.kind in ("kill", "hang", "crash", "corrupt"):
                need(self.protect == "phoenix", "--inject", f.text, f"a {f.kind} fault needs --protect phoenix")
        need(self.persist_every >= 0, "--persist-every", self.persist_every, "must be >= 0")
        if self.persist_every:
            need(bool(self.persist_dir), "--persist-dir", self.persist_dir, "needed with --persist-every")
            need(self.protect == "phoenix", "--persist-every", self.persist_every, "needs --protect phoenix")
        if self.resume:
            from phoenixft.persist import latest_manifest

            man = latest_manifest(self.resume)
            need(man is not None, "--resume", self.resume, "no complete checkpoint (step_*/MANIFEST.json) there")
            assert man is not None
            need(man["step"] < self.steps, "--resume", self.resume,
                 f"its checkpoint is at step {man['step']}; --steps must be larger")
        check_workload_path(self.workload)
        if self.data:
            from phoenixft.data import check_data

            # the window check needs the block size: known for the built-in GPT, the user's business otherwise
            block = PRESETS[self.model].block_size if self.workload == "phoenixft.gpt:workload" else None
            check_data(self.data, self.data_dtype, block)
        else:
            need(self.data_dtype in ("uint16", "uint32"), "--data-dtype", self.data_dtype, "one of uint16, uint32")

    # ------------------------------------------------------------------ (de)serialise
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def add_run_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """Add one flag per RunConfig field; the field's help text becomes its --help line."""
    defaults = defaults or {}
    for f in dataclasses.fields(RunConfig):
        meta = f.metadata
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        default = defaults.get(f.name, f.default)
        action = meta.get("action")
        if action == "store_false":
            parser.add_argument(flag, dest=f.name, action="store_false", default=default, help=meta["help"])
        elif action == "store_true":
            parser.add_argument(flag, dest=f.name, action="store_true", default=default, help=meta["help"])
        elif action == "append":
            parser.add_argument(flag, dest=f.name, action="append", default=None, metavar="SPEC",
                                help=meta["help"])
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, dest=f.name, type=typ, default=default,
                                help=f"{meta['help']} (default: {default!r})")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    names = [f.name for f in dataclasses.fields(RunConfig)]
    cfg = RunConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})
    cfg.validate()
    return cfg
