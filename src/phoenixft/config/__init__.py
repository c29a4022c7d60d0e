"""Typed, validated run configuration.

`RunConfig` is the single source of truth for a training job: the launcher builds it from the
command line (each field's `help` becomes its `--help` line), validates it, and publishes it to
the control-plane store as JSON, where every agent and worker reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from phoenixft.errors import UserError
from phoenixft.faults.spec import FaultSpec, parse_fault
from phoenixft.protect.redundancy.scheme import VALID as REDUNDANCY_VALID
from phoenixft.protect.redundancy.scheme import Redundancy, parse_redundancy

__all__ = ["RunConfig", "add_run_arguments", "config_from_args", "checkpoint_bytes", "check_output_file",
           "PROTECT_MODES"]

TRANSPORTS = ("auto", "tcp")  # --replica-transport (protect/transport/: TransportMode)
PROTECT_MODES = ("phoenix", "none")
MAX_FAILURE_TIMEOUT_S = 86400.0  # larger ones overflow the collectives' timeouts (gloo: int milliseconds)
_NUMEL: dict[tuple[Any, ...], int | None] = {}


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


MAX_THREADS = 1024  # --threads: more intra-op threads per worker than any host has cores is a typo
MAX_WORKERS = 1 << 20  # (--nodes + --spares) x --workers-per-node: beyond any job (a --dry-run of it: ~25 s)


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; immutable once published to the store."""

    nodes: int = _f(2, "Number of active nodes (failure domains) at start.")
    device: str = _f("auto", "Where the workers train: cpu (gloo groups), or cuda: one GPU per worker (its "
                             "LOCAL_RANK), NCCL training groups, the optimizer shard copied into pinned host "
                             "snapshots on a copy stream. auto = cuda when a CUDA device is available, else cpu.")
    workers_per_node: int = _f(0, "Worker processes per node (one per accelerator; 0 = --tp on cpu, the GPUs of "
                                  "this host on cuda when that is a multiple of --tp, else --tp).",
                               flag="--workers-per-node")
    tp: int = _f(1, "Tensor-parallel size T: attention heads, MLP and vocabulary split over T ranks of one node "
                    "(Megatron-style column/row-parallel layers).")
    pp: int = _f(1, "Pipeline-parallel size P: the layers cut into P contiguous stages run with a 1F1B schedule; "
                    "data-parallel size D = nodes x workers-per-node / (T x P); rank = tp + dp*T + pp*T*D.")
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
    optimizer: str = _f("adamw", "Optimizer of the flat ZeRO shard: adamw, adam, sgd or lion (a workload may bring "
                                 "its own elementwise one).")
    lr: float = _f(1e-3, "Peak learning rate.")
    weight_decay: float = _f(0.1, "Weight decay (decoupled for adamw and lion, L2 for adam and sgd).",
                             flag="--weight-decay")
    beta1: float = _f(0.9, "adamw/adam/lion: first-moment coefficient.")
    beta2: float = _f(0.95, "adamw/adam: second-moment coefficient; lion: momentum update coefficient.")
    eps: float = _f(1e-8, "adamw/adam: denominator epsilon.")
    momentum: float = _f(0.9, "sgd: momentum.")
    nesterov: bool = _f(False, "sgd: Nesterov momentum.", action="store_true")
    lr_schedule: str = _f("constant", "Learning-rate schedule: constant, cosine, linear or wsd (warmup-stable-decay); "
                                      "a pure function of the step.", flag="--lr-schedule")
    warmup_steps: int = _f(0, "Linear warm-up steps (the rate reaches --lr at this step).", flag="--warmup-steps")
    min_lr: float = _f(0.0, "Final learning rate of cosine, linear and wsd.", flag="--min-lr")
    decay_steps: int = _f(0, "Decay length: cosine/linear after the warm-up (0 = to the end of the run); wsd: the "
                             "last N steps (0 = the last 20%).", flag="--decay-steps")
    clip_grad_norm: float = _f(0.0, "Clip gradients to this global norm over the whole model (0 = off).",
                               flag="--clip-grad-norm")
    precision: str = _f("fp32", "fp32, or bf16: bf16 parameters and compute, fp32 master weights and optimizer "
                                "state in the shard (then the master weights are protected and replicated too).")
    eval_every: int = _f(0, "Validation loss every N steps on held-out batches (0 = never).", flag="--eval-every")
    eval_batches: int = _f(4, "Held-out microbatches per evaluation, spread over the data-parallel ranks.",
                           flag="--eval-batches")
    seed: int = _f(1234, "Seed of the model init and of the (pure) batch function.")
    protect: str = _f("phoenix", "Per-step protection: phoenix (in-memory snapshot + peer replicas) or none.")
    replicas: int = _f(1, "Peer replicas of each optimizer shard, placed on other nodes (k); shorthand for "
                          "--redundancy replicas:K.")
    redundancy: str = _f("replicas:1", "How each optimizer shard is protected: replicas:K (K full copies on other "
                         "nodes) or ec:D+H (the shards of D data-parallel ranks on D nodes form a group whose H parity "
                         "blocks live on H further nodes, other racks first; any H lost members of a group are rebuilt "
                         "bit for bit; H=1 XOR, H>=2 Reed-Solomon). `phoenixft run --dry-run` prints what each costs.")
    racks: int = _f(1, "Failure domains above nodes: nodes spread evenly (in contiguous blocks) over R racks; "
                       "replicas go to other racks first.")
    inject: list[str] = _f(
        None,
        "Fault to inject, repeatable: kill:node=I[,J]@step=S[,phase=forward|backward|replicate|optimizer], "
        "kill:rack=A@step=S, kill:node=I@recovery=N, kill:node=I@step=S,phase=recovery (in the first recovery "
        "resuming from step S-1 or later), hang:node=I@step=S, crash:rank=R@step=S, "
        "corrupt:node=I@step=S, nan:step=S, partition:node=I@step=S[,for=SECONDS] (hosts with their own "
        "addresses only: `phoenixft coordinator` + agents).",
        action="append",
    )
    persist_every: int = _f(0, "Write a persistent DCP checkpoint every K steps, off the critical path (0 = never).",
                            flag="--persist-every")
    persist_dir: str = _f("", "Directory of the persistent checkpoints (needed with --persist-every).",
                          flag="--persist-dir")
    resume: str = _f("", "Start from the newest complete checkpoint in this directory (any node count).")
    spare_arrives_at_step: int = _f(0, "Start one more spare node when the run reaches this step (tests of "
                                    "growing back after a shrink; 0 = never).", flag="--spare-arrives-at-step")
    repair_after: float = _f(0.0, "Seconds after a node is lost (its agent exited or was fenced) until it comes "
                             "back repaired as a fresh spare s<k>, as on a cluster (0 = never).",
                             flag="--repair-after")
    join_timeout: float = _f(600.0, "Seconds to wait at the start for the --nodes active nodes to join and be ready; "
                             "then the run fails naming who is missing.", flag="--join-timeout")
    control_plane: str = _f("tcpstore", "Where the control plane keeps its state: tcpstore (torch's TCPStore in the "
                            "launcher's process: zero set-up, but the job depends on that process and host), etcd "
                            "(a local 3-member etcd cluster started for the run) or etcd://HOST:PORT[,HOST:PORT...] "
                            "(an existing etcd cluster: no single process or host whose loss ends the job).",
                            flag="--control-plane")
    coordinators: int = _f(1, "Coordinator processes: one leads, the others stand by and take over within a few "
                           "seconds of its death (more than 1 needs --control-plane etcd).", flag="--coordinators")
    failure_timeout: float = _f(10.0, "Seconds without a heartbeat or answer before a node is declared failed.",
                                flag="--failure-timeout")
    fence_kill: bool = _f(True, "Fence a failed node by SIGKILL of its process group in local runs, besides the "
                          "logical fence every process obeys; off (--no-fence-kill) = logical fence only, as for a "
                          "host that cannot be reached.", flag="--no-fence-kill", action="store_false")
    threads: int = _f(0, "torch intra-op threads per worker (0 = cores / active workers, at least 1).")
    chunk_mb: float = _f(4.0, "Replication chunk size in MiB.", flag="--chunk-mb")
    replica_transport: str = _f("auto", "How replicas move: auto (a holder on the owner's host - same boot, network "
                                "and mount namespaces - reads the owner's committed half straight from host shared "
                                "memory, one copy; other holders get it over TCP) or tcp (always over TCP).",
                                flag="--replica-transport")
    bucket_mb: float = _f(8.0, "Gradient reduction bucket size in MiB: each bucket's all-reduce starts as soon as "
                               "backward has produced its gradients.", flag="--bucket-mb")
    report: str = _f("", "Write the JSON report to this path.")
    run_dir: str = _f("", "Run directory for events.jsonl, metrics.jsonl and report.json (default: runs/<id>).",
                      flag="--run-dir")
    quiet: bool = _f(False, "No live progress display (log lines only).", action="store_true")
    json_events: bool = _f(False, "Print every event as one JSON line on stdout.", flag="--json-events",
                           action="store_true")
    timeout: float = _f(600.0, "Give up (and tear everything down) if the run takes longer than this, seconds.")

    def __post_init__(self) -> None:
        if self.device == "auto":
            from phoenixft.dist.device import resolve_device

            self.device = resolve_device(self.device)
        if self.workers_per_node == 0:
            self.workers_per_node = max(1, self.tp)
            if self.device == "cuda":  # one worker per GPU of this host (when a node holds whole TP groups)
                from phoenixft.dist.device import cuda_unavailable

                if cuda_unavailable() is None:
                    import torch

                    gpus = torch.cuda.device_count()
                    if gpus >= 1 and gpus % max(1, self.tp) == 0:
                        self.workers_per_node = gpus
        # --replicas K is a shorthand for --redundancy replicas:K: the two fields always agree
        m = re.fullmatch(r"replicas:(\d+)", str(self.redundancy).strip())
        if m and int(m.group(1)) == 1 and self.replicas != 1:
            self.redundancy = f"replicas:{self.replicas}"
        elif m and self.replicas == 1:
            self.replicas = int(m.group(1))

    # ------------------------------------------------------------------ derived
    @property
    def scheme(self) -> Redundancy:
        """The parsed --redundancy (after validate(): always valid)."""
        return parse_redundancy(self.redundancy)

    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size (at start)."""
        return max(1, self.world // max(1, self.tp * self.pp))

    @property
    def total_microbatches(self) -> int:
        return self.microbatches or self.dp * self.pp

    @property
    def mesh_spare_wait_s(self) -> float:
        """At most how long the coordinator waits for a spare when a --tp/--pp mesh (which cannot drop a
        node) lost one and none is ready: the repair (--repair-after) and the spare's start-up."""
        return self.repair_after + 2 * self.failure_timeout + 30.0

    @property
    def next_epoch_wait_s(self) -> float:
        """How long a survivor waits for the next epoch's topology before it takes the control plane for
        gone: the coordinator's gather and decision, and on a mesh its wait for a spare (mesh_spare_wait_s).
        Shorter, the survivors of a mesh gave up while the coordinator still waited for the repaired node,
        and each such exit spent one of the worker's in-place restarts (the run lost after a few)."""
        return 3 * self.failure_timeout + 60.0 + (self.mesh_spare_wait_s if self.tp * self.pp > 1 else 0.0)

    @property
    def faults(self) -> list[FaultSpec]:
        return [parse_fault(s, i) for i, s in enumerate(self.inject or [])]

    def validate(self) -> None:
        """Raise UserError naming the option, the value and what would be valid."""
        from phoenixft.workload import check_workload_path

        def need(cond: bool, flag: str, value: Any, valid: str) -> None:
            if not cond:
                raise UserError(f"{flag}={value!r} is invalid: {valid}")

        def real(x: float, ok: bool, flag: str, valid: str) -> None:
            """A float flag: finite (inf and nan make no sense for any of them) and in its range."""
            need(math.isfinite(x) and ok, flag, x, f"must be a finite number {valid}")

        from phoenixft.dist.device import DEVICES, cuda_unavailable

        need(self.device in DEVICES, "--device", self.device, f"one of {', '.join(DEVICES)}")
        if self.device == "cuda":
            why = cuda_unavailable()
            if why is not None:
                raise UserError(f"--device=cuda is invalid: {why}; use --device cpu")
        need(self.nodes >= 1, "--nodes", self.nodes, "need at least 1 node")
        need(self.workers_per_node >= 1, "--workers-per-node", self.workers_per_node, "need at least 1")
        need(self.spares >= 0, "--spares", self.spares, "must be >= 0")
        sizes = (("--nodes", self.nodes), ("--workers-per-node", self.workers_per_node), ("--spares", self.spares))
        for flag, n in sizes:
            need(n <= MAX_WORKERS, flag, n, f"must be at most {MAX_WORKERS:,}")
        need((self.nodes + self.spares) * self.workers_per_node <= MAX_WORKERS, "--nodes", self.nodes,
             f"(--nodes + --spares) x --workers-per-node must be at most {MAX_WORKERS:,} workers, is "
             f"({self.nodes:,} + {self.spares:,}) x {self.workers_per_node:,}")
        need(self.steps >= 1, "--steps", self.steps, "must be >= 1")
        from phoenixft.train.gpt import PRESETS

        need(self.model in PRESETS, "--model", self.model, f"valid presets: {', '.join(PRESETS)}")
        need(self.micro_batch >= 1, "--micro-batch", self.micro_batch, "must be >= 1")
        need(self.microbatches >= 0, "--microbatches", self.microbatches, "must be >= 0 (0 = one per worker)")
        need(self.tp >= 1, "--tp", self.tp, "must be >= 1")
        need(self.pp >= 1, "--pp", self.pp, "must be >= 1")
        need(self.workers_per_node % self.tp == 0, "--workers-per-node", self.workers_per_node,
             f"must be a multiple of --tp={self.tp} (a node holds whole tensor-parallel groups)")
        need(self.world % (self.tp * self.pp) == 0, "--tp/--pp", f"{self.tp}/{self.pp}",
             f"tp x pp must divide nodes x workers-per-node = {self.world}")
        need((self.tp * self.dp) % self.workers_per_node == 0, "--workers-per-node", self.workers_per_node,
             f"a node's workers must sit in one pipeline stage of tp x dp = {self.tp * self.dp} ranks")
        if self.tp * self.pp > 1:
            check_workload_path(self.workload)
            self._check_split()
        dpw = "nodes x workers-per-node" if self.tp * self.pp == 1 else "the data-parallel size"
        need(
            self.total_microbatches % self.dp == 0,
            "--microbatches",
            self.microbatches,
            f"must be a multiple of {dpw} = {self.dp} so every rank gets the same count",
        )
        real(self.lr, self.lr > 0, "--lr", "> 0")
        real(self.weight_decay, self.weight_decay >= 0, "--weight-decay", ">= 0")
        from phoenixft.optim import OPTIMIZERS, SCHEDULES

        need(self.optimizer in OPTIMIZERS, "--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        real(self.beta1, 0 <= self.beta1 < 1, "--beta1", "in [0, 1)")
        real(self.beta2, 0 <= self.beta2 < 1, "--beta2", "in [0, 1)")
        real(self.eps, self.eps > 0, "--eps", "> 0")
        real(self.momentum, 0 <= self.momentum < 1, "--momentum", "in [0, 1)")
        need(self.lr_schedule in SCHEDULES, "--lr-schedule", self.lr_schedule, f"one of {', '.join(SCHEDULES)}")
        need(0 <= self.warmup_steps <= self.steps, "--warmup-steps", self.warmup_steps,
             f"must be in 0..--steps ({self.steps})")
        real(self.min_lr, 0 <= self.min_lr <= self.lr, "--min-lr", f"in 0..--lr ({self.lr})")
        need(self.decay_steps >= 0, "--decay-steps", self.decay_steps, "must be >= 0")
        real(self.clip_grad_norm, self.clip_grad_norm >= 0, "--clip-grad-norm", ">= 0 (0 = off)")
        need(self.precision in ("fp32", "bf16"), "--precision", self.precision, "one of fp32, bf16")
        need(self.eval_every >= 0, "--eval-every", self.eval_every, "must be >= 0 (0 = never)")
        need(self.eval_batches >= 1, "--eval-batches", self.eval_batches, "must be >= 1")
        need(self.protect in PROTECT_MODES, "--protect", self.protect, f"one of {', '.join(PROTECT_MODES)}")
        need(self.replicas >= 1, "--replicas", self.replicas, "must be >= 1")
        try:
            scheme = parse_redundancy(self.redundancy)
        except ValueError as e:
            raise UserError(f"--redundancy={self.redundancy!r} is invalid: {e}; valid: {REDUNDANCY_VALID}") from None
        if scheme.is_ec:
            need(self.replicas == 1, "--replicas", self.replicas,
                 f"--replicas K is a shorthand for --redundancy replicas:K and cannot be combined with "
                 f"--redundancy {scheme}")
            need(self.tp * self.pp == 1, "--redundancy", self.redundancy,
                 f"erasure-coded groups are data-parallel only for now; with --tp {self.tp} --pp {self.pp} use "
                 "replicas:K")
            if self.protect == "phoenix":
                need(scheme.min_nodes <= self.nodes, "--redundancy", self.redundancy,
                     f"a group of D={scheme.d} members and its H={scheme.h} parity blocks need D + H = "
                     f"{scheme.min_nodes} distinct nodes, --nodes is {self.nodes}")
        else:
            need(scheme.k == self.replicas, "--redundancy", self.redundancy,
                 f"conflicts with --replicas {self.replicas}")
        if self.protect == "phoenix" and not scheme.is_ec:
            ring = self.nodes // self.pp if self.nodes % self.pp == 0 else self.nodes
            where = "nodes" if self.pp == 1 else "nodes of one pipeline stage (its data-parallel peers)"
            need(
                self.replicas < ring,
                "--replicas",
                self.replicas,
                f"replicas live on other {where}, so need replicas < {ring}" if ring > 1 else
                f"replicas live on other {where} and there is only one: give --nodes >= {2 * self.pp}"
                + (" (2 or more per pipeline stage)" if self.pp > 1 else "") + " or --protect none (no protection)",
            )
        real(self.repair_after, self.repair_after >= 0, "--repair-after", ">= 0 seconds (0 = never)")
        # (the collectives wait up to 6x this, in milliseconds that gloo keeps in a 32-bit int)
        real(self.failure_timeout, 0 < self.failure_timeout <= MAX_FAILURE_TIMEOUT_S, "--failure-timeout",
             f"> 0 and at most {MAX_FAILURE_TIMEOUT_S:g} seconds (a day)")
        # the launcher starts the late spare once step N has completed: after the last step nothing is left to join
        late = ("0 (never) or a step in 1.." + str(self.steps - 1)) if self.steps > 1 else "0 (never)"
        need(self.spare_arrives_at_step == 0 or 1 <= self.spare_arrives_at_step < self.steps,
             "--spare-arrives-at-step", self.spare_arrives_at_step,
             f"must be {late}: the spare starts once that step has completed, and after the last step (--steps "
             f"{self.steps}) there is nothing left for it to join")
        from phoenixft.controlplane import validate_spec

        why = validate_spec(self.control_plane)
        need(why is None, "--control-plane", self.control_plane, why or "")
        need(1 <= self.coordinators <= 9, "--coordinators", self.coordinators, "must be in 1..9")
        need(self.coordinators == 1 or self.control_plane != "tcpstore", "--coordinators", self.coordinators,
             "standby coordinators need --control-plane etcd or etcd://HOST:PORT,... (with the embedded tcpstore the "
             "store lives in the launcher's process, so a standby would not remove the single point of failure)")
        real(self.join_timeout, self.join_timeout > 0, "--join-timeout", "> 0 seconds")
        need(0 <= self.threads <= MAX_THREADS, "--threads", self.threads,
             f"must be 0 (cores / active workers) to {MAX_THREADS} (torch's intra-op pool per worker)")
        real(self.chunk_mb, self.chunk_mb > 0, "--chunk-mb", "> 0 (MiB)")
        need(self.replica_transport in TRANSPORTS, "--replica-transport", self.replica_transport,
             f"one of {', '.join(TRANSPORTS)}")
        real(self.bucket_mb, self.bucket_mb > 0, "--bucket-mb", "> 0 (MiB)")
        real(self.timeout, self.timeout > 0, "--timeout", "> 0 seconds")
        need(1 <= self.racks <= self.nodes and self.nodes % self.racks == 0, "--racks", self.racks,
             f"must divide --nodes={self.nodes} (racks are equal blocks of nodes)")
        seen: set[str] = set()
        for f in self.faults:  # parse errors raise UserError themselves
            need(f.text.strip() not in seen, "--inject", f.text,
                 "given twice: each fault fires once per run; give it once")
            seen.add(f.text.strip())
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
            if f.etcd is not None:
                need(self.control_plane == "etcd", "--inject", f.text,
                     "an etcd member can be killed only in the cluster the run starts itself: --control-plane etcd")
                need(f.etcd < 3, "--inject", f.text, "the run's etcd cluster has members 0, 1, 2")
            if f.kind_of.needs_protection:
                need(self.protect == "phoenix", "--inject", f.text, f"a {f.kind} fault needs --protect phoenix")
        need(self.persist_every >= 0, "--persist-every", self.persist_every, "must be >= 0")
        check_output_file("--report", self.report)
        check_workload_path(self.workload)
        if self.eval_every and self.workload != "phoenixft.gpt:workload":
            from phoenixft.workload import WorkloadContext, load_workload

            # (asked for and silently never done: no val_loss anywhere, no word why)
            need(load_workload(self.workload, WorkloadContext.from_config(self)).eval_batch is not None,
                 "--eval-every", self.eval_every, f"--workload {self.workload} has no held-out batches "
                 "(Workload.eval_batch) to evaluate on: give it one, or --eval-every 0")
        if self.persist_every:
            need(bool(self.persist_dir), "--persist-dir", self.persist_dir, "needed with --persist-every")
            need(self.protect == "phoenix", "--persist-every", self.persist_every, "needs --protect phoenix")
            why = _unwritable(self.persist_dir)
            need(why is None, "--persist-dir", self.persist_dir, f"cannot create or write a file there ({why})")
            numel = self.model_numel()
            if numel is not None:
                st = os.statvfs(_existing(self.persist_dir))
                free, need_b = st.f_bavail * st.f_frsize, checkpoint_bytes(numel)
                need(free >= need_b, "--persist-dir", self.persist_dir,
                     f"only {_mib(free)} free there, one checkpoint of {self._model_name()} "
                     f"({numel:,} parameters) needs about {_mib(need_b)}")
        if self.resume:
            from phoenixft.protect.persist import latest_manifest

            man = latest_manifest(self.resume)
            need(man is not None, "--resume", self.resume, "no complete checkpoint (step_*/MANIFEST.json) there")
            assert man is not None
            need(man["step"] < self.steps, "--resume", self.resume,
                 f"its checkpoint is at step {man['step']}; --steps must be larger")
            done = int(man["step"])
            for f in self.faults:  # steps up to the checkpoint's are never trained again: such a fault never fires
                if f.step is not None and f.step <= done:
                    need(False, "--inject", f.text,
                         f"its step {f.step} is at or before step {done} of the checkpoint --resume={self.resume} "
                         f"starts from (the run trains steps {done + 1}..{self.steps}), so it would never fire; "
                         f"give a step in {done + 1}..{self.steps}")
            numel = self.model_numel()
            if numel is not None and int(man.get("numel", numel)) != numel:
                raise UserError(f"--resume={self.resume}: checkpoint has {int(man['numel']):,} parameters, "
                                f"{self._model_name()} has {numel:,}")
            self._check_resume_rows(man)
            wrote = (man.get("config") or {}).get("precision", "fp32")
            # the model's buffers are saved as bytes in the precision that trained them (floating buffers follow
            # the parameters into bf16): read with another one they were garbage (a loss of inf a step later)
            need(not int(man.get("buffer_bytes") or 0) or wrote == self.precision, "--precision", self.precision,
                 f"with --resume={self.resume}: its checkpoint of step {man['step']} was written with --precision "
                 f"{wrote} and holds the model's buffers in it; resume it with --precision {wrote}")
        if self.data:
            from phoenixft.data import check_data

            # the window check needs the block size: known for the built-in GPT, the user's business otherwise
            block = PRESETS[self.model].block_size if self.workload == "phoenixft.gpt:workload" else None
            check_data(self.data, self.data_dtype, block)
        else:
            need(self.data_dtype in ("uint16", "uint32"), "--data-dtype", self.data_dtype, "one of uint16, uint32")

    def _check_resume_rows(self, man: dict[str, Any]) -> None:
        """--resume: the checkpoint's state rows (master weights + one per optimizer state tensor, whatever
        the precision) must be the rows of this run's optimizer, or the restore fails once the job runs."""
        from phoenixft.optim import OPTIMIZERS

        def names(states: tuple[str, ...]) -> str:
            return ", ".join(("param", *states))

        rows = int(man.get("rows", 3))  # checkpoints that predate the key held AdamW's 3 rows (as load_full reads)
        opt = self._run_optimizer()
        if opt is None:
            return
        flag, value, what, mine = opt
        if 1 + len(mine) == rows:
            return
        wrote = (man.get("config") or {}).get("optimizer")
        by = f"--optimizer {wrote}, " if isinstance(wrote, str) else ""
        if isinstance(wrote, str) and wrote in OPTIMIZERS and 1 + len(_states(wrote)) == rows:
            by += f"{rows} state rows ({names(_states(wrote))})"
        else:
            by += f"{rows} state rows"
        same = [n for n in OPTIMIZERS if 1 + len(_states(n)) == rows]
        valid = (f"resume it with --optimizer {' or '.join(same)}" if same else
                 "no built-in optimizer keeps that many rows (the workload that wrote it brought its own)")
        raise UserError(f"{flag}={value!r} is invalid with --resume={self.resume}: its checkpoint of step "
                        f"{man['step']} was written with {by}; {what} keeps {1 + len(mine)} rows ({names(mine)}); "
                        f"{valid}")

    def _run_optimizer(self) -> tuple[str, str, str, tuple[str, ...]] | None:
        """(flag, value, description, state names) of this run's optimizer: --optimizer, or the workload's
        own; None if the workload cannot be loaded here or brings an invalid optimizer (its workers report it)."""
        from phoenixft.optim import ElementwiseOptimizer

        by_flag = ("--optimizer", self.optimizer, self.optimizer, _states(self.optimizer))
        if self.workload == "phoenixft.gpt:workload":
            return by_flag
        try:
            from phoenixft.workload import WorkloadContext, load_workload

            own = load_workload(self.workload, WorkloadContext.from_config(self)).optimizer
        except Exception:  # noqa: BLE001 - user code: the workers will report its errors properly
            return None
        if own is None:
            return by_flag
        if not isinstance(own, ElementwiseOptimizer):
            return None
        return "--workload", self.workload, f"its optimizer {own.describe()}", tuple(own.state_names)

    def _check_split(self) -> None:
        """--tp/--pp > 1: the workload must say how its model splits, and this split must be valid."""
        import torch

        from phoenixft.parallel.layers import TPHandle
        from phoenixft.parallel.stage import StageSpec
        from phoenixft.workload import WorkloadContext, load_workload

        wl = load_workload(self.workload, WorkloadContext.from_config(self))
        if wl.split is None:
            raise UserError(f"--tp={self.tp} --pp={self.pp} is invalid for --workload {self.workload}: it does not say "
                            "how its model splits (Workload.split); use --tp 1 --pp 1 for data parallelism")
        try:
            with torch.device("meta"):
                model = wl.build_model()
                for pp in range(self.pp):
                    spec = StageSpec(pp=pp, pp_size=self.pp, tp=0, tp_size=self.tp, handle=TPHandle(self.tp, 0))
                    wl.split(model, spec)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - user code: the workers report its errors properly
            pass

    def _model_name(self) -> str:
        return f"--model {self.model}" if self.workload == "phoenixft.gpt:workload" else f"--workload {self.workload}"

    def model_numel(self) -> int | None:
        """Trainable parameters of the configured model, built on torch's meta device (no memory,
        no init cost); None if the workload's model cannot be built that way. Cached per model."""
        key = (self.workload, self.model, self.data, self.data_dtype, self.micro_batch, self.seed)
        if key not in _NUMEL:
            _NUMEL[key] = self._model_numel()
        return _NUMEL[key]

    def _model_numel(self) -> int | None:
        try:
            import torch

            from phoenixft.workload import WorkloadContext, load_workload

            wl = load_workload(self.workload, WorkloadContext.from_config(self))
            with torch.device("meta"):
                model = wl.build_model()
            return sum(p.numel() for p in model.parameters() if p.requires_grad)
        except Exception:  # noqa: BLE001 - user code: the workers will report its errors properly
            return None

    # ------------------------------------------------------------------ (de)serialise
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        data = json.loads(text)
        data.setdefault("device", "cpu")  # written before --device existed: those runs trained on CPU
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _states(optimizer: str) -> tuple[str, ...]:
    """The state tensors a built-in --optimizer keeps per parameter (its shard rows after the master weights)."""
    from phoenixft.optim import OPTIMIZERS

    return tuple(getattr(OPTIMIZERS[optimizer], "state_names", ()))


def checkpoint_bytes(numel: int) -> int:
    """Estimated size of one persistent checkpoint: param, exp_avg and exp_avg_sq in float32, plus
    DCP metadata (5%)."""
    return int(3 * 4 * numel * 1.05)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _existing(d: str) -> str:
    """`d`, or its nearest ancestor that exists (where `d` would be created)."""
    p = os.path.abspath(d)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def check_output_file(flag: str, path: str) -> None:
    """UserError unless the file `path` ('' = none) can be written once the run is over: not a directory,
    and creatable (its directory, or the nearest existing ancestor it would be created in, writable) or
    an existing writable file. Checked before anything starts, not after the whole run."""
    if not path:
        return
    if os.path.isdir(path):
        raise UserError(f"{flag}={path!r} is invalid: it is a directory; give a file name")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag}={path!r} is invalid: the file exists and is not writable")
        return
    why = _unwritable(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        raise UserError(f"{flag}={path!r} is invalid: cannot create a file there ({why})")


def _unwritable(d: str) -> str | None:
    """None if a file can be created in directory `d` (or, if it does not exist yet, `d` can be
    created in its nearest existing ancestor), else why not. Creates nothing that stays."""
    base = _existing(d)
    if not os.path.isdir(base):
        return f"{base} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".phoenixft-probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def add_run_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                      exclude: Collection[str] = ()) -> None:
    """Add one flag per RunConfig field (except `exclude`); the field's help text becomes its --help line."""
    defaults = defaults or {}
    for f in dataclasses.fields(RunConfig):
        if f.name in exclude:
            continue
        meta = {**f.metadata, "help": f.metadata["help"].replace("%", "%%")}  # argparse formats help with %
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


def config_from_args(args: argparse.Namespace, validate: bool = True) -> RunConfig:
    """The RunConfig of parsed flags, validated unless `validate` is False (the caller then checks its own
    requirements first and calls `validate()` itself)."""
    names = [f.name for f in dataclasses.fields(RunConfig)]
    cfg = RunConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})
    if validate:
        cfg.validate()
    return cfg
