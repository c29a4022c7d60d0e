"""The built-in health check of a spare, and the user's `--health-check` command.

Three probes, each fast (well under a second on a CPU), run in a process forked for the check
(`spare.CheckProcess`), so that a GPU is initialised there and never in the agent that forks workers:

- **matrix product**: `A @ B` of two seeded `MATMUL_N` x `MATMUL_N` float32 matrices whose entries are
  small non-zero integers (-8..8). Every product and partial sum is an integer below 2^24, exactly
  representable in float32 (and in TF32's inputs), so the result is exact whatever the summation order:
  the same bits on every healthy CPU or GPU, of any make, with any BLAS. Its SHA-256 must equal the
  reference (`reference_checksum`: the same product in int64, the coordinator's, published in the store).
- **snapshot memory**: a sample of the memory the node's snapshot halves live in: a shared-memory
  segment (`/dev/shm`) of `SHM_CAP` bytes when the spare joins, `SHM_CAP_PROMOTION` in a later
  check, written with two patterns (a position-dependent one and its complement) and read back
  through a separate read of the file.
- **loopback collective**: a one-rank process group on the worker's device, built through the device
  seam (`dist.device.Device.new_group`: gloo on CPU, NCCL on CUDA), whose all-reduce must return its input.

A failure is a one-line reason. `run_command` runs `--health-check CMD` in a shell, in its own process
group, killed when it outlives its timeout; exit 0 is healthy.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = ["MATMUL_N", "MATMUL_SEED", "SHM_CAP", "SHM_CAP_PROMOTION", "CheckResult", "operands", "matmul_checksum",
           "reference_checksum",
           "shm_pattern", "loopback_collective", "run_command", "builtin_checks"]

MATMUL_N = 256  # |sum| <= 256 * 64 = 16384 < 2**24: exact in float32
MATMUL_SEED = 20240521
SHM_CAP = 8 * 2**20  # bytes of /dev/shm the memory probe writes at most when a spare joins
SHM_CAP_PROMOTION = 2 * 2**20  # ... and in a later check (a recovery may wait for it)
SHM_MIN = 2**20


@dataclass
class CheckResult:
    """What a health check found: ok, the first failure's reason, and how long each probe took."""

    ok: bool = True
    reason: str = ""
    times: dict[str, float] = field(default_factory=dict)

    def fail(self, probe: str, why: str) -> None:
        if self.ok:
            self.ok, self.reason = False, f"{probe}: {why}"

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "times": {k: round(v, 4) for k, v in self.times.items()}}


def operands(seed: int = MATMUL_SEED, n: int = MATMUL_N) -> tuple[Any, Any]:
    """The two int64 matrices of the product: entries in -8..-1 and 1..8 (no zero: no signed zeros)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 16, (2, n, n), generator=g, dtype=torch.int64)
    v = torch.where(v < 8, v - 8, v - 7)
    return v[0].contiguous(), v[1].contiguous()


def _digest(c: Any) -> str:
    import torch

    c = (c.to(torch.float32) + 0.0).contiguous().cpu()  # (+0.0: any -0.0 becomes +0.0)
    return hashlib.sha256(c.numpy().tobytes()).hexdigest()[:32]


def reference_checksum(seed: int = MATMUL_SEED, n: int = MATMUL_N) -> str:
    """The product's checksum computed exactly (int64 on the CPU): what every healthy device computes."""
    a, b = operands(seed, n)
    return _digest(a @ b)


def matmul_checksum(device: Any, seed: int = MATMUL_SEED, n: int = MATMUL_N, perturb: bool = False) -> str:
    """The checksum of the float32 product on `device` (a torch.device); `perturb`: one entry of A off by
    one (the `sick:` fault: what a faulty unit computes)."""
    import torch

    a, b = operands(seed, n)
    if perturb:
        a[n // 3, n // 5] += 1
    fa, fb = a.to(torch.float32).to(device), b.to(torch.float32).to(device)
    return _digest(fa @ fb)


def shm_pattern(path: str, nbytes: int) -> str:
    """Write two patterns over a new shared-memory file of `nbytes` at `path` and read each back through
    a separate read; '' if both came back intact, else why not. The file is removed."""
    import torch

    nbytes = max(8, nbytes - nbytes % 8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            view = torch.frombuffer(m, dtype=torch.int64)
            want = torch.arange(nbytes // 8, dtype=torch.int64).mul_(0x9E3779B97F4A7C15 - (1 << 64)).bitwise_xor_(
                0x5A5A5A5A5A5A5A5A)
            for pattern in (want, torch.bitwise_not(want)):
                view.copy_(pattern)
                m.flush()
                back = torch.frombuffer(bytearray(os.pread(fd, nbytes, 0)), dtype=torch.int64)
                if not torch.equal(back, pattern):
                    bad = int((back != pattern).nonzero()[0, 0]) * 8
                    return f"{nbytes} bytes written to {path} came back different at byte {bad}"
            del view
        return ""
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def loopback_collective(device: Any) -> str:
    """An all-reduce over a one-rank group on `device` (a `dist.device.Device`); '' if it returned its input."""
    import torch
    import torch.distributed as dist

    pg = device.new_group(device.backend, dist.HashStore(), 0, 1, timedelta(seconds=30))
    try:
        x = torch.arange(1024, dtype=torch.float32, device=device.torch) + 0.5
        y = x.clone()
        pg.allreduce([y]).wait()
        if device.is_cuda:
            torch.cuda.synchronize(device.torch)
        return "" if torch.equal(x, y) else "an all-reduce of one rank changed its input"
    finally:
        abort = getattr(pg, "abort", None)
        if device.is_cuda and abort is not None:
            abort()


def run_command(cmd: str, timeout_s: float) -> str:
    """Run `cmd` in a shell (its own process group, output discarded but for its last line); '' if it
    exited 0 within `timeout_s`, else why not (the group is killed on timeout)."""
    p = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()
        return f"--health-check {cmd!r} did not finish within --health-check-timeout={timeout_s:g}s"
    if p.returncode != 0:
        last = (out or b"").decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"--health-check {cmd!r} exited {p.returncode}" + (f": {last[0][:200]}" if last[0] else "")
    return ""


def builtin_checks(device: Any, shm_path: str, shm_bytes: int, reference: str, perturb: bool = False,
                   shm_cap: int = SHM_CAP) -> CheckResult:
    """The three built-in probes on `device` (a `dist.device.Device`), in order; every probe runs (its time is
    reported) and the first failure is the reason."""
    res = CheckResult()
    t = time.perf_counter()
    try:
        got = matmul_checksum(device.torch, perturb=perturb)
        if got != reference:
            res.fail("matrix product", f"checksum {got} differs from the reference {reference} (a {MATMUL_N}x"
                                       f"{MATMUL_N} float32 product every healthy device computes bit for bit)")
    except Exception as e:  # noqa: BLE001 - the device itself failed: that is the finding
        res.fail("matrix product", f"{type(e).__name__}: {str(e)[:200]}")
    res.times["matmul"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        why = shm_pattern(shm_path, min(shm_cap, max(SHM_MIN, shm_bytes)))
        if why:
            res.fail("snapshot memory", why)
    except Exception as e:  # noqa: BLE001
        res.fail("snapshot memory", f"{type(e).__name__}: {str(e)[:200]}")
    res.times["shm"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        why = loopback_collective(device)
        if why:
            res.fail("loopback collective", why)
    except Exception as e:  # noqa: BLE001
        res.fail("loopback collective", f"{type(e).__name__}: {str(e)[:200]}")
    res.times["collective"] = time.perf_counter() - t
    return res
