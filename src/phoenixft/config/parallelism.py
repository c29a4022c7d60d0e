"""The parallelism section: nodes and their workers, the device, the tensor/pipeline/data-parallel mesh,
spare nodes and racks, and the per-worker resources (threads, gradient buckets)."""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import MAX_THREADS, MAX_WORKERS, need, real
from phoenixft.config.names import DEVICES
from phoenixft.config.options import option

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["ParallelismConfig", "validate_parallelism"]


@dataclass(kw_only=True)
class ParallelismConfig:
    """Where the job runs and how its ranks are laid out."""

    nodes: int = option(2, "Number of active nodes (failure domains) at start.")
    device: str = option("auto", "Where the workers train: cpu (gloo groups), or cuda: one GPU per worker (its "
                                 "LOCAL_RANK; a local run spreads its nodes over the GPUs), NCCL training groups, the "
                                 "optimizer shard copied into pinned host snapshots on a copy stream. auto = cuda when "
                                 "a CUDA device is available, else cpu; decided on each host where workers run.")
    workers_per_node: int = option(0, "Worker processes per node (one per accelerator; 0 = --tp on cpu, the GPUs of "
                                      "this host on cuda when that is a multiple of --tp, else --tp).",
                                   flag="--workers-per-node")
    tp: int = option(1, "Tensor-parallel size T: attention heads, MLP and vocabulary split over T ranks of one node "
                        "(Megatron-style column/row-parallel layers).")
    pp: int = option(1, "Pipeline-parallel size P: the layers cut into P contiguous stages run with a 1F1B schedule; "
                        "data-parallel size D = nodes x workers-per-node / (T x P); rank = tp + dp*T + pp*T*D.")
    spares: int = option(1, "Spare nodes started warm (torch imported, model built) and promoted on a failure.")
    racks: int = option(1, "Failure domains above nodes: nodes spread evenly (in contiguous blocks) over R racks; "
                           "replicas go to other racks first.")
    spare_arrives_at_step: int = option(0, "Start one more spare node when the run reaches this step (tests of "
                                        "growing back after a shrink; 0 = never).", flag="--spare-arrives-at-step")
    repair_after: float = option(0.0, "Seconds after a node is lost (its agent exited or was fenced) until it comes "
                                 "back repaired as a fresh spare s<k>, as on a cluster (0 = never).",
                                 flag="--repair-after")
    threads: int = option(0, "torch intra-op threads per worker (0 = cores / active workers, at least 1).")
    bucket_mb: float = option(8.0, "Gradient reduction bucket size in MiB: each bucket's all-reduce starts as soon as "
                                   "backward has produced its gradients.", flag="--bucket-mb")

    def resolve(self) -> None:
        """Workers per node when 0: --tp, or the GPUs of this host when the device may be CUDA here and
        they hold whole tensor-parallel groups. The device itself is resolved on each host, by its
        agent and workers (`auto` stays `auto` in the published config)."""
        if self.workers_per_node == 0:
            self.workers_per_node = max(1, self.tp)
            if self.device in ("auto", "cuda") and _may_have_gpus(self.device):
                from phoenixft.distributed.device import resolve_device, visible_gpus

                gpus = visible_gpus() if resolve_device(self.device) == "cuda" else 0
                if gpus >= 1 and gpus % max(1, self.tp) == 0:
                    self.workers_per_node = gpus


def _may_have_gpus(device: str) -> bool:
    """Whether this host may have a GPU for `device` (decided without importing torch): not with `auto` pinned
    to cpu ($PHOENIXFT_AUTO_DEVICE), nor on Linux without any of the device files through which CUDA reaches an
    NVIDIA GPU (as `distributed.device` judges a host before it asks torch)."""
    if device == "auto" and os.environ.get("PHOENIXFT_AUTO_DEVICE") == "cpu":
        return False
    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/nvidia*") or glob.glob("/dev/nvhost-*") or os.path.exists("/dev/dxg"))


def validate_parallelism(cfg: RunConfig) -> None:
    """The device, the job's size, the mesh it is cut into, racks, spares and per-worker resources."""
    p = cfg.parallelism
    # (whether CUDA is there is checked where the workers run: by each agent, for its host)
    need(p.device in ("auto", *DEVICES), "--device", p.device, f"one of auto, {', '.join(DEVICES)}")
    _validate_size(p)
    _validate_mesh(cfg)
    need(1 <= p.racks <= p.nodes and p.nodes % p.racks == 0, "--racks", p.racks,
         f"must divide --nodes={p.nodes} (racks are equal blocks of nodes)")
    need(0 <= p.threads <= MAX_THREADS, "--threads", p.threads,
         f"must be 0 (cores / active workers) to {MAX_THREADS} (torch's intra-op pool per worker)")
    real(p.bucket_mb, p.bucket_mb > 0, "--bucket-mb", "> 0 (MiB)")
    real(p.repair_after, p.repair_after >= 0, "--repair-after", ">= 0 seconds (0 = never)")
    # the launcher starts the late spare once step N has completed: after the last step nothing is left to join
    steps = cfg.steps
    late = ("0 (never) or a step in 1.." + str(steps - 1)) if steps > 1 else "0 (never)"
    need(p.spare_arrives_at_step == 0 or 1 <= p.spare_arrives_at_step < steps,
         "--spare-arrives-at-step", p.spare_arrives_at_step,
         f"must be {late}: the spare starts once that step has completed, and after the last step (--steps "
         f"{steps}) there is nothing left for it to join")


def _validate_size(p: ParallelismConfig) -> None:
    """Nodes, workers per node and spares: at least one, and not beyond any job."""
    need(p.nodes >= 1, "--nodes", p.nodes, "need at least 1 node")
    need(p.workers_per_node >= 1, "--workers-per-node", p.workers_per_node, "need at least 1")
    need(p.spares >= 0, "--spares", p.spares, "must be >= 0")
    for flag, n in (("--nodes", p.nodes), ("--workers-per-node", p.workers_per_node), ("--spares", p.spares)):
        need(n <= MAX_WORKERS, flag, n, f"must be at most {MAX_WORKERS:,}")
    need((p.nodes + p.spares) * p.workers_per_node <= MAX_WORKERS, "--nodes", p.nodes,
         f"(--nodes + --spares) x --workers-per-node must be at most {MAX_WORKERS:,} workers, is "
         f"({p.nodes:,} + {p.spares:,}) x {p.workers_per_node:,}")


def _validate_mesh(cfg: RunConfig) -> None:
    """--tp and --pp: each node holds whole tensor-parallel groups of one pipeline stage."""
    p = cfg.parallelism
    need(p.tp >= 1, "--tp", p.tp, "must be >= 1")
    need(p.pp >= 1, "--pp", p.pp, "must be >= 1")
    need(p.workers_per_node % p.tp == 0, "--workers-per-node", p.workers_per_node,
         f"must be a multiple of --tp={p.tp} (a node holds whole tensor-parallel groups)")
    need(cfg.world % (p.tp * p.pp) == 0, "--tp/--pp", f"{p.tp}/{p.pp}",
         f"tp x pp must divide nodes x workers-per-node = {cfg.world}")
    need((p.tp * cfg.dp) % p.workers_per_node == 0, "--workers-per-node", p.workers_per_node,
         f"a node's workers must sit in one pipeline stage of tp x dp = {p.tp * cfg.dp} ranks")
