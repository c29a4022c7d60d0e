"""How a CUDA worker's process is set up, decided without a GPU: where each worker of a host goes,
the NCCL settings a survivor needs, and the settings that make its kernels deterministic.

Every function here is pure or takes the environment and the torch module it acts on as arguments,
so the CPU suite checks exactly what a GPU worker would apply (`distributed/device.py` applies it).

- Placement (`plan_gpus`): the workers of one host, ordered active nodes first (n0, n1, ...), then
  spares (s0, s1, ...), each node's workers by local rank, take the visible GPUs in turn. With more
  workers than GPUs, worker i >= G shares GPU i mod G with worker i mod G < G; NCCL refuses two ranks
  of one communicator on one GPU of one host ("Duplicate GPU detected"), so each worker i >= G gets
  an NCCL host identity of its own (`NCCL_HOSTID`): NCCL then reaches it as another host, over its
  network transport (loopback). Of any two workers on one GPU at most one keeps the host's identity,
  so no communicator ever sees a duplicate. That is slower than NVLink or shared memory and meant for
  checks on a machine with few GPUs; `placement_line` says so in one line.
- NCCL (`nccl_required`, `apply_nccl_env`): torch's default and a cluster image's
  `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` or `3` let the watchdog tear a survivor down when a peer dies;
  `2` lets it abort the communicators, on its own thread, before the survivor posted its recovery
  descriptor, after which a failed collective reports success (distributed/nccl.py). `0` is the one
  value accepted: only phoenixft aborts, after the descriptor. The values phoenixft needs replace
  whatever the environment holds, and `override_line` names what was replaced.
- Determinism (`determinism_settings`, `apply_determinism`): `use_deterministic_algorithms(True)`
  without `warn_only` (only then does torch force deterministic kernels, and refuse the
  non-deterministic ones instead of warning), cuBLAS's fixed workspace (`CUBLAS_WORKSPACE_CONFIG`,
  read when cuBLAS starts: set before the first CUDA call), cuDNN without autotuning, and the
  math backend of scaled-dot-product attention (the flash, memory-efficient and cuDNN backward
  passes accumulate in a non-deterministic order).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["PLACEMENT_ENV", "HOSTID_ENV", "GpuSlot", "plan_gpus", "local_workers", "placement_line", "nccl_required",
           "nccl_env", "nccl_overrides", "apply_nccl_env", "override_line", "Determinism", "determinism_settings",
           "apply_determinism", "DETERMINISTIC_CUBLAS"]

PLACEMENT_ENV = "PHOENIXFT_GPU_PLACEMENT"  # spread: every node of a local run on this host (set by `phoenixft run`)
HOSTID_ENV = "PHOENIXFT_NCCL_HOSTID"  # worker: every worker with an NCCL host identity of its own
_NODE = re.compile(r"^([ns])(\d+)$")


# ---------------------------------------------------------------------------------------------- placement
class GpuSlot(NamedTuple):
    """A worker's GPU on its host, and whether it needs an NCCL host identity of its own."""

    gpu: int
    own_host: bool


def _order(worker: tuple[str, int]) -> tuple[int, int, str, int]:
    node, local_rank = worker
    m = _NODE.match(node)
    if m is None:  # a node named by hand: after the n<i> and s<j> of a local run, by name
        return (2, 0, node, local_rank)
    return (0 if m.group(1) == "n" else 1, int(m.group(2)), "", local_rank)


def plan_gpus(gpus: int, workers: Iterable[tuple[str, int]]) -> dict[tuple[str, int], GpuSlot]:
    """(visible GPUs, every local worker's (node, local rank)) -> each worker's `GpuSlot`: the i-th
    worker in (active nodes, spares; by ordinal; by local rank) order takes GPU i mod `gpus`, and from
    i = `gpus` on, an NCCL host identity of its own. Deterministic: the order of `workers` is ignored."""
    if gpus < 1:
        raise ValueError("no GPU to place a worker on")
    order = sorted(set(workers), key=_order)
    return {w: GpuSlot(i % gpus, i >= gpus) for i, w in enumerate(order)}


def local_workers(nodes: int, spares: int, workers_per_node: int, node: str = "") -> list[tuple[str, int]]:
    """The workers of a local run (every node on this host): n0..n<nodes-1>, then s0..s<spares-1>,
    extended up to `node` when it is a spare beyond those (a late or repaired one: every worker then
    agrees on the slots of the ones before it)."""
    m = _NODE.match(node)
    last_spare = max(spares, int(m.group(2)) + 1 if m and m.group(1) == "s" else 0)
    names = [f"n{i}" for i in range(nodes)] + [f"s{j}" for j in range(last_spare)]
    if node and node not in names:
        names.append(node)
    return [(n, lr) for n in names for lr in range(workers_per_node)]


def placement_line(gpus: int, workers: int) -> str | None:
    """One line for a host with more workers than GPUs (None when each has a GPU of its own)."""
    if workers <= gpus:
        return None
    return (f"{workers} workers on {gpus} GPU(s) of this host: the workers beyond the first {gpus} share a GPU "
            "and each gets an NCCL host identity of its own (NCCL_HOSTID), so NCCL reaches them over its network "
            "transport on this host (correct, slower: for checks; give each worker a GPU for speed)")


# ---------------------------------------------------------------------------------------------- NCCL
_REQUIRED: dict[str, tuple[str, ...]] = {  # variable -> the values a survivor can live with (the first is set)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0",),  # 0: torch never aborts nor tears down; we abort, after the descriptor
    "TORCH_NCCL_ENABLE_MONITORING": ("0",),  # no heartbeat monitor killing a process whose watchdog stalls
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0",),  # no debug dump into the un-prefixed store on a timeout
    "TORCH_NCCL_PROPAGATE_ERROR": ("0",),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": ("0",),
    "TORCH_NCCL_BLOCKING_WAIT": ("0",),  # our polled wait decides, not a blocking one
    "NCCL_NVLS_ENABLE": ("0",),
}
_LEGACY = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # older names torch still reads
           "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT"}


def nccl_required() -> dict[str, tuple[str, ...]]:
    """Each NCCL setting a survivor depends on, with the values it accepts (the first is the one set)."""
    return dict(_REQUIRED)


def nccl_env() -> dict[str, str]:
    """The NCCL settings phoenixft sets: abort a failed communicator and report the failure to our
    polled wait (which raises `PeerFailure`), never kill the process, no monitor, no dump."""
    return {k: v[0] for k, v in _REQUIRED.items()}


def nccl_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The values in `env` that `apply_nccl_env` replaces: variable -> (found, set)."""
    out = {}
    for k, ok in _REQUIRED.items():
        if k in env and env[k] not in ok:
            out[k] = (env[k], ok[0])
    for old, new in _LEGACY.items():
        if old in env and env[old] not in _REQUIRED[new]:
            out[old] = (env[old], _REQUIRED[new][0])
    return out


def apply_nccl_env(env: MutableMapping[str, str], node: str, local_rank: int,
                   own_host: bool = False) -> dict[str, str]:
    """Set the NCCL settings in `env`: those missing, and those with a value a survivor cannot live
    with (an acceptable value is kept); with `own_host`, a host identity of this worker's own. Returns
    what it set."""
    done = {k: v for k, v in nccl_env().items() if env.get(k) not in _REQUIRED[k]}
    done.update({k: new for k, (_, new) in nccl_overrides(env).items()})
    if own_host:
        done["NCCL_HOSTID"] = f"phoenixft-{node}.{local_rank}"
    env.update(done)
    return done


def override_line(overrides: Mapping[str, tuple[str, str]]) -> str | None:
    """One line naming the user's NCCL values that were replaced (None if none was)."""
    if not overrides:
        return None
    what = ", ".join(f"{k}={old} -> {new}" for k, (old, new) in sorted(overrides.items()))
    return (f"NCCL settings replaced so that a survivor outlives a dead peer (its watchdog would otherwise tear it "
            f"down): {what}")


# ---------------------------------------------------------------------------------------------- determinism
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the workspace settings cuBLAS is deterministic with


@dataclass(frozen=True)
class Determinism:
    """What a CUDA worker applies so that a recovered run ends bitwise equal to a failure-free one."""

    env: dict[str, str] = field(default_factory=dict)  # set before CUDA starts
    deterministic_algorithms: bool = True
    warn_only: bool = False  # False: torch forces deterministic kernels and refuses the others
    cudnn_benchmark: bool = False
    cudnn_deterministic: bool = True
    sdpa: dict[str, bool] = field(default_factory=lambda: {
        "enable_flash_sdp": False, "enable_mem_efficient_sdp": False, "enable_cudnn_sdp": False,
        "enable_math_sdp": True})


def determinism_settings(env: Mapping[str, str]) -> Determinism:
    """The settings for a CUDA worker whose environment is `env` (a deterministic cuBLAS workspace
    the user chose is kept)."""
    if env.get("CUBLAS_WORKSPACE_CONFIG") in DETERMINISTIC_CUBLAS:
        return Determinism()
    return Determinism(env={"CUBLAS_WORKSPACE_CONFIG": DETERMINISTIC_CUBLAS[0]})


def apply_determinism(d: Determinism, env: MutableMapping[str, str], torch_mod: Any) -> None:
    """Apply `d`: its environment first (before the first CUDA call of the process), then torch's flags."""
    env.update(d.env)
    torch_mod.use_deterministic_algorithms(d.deterministic_algorithms, warn_only=d.warn_only)
    torch_mod.backends.cudnn.benchmark = d.cudnn_benchmark
    torch_mod.backends.cudnn.deterministic = d.cudnn_deterministic
    for name, on in d.sdpa.items():
        fn = getattr(torch_mod.backends.cuda, name, None)
        if fn is not None:  # (enable_cudnn_sdp is newer than the others)
            fn(on)
