"""The GPU check's first look at the machine (bench/gpu_check.py runs it in a process of its own, with a
time limit): prints one JSON object.

- the device: Python, torch, CUDA, cuDNN, NCCL (the build's and, from a one-rank NCCL group, the one
  loaded at run time), the GPUs (name, capability, memory), the driver (nvidia-smi, else NVML), cores,
  free /dev/shm;
- the NCCL path's smallest case: a one-rank group built through the device seam, an all-reduce waited
  the way a worker waits (a mark event behind the work, never torch's `wait()`), its result checked;
- a snapshot half in /dev/shm pinned in place (`is_pinned()`), and the copy/compute overlap of the
  copy stream measured with CUDA events: a copy of `--copy-mb` into that half alone, a chain of matrix
  products alone, then both at once; `overlap` is the share of the shorter one hidden (1: fully
  concurrent, 0: serialized).

    PYTHONPATH=src python bench/gpu_probe.py [--copy-mb 256]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
            if p.returncode == 0 and p.stdout.strip():
                return p.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import pynvml  # (nvidia-ml-py)

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - no NVML here
        return None


def facts() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cpus": os.cpu_count(), "gpus": 0}
    try:
        out["dev_shm_free_gib"] = round(shutil.disk_usage("/dev/shm").free / 2**30, 1)
    except OSError:
        out["dev_shm_free_gib"] = None
    if not torch.cuda.is_available():
        return out
    out["gpus"] = torch.cuda.device_count()
    out["cudnn"] = torch.backends.cudnn.version()
    out["nccl_build"] = ".".join(map(str, torch.cuda.nccl.version()))
    out["driver"] = _driver()
    out["devices"] = []
    for i in range(out["gpus"]):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                               "memory_gib": round(p.total_memory / 2**30, 1),
                               "multiprocessors": p.multi_processor_count})
    return out


def nccl_one_rank(device: Any) -> dict[str, Any]:
    """A one-rank NCCL group through the seam, an all-reduce waited by polling its mark, aborted."""
    import torch.distributed as dist

    from phoenixft.distributed.comm import wait_work

    pg = device.new_group("nccl", dist.HashStore(), 0, 1, timedelta(seconds=60))
    try:
        x = torch.arange(1 << 20, dtype=torch.float32, device=device.torch)
        y = x.clone()
        wait_work(pg.allreduce([y]), "one-rank all-reduce", lambda: None, 30.0)
        runtime = getattr(pg.pg, "get_runtime_nccl_version", None)
        version = runtime() if callable(runtime) else None
        return {"ok": bool(torch.equal(x, y)), "runtime_nccl": str(version) if version is not None else None}
    finally:
        pg.abort()


def overlap(device: Any, copy_mb: int) -> dict[str, Any]:
    """The copy stream beside the compute stream, timed with CUDA events (see the module docstring)."""
    from phoenixft.protect.snapshot import ShardState

    free_mb = shutil.disk_usage("/dev/shm").free >> 20  # the two halves take twice the copy: never past the room
    copy_mb = min(copy_mb, free_mb // 4)
    if copy_mb < 8:
        return {"ok": False, "error": f"/dev/shm has {free_mb} MiB free: no room for a snapshot half"}
    n = (copy_mb << 20) // 4 // 3
    path = f"/dev/shm/phoenixft-gpucheck-{os.getpid()}"
    st = ShardState(n, path, rows=3, device=device)
    try:
        src, dst = st.dev[1], st.data[1]
        src.normal_()
        a = torch.randn(4096, 4096, device=device.torch)
        cur = torch.cuda.current_stream(device.torch)

        def compute() -> None:
            for _ in range(12):
                a.copy_(torch.tanh(a @ a))

        def timed(copy: bool, work: bool) -> float:
            torch.cuda.synchronize(device.torch)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(cur)
            pending = device.d2h(dst, src) if copy else None
            if work:
                compute()
            if pending is not None:
                cur.wait_stream(device._stream)
            t1.record(cur)
            torch.cuda.synchronize(device.torch)
            return float(t0.elapsed_time(t1))

        timed(True, True)  # warm-up (cuBLAS, the copy stream)
        c, w, both = timed(True, False), timed(False, True), timed(True, True)
        hidden = (c + w - both) / min(c, w) if min(c, w) > 0 else 0.0
        return {"pinned": bool(st.data.is_pinned()), "bytes": dst.numel() * dst.element_size(), "copy_ms": round(c, 3),
                "compute_ms": round(w, 3), "both_ms": round(both, 3), "overlap": round(max(0.0, min(1.0, hidden)), 3),
                "copy_gb_per_s": round(dst.numel() * dst.element_size() / c / 1e6, 2) if c > 0 else None}
    finally:
        for f in glob.glob(path + "*"):
            os.unlink(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copy-mb", type=int, default=256, help="bytes of the timed snapshot copy (MiB)")
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"facts": facts()}
    if out["facts"]["gpus"]:
        from phoenixft.distributed.device import place

        device = place("cuda", 0, "n0", 1, 1)  # the worker's own set-up: NCCL settings, deterministic kernels
        out["env"] = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("TORCH_NCCL", "NCCL_"))}
        checks = (("nccl", lambda: nccl_one_rank(device)), ("snapshot_copy", lambda: overlap(device, a.copy_mb)))
        for name, fn in checks:
            try:
                out[name] = fn()
            except Exception as e:  # noqa: BLE001 - reported, the rest still runs
                first = str(e).splitlines()[0][:300] if str(e) else ""
                out[name] = {"ok": False, "error": f"{type(e).__name__}: {first}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
