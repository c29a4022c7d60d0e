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
- `place(kind, local_rank, node, nodes, workers_per_node)`: the worker's device, decided on its own
  host (`auto`: CUDA when a GPU is visible here). On CUDA, before the first CUDA call, the process
  gets the NCCL settings a survivor needs and deterministic kernels (`distributed/cuda_env.py`: a recovered
  run must end bitwise equal to a failure-free one), then selects its GPU: the GPU of its LOCAL_RANK
  (one host per node), or, in a local run (`PHOENIXFT_GPU_PLACEMENT=spread`, set by `phoenixft run`),
  its slot in the plan of every worker of the run over the host's GPUs (`cuda_env.plan_gpus`: workers
  beyond the GPUs get an NCCL host identity of their own). `PHOENIXFT_NCCL_HOSTID=worker` gives
  every worker its own identity.

`check_device_here` and `visible_gpus` ask about this host without initialising CUDA (NVML), so an
agent may check, then fork its CUDA workers. `PHOENIXFT_AUTO_DEVICE` pins what `auto` means (the
test suite pins `cpu`). `PHOENIXFT_DEVICE_MIRROR=1` (tests only) makes a CPU worker keep a
separate working copy of its shard and copy it into the host halves lazily, as the GPU path
does, so the CPU suite covers that path's ordering: commit after the copy, H2D after a restore.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.distributed.cuda_env import (
    HOSTID_ENV,
    PLACEMENT_ENV,
    GpuSlot,
    apply_determinism,
    apply_nccl_env,
    determinism_settings,
    local_workers,
    nccl_env,
    nccl_overrides,
    override_line,
    plan_gpus,
)
from phoenixft.distributed.cuda_timing import CopyTiming
from phoenixft.distributed.nccl import NcclGroup, check_handling_mode
from phoenixft.errors import UserError

__all__ = ["DEVICES", "Device", "Pending", "DONE", "alloc", "resolve_device", "cuda_unavailable", "place", "nccl_env",
           "apply_nccl_env", "gloo_group", "BIND_ENV", "gpu_slot", "PLACEMENT_ENV", "HOSTID_ENV", "MIRROR_ENV",
           "AUTO_DEVICE_ENV", "visible_gpus", "cuda_unavailable_here", "check_device_here", "GpuSlot"]

DEVICES = ("cpu", "cuda")
MIRROR_ENV = "PHOENIXFT_DEVICE_MIRROR"
AUTO_DEVICE_ENV = "PHOENIXFT_AUTO_DEVICE"  # what `--device auto` resolves to, whatever the host has (tests: cpu)
PAGE = os.sysconf("SC_PAGE_SIZE")


def cuda_unavailable() -> str | None:
    """Why CUDA cannot be used in this process (None if it can). Initialises nothing but the
    CUDA runtime's device count (never call it in a process that forks CUDA workers later)."""
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
    return None


def visible_gpus() -> int:
    """The GPUs torch would see here, counted without initialising CUDA in this process (NVML, else a
    short child process), so that an agent may still fork workers that use CUDA afterwards."""
    if not torch.backends.cuda.is_built():
        return 0
    count_nvml = getattr(torch.cuda, "_device_count_nvml", None)
    n = count_nvml() if count_nvml is not None else -1
    if n >= 0:
        return int(n)
    if _no_gpu_device_files():  # (a CPU-only host with PyPI's torch, a CUDA build: no child importing torch)
        return 0
    try:
        p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
        return int(p.stdout.strip() or 0) if p.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _no_gpu_device_files() -> bool:
    """Linux with none of the device files through which CUDA reaches an NVIDIA GPU: the driver's
    `/dev/nvidia*` (bound into containers too), Jetson's `/dev/nvhost-*`, WSL 2's `/dev/dxg`."""
    if not sys.platform.startswith("linux") or getattr(torch.version, "hip", None):
        return False
    return not (glob.glob("/dev/nvidia*") or glob.glob("/dev/nvhost-*") or os.path.exists("/dev/dxg"))


def cuda_unavailable_here() -> str | None:
    """Why this host cannot run CUDA workers (None if it can), asked without initialising CUDA here."""
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    if visible_gpus() < 1:
        return "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
    return None


def resolve_device(name: str) -> str:
    """What `name` means on this host: `auto` is `cuda` when a GPU is visible here, else `cpu` (or what
    `PHOENIXFT_AUTO_DEVICE` says: the test suite pins `cpu`); other names are returned as given."""
    if name != "auto":
        return name
    pinned = os.environ.get(AUTO_DEVICE_ENV, "")
    if pinned in DEVICES:
        return pinned
    return "cuda" if cuda_unavailable_here() is None else "cpu"


def check_device_here(name: str, where: str = "this host") -> str:
    """The device the workers of this host train on (`auto` resolved here); UserError, one line,
    when it is not one of the devices or is `cuda` on a host without one. Decided where the workers
    run: the agent checks it for its host, the worker applies it."""
    if name not in ("auto", *DEVICES):
        raise UserError(f"--device={name!r} is invalid: one of auto, {', '.join(DEVICES)}")
    kind = resolve_device(name)
    if kind == "cuda":
        why = cuda_unavailable_here()
        if why is not None:
            raise UserError(f"--device=cuda is invalid on {where}: {why}; use --device cpu (or --device auto)")
    return kind


def gpu_slot(local_rank: int, node: str, nodes: int, workers_per_node: int, count: int, placement: str) -> GpuSlot:
    """The GPU of a worker: its LOCAL_RANK (`local-rank`: one host per node; a host identity of its own
    only beyond the GPUs), or with `spread` (every node of a local run on this host) its slot in
    `plan_gpus` over the run's workers."""
    if placement == "local-rank":
        return plan_gpus(count, [(node, lr) for lr in range(max(workers_per_node, local_rank + 1))])[(node, local_rank)]
    if placement != "spread":
        raise UserError(f"{PLACEMENT_ENV}={placement!r} is invalid: one of local-rank, spread")
    return plan_gpus(count, local_workers(nodes, 0, workers_per_node, node))[(node, local_rank)]


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


SIDE_PRIORITY = -1  # the copy and mark streams' priority (see side_stream)


def side_stream(device: torch.device) -> Any:
    """A CUDA stream for the snapshot copy or the marks of NCCL works, from torch's pool of high-priority
    streams: NCCL groups draw theirs from the default-priority pool, and a stream shared with one would queue
    this stream's work behind its collectives (a mark waiting on a data-parallel reduce placed on the tensor-
    parallel group's stream would make that group's next collective wait for the reduce)."""
    return torch.cuda.Stream(device=device, priority=SIDE_PRIORITY)


class _Marker:
    """The marks of one NCCL group's works (distributed/nccl.py): an event that completes once the work's
    kernels finished, recorded on a stream of this group's own, ordered behind the work
    (`block_current_stream`: orders the stream, never blocks or aborts). One stream per group: a group whose
    abort hangs leaves its stream waiting, and the next epoch's groups must not queue behind it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None

    def __call__(self, work: Any) -> Any:
        if self.stream is None:
            self.stream = side_stream(self.device)
        with torch.cuda.stream(self.stream):
            work.block_current_stream()
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev


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

    _pin_failed = False  # a registration failed in this process (said once)

    def __init__(self, kind: str = "cpu", index: int = 0, mirror: bool = False, emulate_nccl: bool = False,
                 wid: str = "") -> None:
        if kind not in DEVICES:
            raise ValueError(f"device {kind!r}: one of {', '.join(DEVICES)}")
        self.kind, self.index = kind, index
        self.is_cuda = kind == "cuda"
        self.emulate_nccl = emulate_nccl and not self.is_cuda  # (tests: distributed/nccl_emulation.py)
        self.mirror = self.is_cuda or mirror or self.emulate_nccl
        self.wid = wid  # the worker's id ("n0.0"), when placed for one
        self.torch = torch.device("cuda", index) if self.is_cuda else torch.device("cpu")
        self._stream: Any = None
        self.timing: CopyTiming | None = CopyTiming.from_env(wid) if self.is_cuda else None

    def __repr__(self) -> str:
        return f"Device({self.describe()})"

    def describe(self) -> str:
        if self.is_cuda:
            return f"cuda:{self.index}"
        if self.emulate_nccl:
            return "cpu (mirrored shard, NCCL emulated on gloo)"
        return "cpu (mirrored shard)" if self.mirror else "cpu"

    @property
    def backend(self) -> str:
        """Backend of the training groups (data-parallel, tensor-parallel, pipeline, embedding)."""
        return "nccl" if self.is_cuda or self.emulate_nccl else "gloo"

    # ---------------------------------------------------------------- randomness
    def seed(self, seed: int) -> None:
        """Seed the generators this worker draws from: the CPU's default one and, on a GPU, this device's.
        `torch.manual_seed` seeds the same two (and every other device), but each call queues a deferred
        seeding, with a captured Python stack, for every device kind torch has not initialised: a per-
        microbatch cost on the training path."""
        torch.default_generator.manual_seed(seed)
        if self.is_cuda:
            if not torch.cuda.is_initialized():
                torch.cuda.init()  # (the generators exist once CUDA is initialised)
            torch.cuda.default_generators[self.index].manual_seed(seed)

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
        """`t` page-locked, so copies between it and the GPU run asynchronously: a page-aligned mapping
        (a shared-memory file) in place (`cudaHostRegister`, unregistered when the tensor is freed),
        other memory as a pinned copy (registering part of a page another registration shares fails).
        `t` itself on CPU, and where the registration fails (a sandbox that refuses it): then the halves
        stay pageable, the copies into them synchronous, and the process says so in one line, once."""
        if not self.is_cuda or t.numel() == 0 or t.is_pinned():
            return t
        if t.data_ptr() % PAGE or t.untyped_storage().data_ptr() != t.data_ptr():
            return t.pin_memory()
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1 = cudaHostRegisterPortable
        if err != 0:
            if not Device._pin_failed:
                Device._pin_failed = True
                print(f"phoenixft {self.wid or 'worker'}: cudaHostRegister of {nbytes} bytes of shared memory failed "
                      f"(cudaError {err}): the snapshot halves stay pageable, so their copy from the GPU is "
                      "synchronous", flush=True)
            return t
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
            self._stream = side_stream(self.torch)
        timing = self.timing  # (the GPU check's measurement: distributed/cuda_timing.py)
        ready = torch.cuda.Event(enable_timing=timing is not None and timing.times_ready())
        ready.record(torch.cuda.current_stream(self.torch))  # after the optimizer's kernels
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            start = torch.cuda.Event(enable_timing=True) if timing is not None and timing.measures() else None
            if start is not None:
                start.record(self._stream)
            dst.copy_(src, non_blocking=True)
            end = torch.cuda.Event(enable_timing=start is not None)
            end.record(self._stream)
        if self.timing is not None:
            self.timing.copied(ready, start, end, dst)
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
        if not self.is_cuda and not self.emulate_nccl:
            raise RuntimeError("NCCL groups need a CUDA device (--device cuda)")
        check_handling_mode()  # only phoenixft aborts an NCCL communicator, after the descriptor (distributed/nccl.py)
        if self.emulate_nccl:
            from phoenixft.distributed.nccl_emulation import EmulatedGroup

            emulated = EmulatedGroup(gloo_group(store, rank, size, timeout), store, self.wid)
            return NcclGroup(emulated, lambda work: work, timeout.total_seconds())
        pg_nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
        if pg_nccl is None:
            raise RuntimeError(f"this torch ({torch.__version__}) has no NCCL (torch.distributed.ProcessGroupNCCL)")
        opts = pg_nccl.Options()
        opts._timeout = timeout
        pg = pg_nccl(store, rank, size, opts)
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(self.torch)
        return NcclGroup(pg, _Marker(self.torch), timeout.total_seconds())


def place(kind: str, local_rank: int, node: str, nodes: int, workers_per_node: int) -> Device:
    """The device of worker `local_rank` of `node` (`auto` resolved on this host); on CUDA, sets up the
    process before its first CUDA call (NCCL settings, deterministic kernels), then selects its GPU."""
    kind = check_device_here(kind, f"this host (node {node})")
    wid = f"{node}.{local_rank}"
    if kind == "cpu":
        mirror = os.environ.get(MIRROR_ENV, "")
        if mirror == "nccl":  # (tests: the NCCL settings as on a GPU, NCCL's failure behaviour on gloo)
            apply_nccl_env(os.environ, node, local_rank)
        return Device("cpu", mirror=mirror == "1", emulate_nccl=mirror == "nccl", wid=wid)
    apply_determinism(determinism_settings(os.environ), os.environ, torch)  # CUBLAS_WORKSPACE_CONFIG: before cuBLAS
    why = cuda_unavailable()
    if why is not None:
        raise UserError(f"--device=cuda is invalid on this host (node {node}): {why}; use --device cpu")
    slot = gpu_slot(local_rank, node, nodes, workers_per_node, torch.cuda.device_count(),
                    os.environ.get(PLACEMENT_ENV, "local-rank") or "local-rank")
    line = override_line(nccl_overrides(os.environ))
    own = slot.own_host or os.environ.get(HOSTID_ENV, "") == "worker"
    apply_nccl_env(os.environ, node, local_rank, own_host=own)  # before the first NCCL group
    if line and local_rank == 0:  # (the agent normally did this already, and said so)
        print(f"phoenixft worker {node}.{local_rank}: {line}", flush=True)
    torch.cuda.set_device(slot.gpu)
    os.environ["LOCAL_RANK"] = str(local_rank)  # for workload code that looks for it
    return Device("cuda", slot.gpu, wid=wid)
