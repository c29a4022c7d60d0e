"""One optimizer update of a ZeRO-1 shard: phoenixft's AdamW against torch's, one thread, same machine.

    python bench/optim_step.py                 # 5.4M elements (`small`'s shard at DP=2)
    python bench/optim_step.py --numel 50000000 --repeat 3

Times (best and median of `--repeat`):
- phoenixft's `AdamW.update` as Trainer.step calls it: out of place (committed half -> staging half),
  in 4 MiB chunks: with the run-time-built kernel of `phoenixft/optim/native.py` (one pass, torch's
  fused arithmetic), and without it (`PHOENIXFT_NATIVE=0`: the state copied, then torch's fused
  kernel in place), with the bits of both compared;
- the same arithmetic as the single-tensor path (lerp, mul, addcmul, sqrt, div, addcdiv, each a
  pass over memory), by `--numel` elements at once, for comparison;
- torch.optim.AdamW over twice as many elements (DDP's replicated update at DP=2), default
  (single-tensor on CPU) and `fused=True`.
Prints milliseconds; writes bench/results/optim_step.json.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import RESULTS, machine_info, write_json

from phoenixft.optim import AdamW, native
from phoenixft.train.shard_gather import CHUNK_BYTES


def _single_tensor(p_in: torch.Tensor, m0: torch.Tensor, v0: torch.Tensor, g: torch.Tensor, step: int, lr: float,
                   p_out: torch.Tensor, m1: torch.Tensor, v1: torch.Tensor, wd: float = 0.1) -> None:
    """phoenixft's AdamW before it ran the fused kernel (torch's single-tensor arithmetic, out of place)."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    torch.lerp(m0, g, 1 - b1, out=m1)
    torch.mul(v0, b2, out=v1)
    v1.addcmul_(g, g, value=1 - b2)
    torch.mul(p_in, 1 - lr * wd, out=p_out)
    denom = (v1.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    p_out.addcdiv_(m1, denom, value=-lr / (1 - b1**step))


def _time(fn: Callable[[], None], repeat: int) -> dict[str, float]:
    fn()  # warm-up (first touch of the outputs)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return {"best_ms": ts[0] * 1e3, "median_ms": ts[len(ts) // 2] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=5_400_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.numel < 1 or a.repeat < 1:
        ap.error(f"--numel and --repeat must be >= 1, got {a.numel} and {a.repeat}")
    torch.set_num_threads(1)
    n = a.numel
    halves = torch.zeros(2, 3, n)
    halves[0, 0].normal_()
    halves[0, 2].uniform_()
    g = torch.randn(n)
    opt, chunk = AdamW(), CHUNK_BYTES // 4
    ri, ro = halves[0], halves[1]

    def ours() -> None:
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            opt.update(ri[0][lo:hi], [ri[1][lo:hi], ri[2][lo:hi]], g[lo:hi], 5, 1e-3, ro[0][lo:hi],
                       [ro[1][lo:hi], ro[2][lo:hi]])

    def copied() -> None:
        saved = dict(native._state)
        native._state.update(fn=None, why="off for the comparison")
        try:
            ours()
        finally:
            native._state.clear()
            native._state.update(saved)

    def before() -> None:
        _single_tensor(ri[0], ri[1], ri[2], g, 5, 1e-3, ro[0], ro[1], ro[2])

    p = torch.nn.Parameter(torch.randn(2 * n))
    p.grad = torch.randn(2 * n)
    default = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fused = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    kernel = native.status()
    print(f"optimizer update: {kernel}")
    ours()
    out_native = ro.clone()
    copied()
    same_bits = bool(torch.equal(out_native.view(torch.int32), ro.view(torch.int32)))
    print(f"native kernel and copy + fused give the same bits: {same_bits}")
    rows = {
        f"phoenixft AdamW.update, {n:,} elements (4 MiB chunks; native kernel if built)": _time(ours, a.repeat),
        f"phoenixft AdamW.update, {n:,} elements (4 MiB chunks; copy + torch fused)": _time(copied, a.repeat),
        f"single-tensor arithmetic out of place, {n:,} elements (phoenixft before)": _time(before, a.repeat),
        f"torch.optim.AdamW default, {2 * n:,} elements (DDP at DP=2)": _time(default.step, a.repeat),
        f"torch.optim.AdamW(fused=True), {2 * n:,} elements": _time(fused.step, a.repeat),
    }
    for name, r in rows.items():
        print(f"{name:78s} best {r['best_ms']:7.1f} ms   median {r['median_ms']:7.1f} ms")
    write_json(Path(a.out) / "optim_step.json", {"part": "optim_step", "numel": n, "threads": 1, "rows": rows,
                                                 "kernel": kernel, "same_bits": same_bits,
                                                 "machine": machine_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
