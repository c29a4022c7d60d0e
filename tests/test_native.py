"""The out-of-place Adam/AdamW kernel (optim/native.py): torch's fused bits, its fallbacks, its use.

The kernel replaces "copy the committed half, then torch's fused kernel in place" on CPU; a run must
not depend on which path a machine takes, so every test here compares bits, not values.
"""

from __future__ import annotations

import random
import tempfile
from typing import Any

import pytest
import torch

from phoenixft.optim import AdamW, native
from phoenixft.optim.optimizers import Adam


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A process-local decision made afresh (and restored afterwards)."""
    monkeypatch.setattr(native, "_state", {})
    return native._state


def _kernel() -> Any:
    fn = native.kernel()
    if fn is None:
        pytest.skip(f"no native kernel on this machine: {native.status()}")
    return fn


def _unchecked_kernel() -> Any:
    """The compiled kernel without the load-time check (which would hide a wrong kernel by declining it)."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    return native._load(native._build(cc))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_property_kernel_equals_torch_fused_bitwise_over_thousands_of_cases() -> None:
    fn = _unchecked_kernel()
    rng = random.Random(1234)
    for i in range(2000):
        n = native.ALIGN * rng.randint(1, 40)
        g = torch.Generator().manual_seed(i)
        scale = [10 ** rng.uniform(-8, 3) for _ in range(4)]
        p = torch.randn(n, generator=g) * scale[0]
        m = torch.randn(n, generator=g) * scale[1]
        v = torch.rand(n, generator=g) * scale[2]
        grad = torch.randn(n, generator=g) * scale[3]
        if i % 7 == 0:
            m.zero_()
            v.zero_()  # step 1: the state starts at zero
        if i % 11 == 0:
            grad[::2] = 0.0
        if i % 13 == 0:
            p[::5] = 0.0
        if i % 17 == 0:  # subnormal gradients
            grad[1::3] = 1e-40
        step = rng.choice([1, 2, 3, 10, rng.randint(1, 10**6)])
        lr = 10 ** rng.uniform(-7, 0)
        beta1 = rng.choice([0.9, 0.0, 0.5, 0.49, 0.51, 0.99, rng.random()])
        beta2 = rng.choice([0.95, 0.999, 0.9999, rng.random()])
        wd = rng.choice([0.0, 0.1, 0.01, rng.random()])
        eps = rng.choice([1e-8, 1e-6, 1e-12, 1e-3])
        decoupled = rng.random() < 0.5
        outs = [torch.full_like(p, float("nan")) for _ in range(3)]
        before = [_bits(x).clone() for x in (p, m, v, grad)]
        native._call(fn, p, m, v, grad, *outs, step, lr, beta1, beta2, wd, eps, decoupled)
        # out of place: the inputs are left as they were, and the update did something (a zero gradient
        # element still decays exp_avg unless beta1 is 0, where exp_avg becomes the gradient)
        assert all(torch.equal(_bits(x), b) for x, b in zip((p, m, v, grad), before, strict=True)), f"case {i}"
        assert not torch.equal(_bits(outs[1]), _bits(m)), f"case {i}: exp_avg not updated"
        ref = [p.clone(), m.clone(), v.clone()]
        native._torch_fused(*ref, grad, step, lr, beta1, beta2, wd, eps, decoupled)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), outs, ref, strict=True):
            assert torch.equal(_bits(a), _bits(b)), (
                f"case {i}: {name} differs in {int((_bits(a) != _bits(b)).sum())} of {n} elements "
                f"(beta1={beta1} beta2={beta2} wd={wd} eps={eps} decoupled={decoupled} step={step} lr={lr})")


@pytest.mark.parametrize("opt", [AdamW(), AdamW(weight_decay=0.0, beta1=0.3), Adam(weight_decay=0.05),
                                 Adam(weight_decay=0.0)], ids=["adamw", "adamw-beta1-0.3", "adam-l2", "adam"])
def test_optimizer_update_is_the_same_with_and_without_the_kernel(opt: AdamW, fresh_state: dict[str, Any]) -> None:
    """AdamW.update out of place through the kernel == the copy + torch fused path, over several steps,
    in chunks as Trainer.step cuts them, with the fault hook firing once mid-update."""
    _kernel()
    n, chunk = 64 * 300, 64 * 70  # the last chunk is shorter, like a shard's
    g = torch.Generator().manual_seed(5)

    def run(use_kernel: bool) -> tuple[list[torch.Tensor], int]:
        fresh_state.clear()
        if not use_kernel:
            fresh_state.update(fn=None, why="off for the test")
        halves = torch.zeros(2, 3, n)
        halves[0, 0] = torch.randn(n, generator=torch.Generator().manual_seed(9))
        fired = [0]
        src = 0
        for step in range(1, 5):
            grad = torch.randn(n, generator=g)
            dst = 1 - src
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                hook = (lambda: fired.__setitem__(0, fired[0] + 1)) if lo == 0 else None
                opt.update(halves[src, 0, lo:hi], [halves[src, 1, lo:hi], halves[src, 2, lo:hi]], grad[lo:hi], step,
                           1e-2, halves[dst, 0, lo:hi], [halves[dst, 1, lo:hi], halves[dst, 2, lo:hi]], hook=hook)
            src = dst
        return [halves[src, i].clone() for i in range(3)], fired[0]

    g.manual_seed(5)
    with_kernel, fired_k = run(True)
    g.manual_seed(5)
    without, fired_c = run(False)
    assert fired_k == fired_c == 4
    for a, b in zip(with_kernel, without, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_the_hook_fires_with_the_output_half_partly_written(fresh_state: dict[str, Any]) -> None:
    _kernel()
    n = 64 * 10
    p, m, v, grad = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
    out = [torch.full((n,), float("nan")) for _ in range(3)]
    seen: list[tuple[int, int]] = []

    def hook() -> None:
        seen.append((int(out[0].isnan().sum()), n))

    assert AdamW()._out_of_place(p, m, v, grad, out[0], out[1], out[2], 1, 1e-3, hook)
    assert seen and 0 < seen[0][0] < n  # part written, part not, when a fault "inside the update" fires
    assert not out[0].isnan().any()


def test_the_kernel_declines_what_it_cannot_do_bitwise(fresh_state: dict[str, Any]) -> None:
    _kernel()
    n = 64
    ins = [torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)]
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, decoupled=True)
    outs = [torch.empty(n) for _ in range(3)]
    assert native.adam_out_of_place(*ins, *outs, **kw)
    # a length off torch's vector width would reach its scalar tail, which rounds differently
    assert not native.adam_out_of_place(*(t[:40] for t in ins), *(t[:40] for t in outs), **kw)
    # in place, or outputs overlapping inputs or each other
    assert not native.adam_out_of_place(*ins, ins[0], outs[1], outs[2], **kw)
    big = torch.empty(2 * n)
    assert not native.adam_out_of_place(*ins, big[:n], big[32 : 32 + n], outs[2], **kw)
    # not fp32, not contiguous
    assert not native.adam_out_of_place(*ins, outs[0].double(), outs[1], outs[2], **kw)
    assert not native.adam_out_of_place(*ins, torch.empty(2 * n)[::2], outs[1], outs[2], **kw)


def test_no_compiler_means_the_portable_path_and_says_why(fresh_state: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert native.kernel() is None
    assert native.status() == "copy + torch's fused kernel: no C compiler found ($CC, cc, gcc, clang)"
    n = 64
    outs = [torch.empty(n) for _ in range(3)]
    assert not native.adam_out_of_place(torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n), *outs,
                                        step=1, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
                                        decoupled=True)


def test_disabled_by_environment(fresh_state: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOENIXFT_NATIVE", "0")
    assert native.kernel() is None
    assert "PHOENIXFT_NATIVE=0" in native.status()


def test_a_kernel_that_rounds_differently_is_refused(fresh_state: dict[str, Any]) -> None:
    """The load-time check is what makes the kernel safe: one kernel with a different rounding (here
    torch's single-tensor arithmetic, which differs in the last bit) must be caught."""

    def wrong(pi: int, mi: int, vi: int, gi: int, po: int, mo: int, vo: int, n: int, w1: float, b2: float,
              c2: float, ss: float, bc2: float, eps: float, wd: float, decay: float, dec: int) -> None:
        def t(ptr: int) -> torch.Tensor:
            import ctypes

            return torch.frombuffer((ctypes.c_float * n).from_address(ptr), dtype=torch.float32)

        p, m, v, g = t(pi), t(mi), t(vi), t(gi)
        torch.lerp(m, g, w1, out=t(mo))
        torch.mul(v, b2, out=t(vo)).addcmul_(g, g, value=c2)
        pd = p * decay if dec else p
        t(po).copy_(pd.addcdiv(t(mo), t(vo).sqrt() / bc2 + eps, value=-ss))

    assert native.self_check(wrong) is not None


def test_a_failed_build_means_the_portable_path(fresh_state: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Any) -> None:
    monkeypatch.setenv("PHOENIXFT_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_FLAGS", [*native._FLAGS, "-fno-such-flag-for-the-test"])
    assert native.kernel() is None
    assert native.status().startswith("copy + torch's fused kernel: not built: RuntimeError:")
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".build-*"))  # nothing half-written left


def test_the_cache_is_built_once_and_reused(fresh_state: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Any) -> None:
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("PHOENIXFT_CACHE", str(tmp_path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # not a copy built by an earlier run
    assert native.kernel() is not None
    built = list(tmp_path.glob("adam_oop-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    fresh_state.clear()
    assert native.kernel() is not None
    assert built[0].stat().st_mtime_ns == mtime


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(fresh_state: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("PHOENIXFT_CACHE", "/proc/phoenixft-cache-cannot-exist")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert native.kernel() is not None, native.status()
    assert str(tmp_path / "phoenixft-cache-") in native.status()
    assert list(tmp_path.glob("phoenixft-cache-*/adam_oop-*.so"))


def test_thread_splits_off_the_vector_width_take_torchs_kernel(fresh_state: dict[str, Any]) -> None:
    """torch's kernel cuts a chunk over its threads (ceil(n / threads) each) and rounds each piece's
    tail differently: where a piece is not a multiple of 16 the kernel declines (the same bits as
    without a compiler), and where every piece is, it runs."""
    _kernel()
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, decoupled=True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        n = 16 * 100  # ceil(1600 / 3) = 534: not a multiple of 16
        ins = [torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)]
        assert not native.adam_out_of_place(*ins, *[torch.empty(n) for _ in range(3)], **kw)
        n = 16 * 99  # 528 per thread
        ins = [torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)]
        outs = [torch.empty(n) for _ in range(3)]
        assert native.adam_out_of_place(*ins, *outs, **kw)
        ref = [ins[0].clone(), ins[1].clone(), ins[2].clone()]
        native._torch_fused(*ref, ins[3], 3, 1e-3, 0.9, 0.95, 0.1, 1e-8, True)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, ref, strict=True))
    finally:
        torch.set_num_threads(old)
