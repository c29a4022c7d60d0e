"""What a host must have before its workers start, checked on the host where they run: the device
(`--device cuda` needs a GPU here; `auto` is resolved here), room in /dev/shm for the snapshot halves
(Docker's default of 64 MB ends in SIGBUS at the first step that touches a page beyond it), and the
NCCL settings the workers inherit.

`phoenixft run` checks its own host for every node it starts; `phoenixft agent` checks its host for
its node; the head of a multi-host job (`phoenixft coordinator`) checks nothing of the kind: its host
runs no worker."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from phoenixft.errors import UserError

if TYPE_CHECKING:
    from phoenixft.config import RunConfig

__all__ = ["SHM", "shm_needed", "shm_free", "check_shm", "check_host", "prepare_nccl"]

SHM = "/dev/shm"


def shm_needed(cfg: RunConfig, nodes_here: int, cuda: bool) -> int:
    """Bytes of shared memory the snapshot halves of `nodes_here` nodes of `cfg` need on one host
    (0 without protection, which keeps nothing there): each node's optimizer shard halves and its
    replicas or parity, plus, on CPU, its parameter ping-pong buffers (on CUDA those live on the GPU).
    The largest node of the estimate stands for each node here. 0 when the model cannot be sized."""
    if cfg.protect != "phoenix" or nodes_here < 1:
        return 0
    from phoenixft.protect.redundancy.estimate import estimate_config

    try:
        est = estimate_config(cfg)
    except UserError:  # a workload that cannot be built on the meta device: nothing to size it by
        return 0
    per_node = max(((c.state + c.protection + (0 if cuda else c.params)) for c in est.nodes), default=0)
    return per_node * nodes_here


def shm_free(path: str = SHM) -> int | None:
    """Bytes free for an unprivileged writer in `path` (None when it is not there)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_shm(need: int, free: int | None, where: str) -> None:
    """UserError, one line, when `need` bytes of snapshot halves do not fit the `free` bytes of /dev/shm."""
    if need <= 0 or free is None or need <= free:
        return
    gib = max(1, math.ceil(need * 1.25 / 2**30))  # with a quarter to spare
    raise UserError(f"{SHM} on {where} has {_size(free)} free, and the snapshot halves of this run need "
                    f"{_size(need)} there: give it more (in Docker: docker run --shm-size={gib}g), or "
                    "run fewer or smaller nodes on this host")


def check_host(cfg: RunConfig, nodes_here: int, where: str) -> str:
    """The device the workers of this host train on (UserError, one line, if it cannot be used here),
    after checking that /dev/shm holds the snapshot halves of its `nodes_here` nodes."""
    from phoenixft.distributed.device import check_device_here

    kind = check_device_here(cfg.device, where)
    check_shm(shm_needed(cfg, nodes_here, kind == "cuda"), shm_free(), where)
    return kind


def prepare_nccl(env: dict[str, str] | os._Environ[str]) -> str | None:
    """Set the NCCL settings a survivor needs in `env` (which the workers inherit); the line that names
    the values of the environment it replaced, if any."""
    from phoenixft.distributed.cuda_env import apply_nccl_env, nccl_overrides, override_line

    line = override_line(nccl_overrides(env))
    apply_nccl_env(env, "", 0)
    return line


def local_nodes(cfg: RunConfig) -> int:
    """The nodes a local run starts on this host: active, spares, and the late spare."""
    return cfg.nodes + cfg.spares + (1 if cfg.spare_arrives_at_step else 0)


def local_notes(cfg: RunConfig, env: dict[str, str] | os._Environ[str]) -> list[str]:
    """What a local run on CUDA says once, each in one line: workers sharing GPUs (each with an NCCL
    host identity of its own), and the user's NCCL values its agents replace."""
    from phoenixft.distributed.cuda_env import nccl_overrides, override_line, placement_line
    from phoenixft.distributed.device import resolve_device, visible_gpus

    if resolve_device(cfg.device) != "cuda":
        return []
    lines = [placement_line(visible_gpus(), local_nodes(cfg) * cfg.workers_per_node),
             override_line(nccl_overrides(env))]
    return [line for line in lines if line]
