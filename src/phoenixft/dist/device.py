"""The device seam: everything that differs between a CPU worker and a CUDA worker lives here.

The training step, the snapshot and the recovery code are written once, against this small
interface, so the CPU tests exercise the same logic the GPU path runs:

- `Device`: where the model, its gradients and the optimizer shard's working copy live
  (`cpu`, or one GPU `cuda:i`), the backend of the training groups (`gloo` / `nccl`), how a
  host tensor is allocated (shared memory, *pinned* on CUDA so copies to and from it are
  asynchronous), and how a process group is built on a store prefix (`new_group`).
- The copy stream: `Device.d2h(dst_host, src_device)` copies the updated optimizer shard into
  its host ping-pong half and returns a `Pending` (`done()`, `wait(timeout)`). On CUDA the copy
  runs on a dedicated stream after an event recorded on the compute stream, so the next step's
  kernels never wait for it; the half is committed only once the copy's end event completed. On
  CPU the optimizer writes the host half itself: the copy is a no-op and `Pending` is done at once.
  `Device.h2d` (restore) copies a host half back into the working copy.
- `place(kind, local_rank, node, nodes)`: the worker's device. On CUDA each worker takes the GPU
  of its LOCAL_RANK (`torch.cuda.set_device`), NCCL's watchdog is set up so that a peer's death
  raises in our polled wait instead of killing the survivor (`nccl_env`), and deterministic
  kernels are requested (a recovered run must end bitwise equal to a failure-free one).

Two environment variables serve one-host setups (tests, the GPU check): `PHOENIXFT_GPU_PLACEMENT=spread`
places the workers of the emulated nodes of a local run on different GPUs (node ordinal x
workers + local rank, modulo the GPUs) instead of every node on GPUs 0..G-1, and
`PHOENIXFT_NCCL_HOSTID=worker` gives each worker its own `NCCL_HOSTID`, so that NCCL accepts
several ranks on one GPU (it then talks to them as to other hosts, over its network transport;
for checks, not for speed). `PHOENIXFT_DEVICE_MIRROR=1` (tests only) makes a CPU worker keep a
separate working copy of its shard and copy it into the host halves lazily, as the GPU path
does, so the CPU suite covers that path's ordering: commit after the copy, H2D after a restore.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.errors import UserError

__all__ = ["DEVICES", "Device", "Pending", "DONE", "alloc", "resolve_device", "cuda_unavailable", "place", "nccl_env",
           "apply_nccl_env", "gloo_group", "BIND_ENV", "gpu_index", "PLACEMENT_ENV", "HOSTID_ENV", "MIRROR_ENV"]

DEVICES = ("cpu", "cuda")
PLACEMENT_ENV = "PHOENIXFT_GPU_PLACEMENT"
HOSTID_ENV = "PHOENIXFT_NCCL_HOSTID"
MIRROR_ENV = "PHOENIXFT_DEVICE_MIRROR"


def cuda_unavailable() -> str | None:
    """Why CUDA cannot be used in this process (None if it can). Initialises nothing but the
    CUDA runtime's device count (never call it in a process that forks CUDA workers later)."""
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
    return None


def resolve_device(name: str) -> str:
    """`auto` becomes `cuda` when a CUDA device is available, else `cpu`; other names are returned as given."""
    if name == "auto":
        return "cuda" if cuda_unavailable() is None else "cpu"
    return name


def nccl_env() -> dict[str, str]:
    """Defaults for NCCL's error handling in a process that must survive its peers.

    torch's defaults kill the process on an NCCL error or timeout (`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`),
    let a heartbeat monitor terminate it when the watchdog stalls, and dump debug state into the
    store on a timeout. Here an error only aborts the communicator (mode 2: clean up, never tear
    down); the failed work then reports completion with an error, which our polled wait raises as
    `PeerFailure`, and the recovery retires the whole epoch's groups with `abort()`."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_PROPAGATE_ERROR": "0",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "NCCL_NVLS_ENABLE": "0",
    }


def apply_nccl_env(env: MutableMapping[str, str], node: str, local_rank: int) -> dict[str, str]:
    """Set the `nccl_env` defaults in `env` (values the user set are kept), deterministic cuBLAS,
    and with `PHOENIXFT_NCCL_HOSTID=worker` a host id of this worker's own; returns what it set."""
    want = {**nccl_env(), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = {k: v for k, v in want.items() if k not in env}
    env.update(done)
    if env.get(HOSTID_ENV, "") == "worker":
        env["NCCL_HOSTID"] = done["NCCL_HOSTID"] = f"phoenixft-{node}.{local_rank}"
    return done


def gpu_index(local_rank: int, node: str, nodes: int, workers_per_node: int, count: int, placement: str) -> int:
    """The GPU of a worker: its LOCAL_RANK (`local-rank`, one host per node), or with `spread`
    (several emulated nodes on one host) the node's ordinal (n<i>: i, spare s<j>: nodes + j) times
    the workers per node plus the local rank; both modulo the GPUs of the host."""
    if count < 1:
        raise ValueError("no GPU to place a worker on")
    if placement == "local-rank":
        return local_rank % count
    if placement != "spread":
        raise UserError(f"{PLACEMENT_ENV}={placement!r} is invalid: one of local-rank, spread")
    kind, num = node[:1], node[1:]
    ordinal = int(num) if num.isdigit() else 0
    if kind == "s":
        ordinal += nodes
    return (ordinal * workers_per_node + local_rank) % count


class Pending:
    """A copy in flight: `done()` without blocking, `wait(timeout_s)` True once it completed."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True


DONE = Pending()


class _Deferred(Pending):
    """The CPU mirror's copy: not done until someone waits for it, and performed only then, so
    that a step which rewrote the source before the copy was settled would copy the wrong bytes
    (and a test would see it), and so that the commit really is deferred, as on CUDA."""

    def __init__(self, run: Callable[[], object]) -> None:
        self._run: Callable[[], object] | None = run
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._run is None

    def wait(self, timeout_s: float) -> bool:
        with self._lock:
            if self._run is not None:
                run, self._run = self._run, None
                run()
        return True


class _CudaPending(Pending):
    """The end event of a copy on the copy stream."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        nap = 0.00005
        while not self.event.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(nap)
            nap = min(2 * nap, 0.001)
        return True


def alloc(numel: int, dtype: torch.dtype, path: str | None) -> torch.Tensor:
    """Host memory of `numel` elements: a shared-memory file at `path` (kept if it already has that size,
    so a worker restarted in place finds what it held), else private zeroed memory."""
    if path is None:
        return torch.zeros(numel, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fresh = not os.path.exists(path) or os.path.getsize(path) != nbytes
    if fresh:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def _unpin(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - the process is going away or the memory already is
        pass


BIND_ENV = "PHOENIXFT_BIND"  # the address this host's gloo groups listen on (set by its agent)


def gloo_group(store: dist.Store, rank: int, world: int, timeout: timedelta, lanes: int = 1, threads: int = 2) -> Any:
    """A gloo process group on `store`, listening on this host's `PHOENIXFT_BIND` address if set.

    `lanes` > 1: that many gloo devices, i.e. that many TCP connections per pair, collectives taking
    them in turn, and `threads` worker threads to drive them; a bulk transfer posted as several
    rounds then moves over parallel connections (bench/gloo_link.py --lanes: 400 MB between two
    processes here, 1.7-1.9 GB/s on one connection, 2.7-3.0 GB/s on two with four threads)."""
    if lanes < 1 or threads < 1:
        raise ValueError(f"a gloo group needs lanes >= 1 and threads >= 1, got {lanes} and {threads}")
    bind = os.environ.get(BIND_ENV, "")
    if not bind and lanes == 1 and threads == 2:
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._threads = threads
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind) if bind
                     else dist.ProcessGroupGloo.create_default_device() for _ in range(lanes)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


class Device:
    """One worker's device: `cpu`, or GPU `index` with `cuda`. `mirror` (always on CUDA) keeps the
    optimizer shard's working copy apart from its host ping-pong halves."""

    def __init__(self, kind: str = "cpu", index: int = 0, mirror: bool = False) -> None:
        if kind not in DEVICES:
            raise ValueError(f"device {kind!r}: one of {', '.join(DEVICES)}")
        self.kind, self.index = kind, index
        self.is_cuda = kind == "cuda"
        self.mirror = self.is_cuda or mirror
        self.torch = torch.device("cuda", index) if self.is_cuda else torch.device("cpu")
        self._stream: Any = None

    def __repr__(self) -> str:
        return f"Device({self.describe()})"

    def describe(self) -> str:
        if self.is_cuda:
            return f"cuda:{self.index}"
        return "cpu (mirrored shard)" if self.mirror else "cpu"

    @property
    def backend(self) -> str:
        """Backend of the training groups (data-parallel, tensor-parallel, pipeline, embedding)."""
        return "nccl" if self.is_cuda else "gloo"

    # ---------------------------------------------------------------- tensors
    def move(self, obj: Any) -> Any:
        """`obj` (a tensor, or tuples, lists and dicts of them: a batch) on this device; unchanged on CPU."""
        if not self.is_cuda:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(self.torch)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*(self.move(x) for x in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.move(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self.move(v) for k, v in obj.items()}
        return obj

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """`t` contiguous on this device (a copy only when it is elsewhere)."""
        return t.to(self.torch).contiguous()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor in place (shared memory included: `cudaHostRegister`), so copies
        between it and the GPU run asynchronously; unregistered when the tensor is freed. No-op on CPU."""
        if not self.is_cuda or t.numel() == 0 or t.is_pinned():
            return t
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1 = cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {err})")
        weakref.finalize(t, _unpin, ptr)
        return t

    def host(self, numel: int, dtype: torch.dtype, path: str | None) -> torch.Tensor:
        """Host memory for a snapshot: a shared-memory file when `path` is set (it outlives the
        process), pinned on CUDA."""
        if path is None and self.is_cuda:
            return torch.zeros(numel, dtype=dtype, pin_memory=True)
        return self.pin(alloc(numel, dtype, path))

    def working_copy(self, host: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer reads and writes for `host` (the ping-pong halves): `host`
        itself on CPU (the optimizer writes the staging half directly; the snapshot costs no copy),
        else a device tensor of the same shape, filled from the host by `h2d`."""
        if not self.mirror:
            return host
        return torch.zeros(host.shape, dtype=host.dtype, device=self.torch)

    # ---------------------------------------------------------------- the copy stream
    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        """Copy the working copy `src` into the host half `dst`, off the compute stream."""
        if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.device == dst.device:
            return DONE  # CPU: the optimizer wrote the host half itself
        if not self.is_cuda:
            return _Deferred(lambda: dst.copy_(src))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.torch)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.torch))  # after the optimizer's kernels
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            end = torch.cuda.Event()
            end.record(self._stream)
        return _CudaPending(end)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a host half `src` into the working copy `dst` (restore), ordered before the next
        kernels of the compute stream. No-op when they are the same memory."""
        if src.data_ptr() == dst.data_ptr() and src.device == dst.device:
            return
        dst.copy_(src)

    # ---------------------------------------------------------------- process groups
    def new_group(self, backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        """A process group on `store` (an epoch's PrefixStore), never registered with torch.

        gloo: `gloo_group` (`ProcessGroupGloo(store, rank, size, timeout)`, on this host's
        `PHOENIXFT_BIND` address when set), as every epoch always built it.
        nccl: `ProcessGroupNCCL(store, rank, size, options)` with `options._timeout`, then
        `eager_connect_single_device` (as torch.distributed._dist2's factory does), so the
        communicator exists, on this worker's GPU, when the epoch's groups are built."""
        if backend == "gloo":
            return gloo_group(store, rank, size, timeout)
        if backend != "nccl":
            raise NotImplementedError(f"backend {backend!r}")
        if not self.is_cuda:
            raise RuntimeError("NCCL groups need a CUDA device (--device cuda)")
        pg_nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
        if pg_nccl is None:
            raise RuntimeError(f"this torch ({torch.__version__}) has no NCCL (torch.distributed.ProcessGroupNCCL)")
        opts = pg_nccl.Options()
        opts._timeout = timeout
        pg = pg_nccl(store, rank, size, opts)
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(self.torch)
        return pg


def place(kind: str, local_rank: int, node: str, nodes: int, workers_per_node: int) -> Device:
    """The device of worker `local_rank` of `node`; on CUDA, selects its GPU and prepares NCCL."""
    if kind == "cpu":
        return Device("cpu", mirror=os.environ.get(MIRROR_ENV, "") == "1")
    if kind != "cuda":
        raise UserError(f"--device={kind!r} is invalid: one of {', '.join(DEVICES)}")
    why = cuda_unavailable()
    if why is not None:
        raise UserError(f"--device=cuda is invalid: {why}; use --device cpu")
    apply_nccl_env(os.environ, node, local_rank)  # before the first NCCL group and the first cuBLAS call
    index = gpu_index(local_rank, node, nodes, workers_per_node, torch.cuda.device_count(),
                      os.environ.get(PLACEMENT_ENV, "local-rank") or "local-rank")
    torch.cuda.set_device(index)
    os.environ["LOCAL_RANK"] = str(local_rank)  # for workload code that looks for it
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return Device("cuda", index)
