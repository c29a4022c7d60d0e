"""An out-of-place Adam/AdamW kernel with torch's fused CPU arithmetic, built at run time when it can be.

Why: the shard optimizer reads the committed half and writes the staging half, so that a failure
mid-update never damages the recovery point. torch's fused CPU kernel (`torch._fused_adamw_`) only
updates in place, so without this the committed half is first copied into the staging half (three
rows of the shard: 65 MB a step on `small` at DP=2) and the kernel then runs there. This kernel
reads one half and writes the other in one pass: measured on one core over the 5.4M-element shard,
16-18 ms against 24-26 ms for copy + fused (`python bench/optim_step.py`).

It must give the same bits as torch's kernel, or a run would depend on whether a compiler was
found. torch 2.13's fused vector body computes, per element, in float32 with float32 constants:
`g' = fma(p, wd, g)` (Adam's L2 decay) or `p' = p * (1 - lr*wd)` (AdamW's decoupled decay),
`m = lerp(m, g', 1-beta1)` as torch's vectorized lerp rounds it (one fma on either branch),
`v = fma(g'*(1-beta2), g', v*beta2)`, `d = sqrt(v) / sqrt(1-beta2^t) + eps`, `p'' = p' - step_size*m/d`,
and the C below is compiled with `-ffp-contract=off` so that the compiler fuses nothing else.
Its scalar tail (the last length % vector-width elements of each thread's range) rounds with double
constants instead, so this kernel is used only on lengths that are multiples of 16 elements (shards
and update chunks are multiples of 64: `parallel.layout.SHARD_ALIGN`) and that torch's threads would
split into chunks of multiples of 16 (with `--threads` 3 or 6, say, some chunks are not: then
torch's kernel runs, as it would without a compiler).

Nothing is assumed: on first use it is compiled with the system's C compiler (`$CC`, else `cc`/`gcc`)
into a cache directory (`$PHOENIXFT_CACHE`, else `$XDG_CACHE_HOME/phoenixft`, else
`~/.cache/phoenixft`), keyed by the source, the flags and the CPU, written atomically, loaded with
ctypes (the call releases the GIL), and then checked bitwise against torch's kernel on random
inputs covering both decay modes and both lerp branches. If there is no compiler, the build fails,
the check finds one differing bit, or `PHOENIXFT_NATIVE=0` is set, `kernel()` returns None and the
optimizer copies and runs torch's kernel as before: the same bits either way, only slower.
`python -m phoenixft.optim.native` builds it and says which path a run will take.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["kernel", "status", "adam_out_of_place", "ALIGN"]

ALIGN = 16  # torch's widest float vector (AVX-512): lengths that are multiples of it never reach its scalar tail

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
/* one loop per (decay mode, lerp branch): branch-free bodies the compiler vectorizes */
#define BODY(DECOUPLED, L2, SMALL) \
  for (int64_t i = 0; i < n; i++) { \
    float p = p_in[i], gr = g[i]; \
    if (DECOUPLED) p = p * decay; \
    if (L2) gr = fmaf(p, wd, gr); \
    float m0 = m_in[i]; \
    float m = SMALL ? fmaf(w1, gr - m0, m0) : fmaf(m0 - gr, w1c, gr); \
    float v = fmaf(gr * c2, gr, v_in[i] * b2); \
    m_out[i] = m; \
    v_out[i] = v; \
    float d = sqrtf(v) / bc2_sqrt + eps; \
    p_out[i] = p - step_size * m / d; \
  }

void phoenixft_adam_oop(const float* restrict p_in, const float* restrict m_in, const float* restrict v_in,
                        const float* restrict g, float* restrict p_out, float* restrict m_out,
                        float* restrict v_out, int64_t n, float w1, float b2, float c2, float step_size,
                        float bc2_sqrt, float eps, float wd, float decay, int decoupled) {
  const float w1c = 1.0f - w1;
  const int small = fabsf(w1) < 0.5f;
  if (decoupled) {
    if (small) { BODY(1, 0, 1) } else { BODY(1, 0, 0) }
  } else if (wd != 0.0f) {
    if (small) { BODY(0, 1, 1) } else { BODY(0, 1, 0) }
  } else {
    if (small) { BODY(0, 0, 1) } else { BODY(0, 0, 0) }
  }
}
"""
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "fn": the ctypes function or None, "why": how it was decided


def _cache_dir() -> Path:
    if os.environ.get("PHOENIXFT_CACHE"):
        return Path(os.environ["PHOENIXFT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "phoenixft"


def _cpu_key() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags (a cache shared by hosts
    with different CPUs must not hand one host another's instructions)."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    text += line
                if line.strip() == "":
                    break  # the first processor's block is enough
    except OSError:
        pass
    return text or platform.processor() or platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc.split()[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), cc, _cpu_key(), platform.machine()]).encode())
    name = f"adam_oop-{key.hexdigest()[:16]}.so"
    dirs = [_cache_dir(), Path(tempfile.gettempdir()) / f"phoenixft-cache-{os.getuid()}"]
    for d in dirs:
        if (d / name).exists():
            return d / name
    for d in dirs:  # a cache that cannot be written (a read-only home): the machine's temporary directory
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return _compile(cc, d / name)
        except OSError:
            continue
    raise RuntimeError(f"no writable cache directory ({', '.join(map(str, dirs))})")


def _compile(cc: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "adam_oop.c"
        src.write_text(_SOURCE)
        so = Path(tmp) / "adam_oop.so"
        proc = subprocess.run([*cc.split(), *_FLAGS, str(src), "-o", str(so), "-lm"], capture_output=True,
                              text=True, timeout=_BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[:300]}")
        os.replace(so, out)  # atomic: concurrent builders each install a complete file
    return out


def _load(path: Path) -> Any:
    lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released for the call
    fn = lib.phoenixft_adam_oop
    fp, f32 = ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [fp] * 7 + [ctypes.c_int64] + [f32] * 8 + [ctypes.c_int]
    fn.restype = None
    return fn


def _call(fn: Any, p_in: torch.Tensor, m_in: torch.Tensor, v_in: torch.Tensor, grad: torch.Tensor,
          p_out: torch.Tensor, m_out: torch.Tensor, v_out: torch.Tensor, step: int, lr: float, beta1: float,
          beta2: float, weight_decay: float, eps: float, decoupled: bool) -> None:
    # the constants as torch's kernel derives them: in double, then rounded to float32 once
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**step)
    fn(p_in.data_ptr(), m_in.data_ptr(), v_in.data_ptr(), grad.data_ptr(), p_out.data_ptr(), m_out.data_ptr(),
       v_out.data_ptr(), p_in.numel(), 1 - beta1, beta2, 1 - beta2, step_size, bc2_sqrt, eps, weight_decay,
       1 - lr * weight_decay, int(decoupled))


def _torch_fused(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, step: int, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float, decoupled: bool) -> None:
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused([p], [grad], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def self_check(fn: Any, cases: int = 24, seed: int = 0) -> str | None:
    """None when `fn` gives torch's bits on `cases` random updates; else what differed."""
    g = torch.Generator().manual_seed(seed)

    def u(a: float, b: float) -> float:
        return float(torch.empty(1).uniform_(a, b, generator=g))

    for i in range(cases):
        n = ALIGN * int(torch.randint(1, 600, (1,), generator=g))
        p = torch.randn(n, generator=g) * 10 ** u(-3, 1)
        m = torch.randn(n, generator=g) * 10 ** u(-6, 0)
        v = torch.rand(n, generator=g) * 10 ** u(-10, 0)
        grad = torch.randn(n, generator=g) * 10 ** u(-6, 2)
        if i % 5 == 0:
            m.zero_()
            v.zero_()
        if i % 3 == 0:
            grad[:: 3] = 0.0
        step = int(torch.randint(1, 100_000, (1,), generator=g))
        lr = 10 ** u(-6, -0.5)
        beta1 = (0.9, 0.3, 0.99, 0.5, u(0.0, 1.0))[i % 5]  # both lerp branches (1-beta1 below and above 0.5)
        beta2 = (0.95, 0.999, u(0.5, 1.0))[i % 3]
        wd = (0.0, 0.1, u(0.0, 0.5))[i % 3]
        eps = (1e-8, 1e-6, 1e-12)[i % 3]
        decoupled = i % 2 == 0
        outs = (torch.empty_like(p), torch.empty_like(m), torch.empty_like(v))
        _call(fn, p, m, v, grad, outs[0], outs[1], outs[2], step, lr, beta1, beta2, wd, eps, decoupled)
        ref = (p.clone(), m.clone(), v.clone())
        _torch_fused(ref[0], ref[1], ref[2], grad, step, lr, beta1, beta2, wd, eps, decoupled)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), outs, ref, strict=True):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):  # bits, not values
                return (f"{name} differs from torch's fused kernel in {int((a != b).sum())} of {n} elements "
                        f"(case {i}: beta1={beta1:.3g} beta2={beta2:.3g} wd={wd:.3g} decoupled={decoupled})")
    return None


def kernel() -> Any:
    """The verified out-of-place kernel, or None (see the module docstring). Built and checked once
    per process, on first call; safe from several threads."""
    fn = _state.get("fn", _state)  # decided: no lock on the update's path (called once per chunk)
    if fn is not _state:
        return fn
    with _lock:
        if "fn" in _state:
            return _state["fn"]
        fn, why = None, ""
        if os.environ.get("PHOENIXFT_NATIVE", "1") == "0":
            why = "disabled by PHOENIXFT_NATIVE=0"
        elif platform.system() != "Linux" or sys.byteorder != "little":
            why = f"not built on {platform.system()}/{sys.byteorder}-endian"
        elif (cc := _compiler()) is None:
            why = "no C compiler found ($CC, cc, gcc, clang)"
        else:
            try:
                path = _build(cc)
                cand = _load(path)
                bad = self_check(cand)
                if bad is None:
                    fn, why = cand, f"built with {cc} at {path}, bitwise equal to torch's fused kernel"
                else:
                    why = f"not used: {bad}"
            except Exception as e:  # noqa: BLE001 - any failure means the portable path
                why = f"not built: {type(e).__name__}: {e}"
        _state["fn"], _state["why"] = fn, why
        return fn


def status() -> str:
    """One line: which path the optimizer takes in this process, and why."""
    fn = kernel()
    return ("out-of-place kernel: " if fn is not None else "copy + torch's fused kernel: ") + _state["why"]


def adam_out_of_place(p_in: torch.Tensor, m_in: torch.Tensor, v_in: torch.Tensor, grad: torch.Tensor,
                      p_out: torch.Tensor, m_out: torch.Tensor, v_out: torch.Tensor, *, step: int, lr: float,
                      beta1: float, beta2: float, weight_decay: float, eps: float, decoupled: bool) -> bool:
    """Run the kernel if it applies (built and verified, contiguous fp32 CPU tensors of one length that
    is a multiple of ALIGN, outputs disjoint from inputs); False: nothing was done, use the fallback."""
    ts = (p_in, m_in, v_in, grad, p_out, m_out, v_out)
    n = p_in.numel()
    threads = torch.get_num_threads()
    if threads > 1 and -(-n // threads) % ALIGN:
        # torch's kernel splits n over its threads in chunks of ceil(n / threads), each with its own
        # scalar tail: with chunks off the vector width its bits differ from one pass, so it runs instead
        return False
    if n == 0 or n % ALIGN or any(t.numel() != n or t.dtype != torch.float32 or t.device.type != "cpu"
                                   or not t.is_contiguous() for t in ts):
        return False
    spans = [(t.data_ptr(), t.data_ptr() + 4 * n) for t in ts]
    for i, (a0, a1) in enumerate(spans[4:], 4):  # each output apart from every input and every other output
        if any(a0 < b1 and b0 < a1 for j, (b0, b1) in enumerate(spans) if j != i):
            return False
    fn = kernel()
    if fn is None:
        return False
    _call(fn, p_in, m_in, v_in, grad, p_out, m_out, v_out, step, lr, beta1, beta2, weight_decay, eps, decoupled)
    return True


if __name__ == "__main__":
    print(status())
