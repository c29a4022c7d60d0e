"""The shard optimizers against torch's (bitwise where torch has one), schedules against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from phoenixft.errors import UserError
from phoenixft.optim import SGD, Adam, AdamW, ElementwiseOptimizer, Lion, check_elementwise, lr_at, make_optimizer
from phoenixft.parallel.layout import SHARD_ALIGN, shard_numel_of


def _ours(opt: ElementwiseOptimizer, p: torch.Tensor, grads: list[torch.Tensor], lrs: list[float]) -> torch.Tensor:
    s = [torch.zeros_like(p) for _ in opt.state_names]
    for k, (g, lr) in enumerate(zip(grads, lrs, strict=True), 1):
        po, so = torch.empty_like(p), [torch.empty_like(x) for x in s]
        opt.update(p, s, g, k, lr, po, so)
        p, s = po, so
    return p


def _torch(make: type[torch.optim.Optimizer], kw: dict[str, object], p: torch.Tensor, grads: list[torch.Tensor],
           lrs: list[float]) -> torch.Tensor:
    q = torch.nn.Parameter(p.clone())
    kw = {"foreach": False, **kw}
    opt = make([q], lr=lrs[0], **kw)  # type: ignore[call-arg]
    for g, lr in zip(grads, lrs, strict=True):
        for grp in opt.param_groups:
            grp["lr"] = lr
        q.grad = g.clone()
        opt.step()
    return q.detach()


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "sgd-nesterov", "adamw-single", "adam-single"])
def test_bitwise_equal_to_torch(name: str) -> None:
    """Ours against torch's optimizer: AdamW/Adam's fused CPU path against `fused=True`, their
    single-tensor arithmetic (what CUDA runs) against torch's single-tensor path."""
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(6)]
    lrs = [1e-2 * (k + 1) / 6 for k in range(6)]  # a schedule: the rate changes every step
    fused = not name.endswith("-single")
    torch_kw: dict[str, object] = {"fused": True, "foreach": None} if fused else {"foreach": False}
    if name.startswith("adamw"):
        ours, ref = AdamW(weight_decay=0.1, beta1=0.9, beta2=0.95, fused=fused), (
            torch.optim.AdamW, {"betas": (0.9, 0.95), "weight_decay": 0.1, **torch_kw})
    elif name.startswith("adam"):
        ours, ref = Adam(weight_decay=0.01, fused=fused), (torch.optim.Adam, {"betas": (0.9, 0.95),
                                                                               "weight_decay": 0.01, **torch_kw})
    else:
        nest = name == "sgd-nesterov"
        ours, ref = SGD(momentum=0.9, nesterov=nest, weight_decay=0.01), (
            torch.optim.SGD, {"momentum": 0.9, "nesterov": nest, "weight_decay": 0.01})
    assert torch.equal(_ours(ours, p, grads, lrs), _torch(ref[0], ref[1], p, grads, lrs))  # type: ignore[arg-type]


def _update(opt: ElementwiseOptimizer, p: torch.Tensor, s: list[torch.Tensor], g: torch.Tensor, step: int, lr: float,
            lo: int, hi: int) -> list[torch.Tensor]:
    po, so = torch.empty(hi - lo), [torch.empty(hi - lo) for _ in s]
    opt.update(p[lo:hi], [x[lo:hi] for x in s], g[lo:hi], step, lr, po, so)
    return [po, *so]


@pytest.mark.parametrize("opt", [AdamW(), Adam(weight_decay=0.01)], ids=["adamw", "adam"])
def test_fused_update_is_the_same_however_the_shard_is_cut(opt: ElementwiseOptimizer) -> None:
    """Property, 300 cases: lengths and cuts at multiples of SHARD_ALIGN (as shards and the step's
    chunks are), special values included, 1 and 2 intra-op threads: every piece updated alone gives
    bitwise what the whole update gives."""
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        for case in range(300):
            torch.set_num_threads(1 + case % 2)
            n = SHARD_ALIGN * int(torch.randint(1, 400, (1,), generator=gen))
            p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            s = [torch.randn(n, generator=gen), torch.rand(n, generator=gen)]
            if case % 3 == 0:
                p[:: 7] = 0.0
                g[:: 5] = 0.0
                g[1:: 11] = 1e-30
                s[1][:: 13] = 0.0
            cuts = sorted({SHARD_ALIGN * int(c) for c in torch.randint(0, n // SHARD_ALIGN + 1, (3,), generator=gen)}
                          | {0, n})
            step, lr = 1 + case % 9, 1e-3 * (1 + case % 4)

            whole = _update(opt, p, s, g, step, lr, 0, n)
            parts = [_update(opt, p, s, g, step, lr, a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
            for w, got in zip(whole, zip(*parts, strict=True), strict=True):
                assert torch.equal(w.view(torch.int32), torch.cat(got).view(torch.int32)), (case, n, cuts)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("opt", [AdamW(), Adam(weight_decay=0.01), AdamW(fused=False),
                                 Adam(weight_decay=0.01, fused=False), SGD(weight_decay=0.01), SGD(nesterov=True),
                                 Lion()],
                         ids=["adamw", "adam", "adamw-single", "adam-single", "sgd", "sgd-nesterov", "lion"])
def test_in_place_update_equals_out_of_place(opt: ElementwiseOptimizer) -> None:
    """An optimizer that declares `in_place` (the trainer then updates in place under --protect none)
    gives bitwise the same when its outputs are its inputs, over 50 random cases."""
    assert opt.in_place and not ElementwiseOptimizer.in_place
    gen = torch.Generator().manual_seed(5)
    for case in range(50):
        n = SHARD_ALIGN * int(torch.randint(1, 200, (1,), generator=gen))
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        s = [torch.rand(n, generator=gen) for _ in opt.state_names]
        step, lr = 1 + case % 7, 1e-3 * (1 + case % 3)
        expect = _update(opt, p, s, g, step, lr, 0, n)
        p2, s2 = p.clone(), [x.clone() for x in s]
        opt.update(p2, s2, g, step, lr, p2, s2)
        for e, got in zip(expect, [p2, *s2], strict=True):
            assert torch.equal(e.view(torch.int32), got.view(torch.int32)), (case, n)


def test_shards_are_aligned() -> None:
    """Property: every shard length is the smallest multiple of SHARD_ALIGN that covers numel."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(3000):
        numel = int(torch.randint(1, 10**8, (1,), generator=gen))
        shards = int(torch.randint(1, 5000, (1,), generator=gen))
        k = shard_numel_of(numel, shards)
        assert k % SHARD_ALIGN == 0 and k * shards >= numel and (k - SHARD_ALIGN) * shards < numel


def test_lion_against_its_definition() -> None:
    """Chen et al. 2023, Algorithm 2, written out element by element."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(50, generator=gen)
    grads = [torch.randn(50, generator=gen) for _ in range(4)]
    b1, b2, wd, lr = 0.9, 0.99, 0.1, 1e-3
    got = _ours(Lion(weight_decay=wd, beta1=b1, beta2=b2), p0, grads, [lr] * 4)
    for i in range(50):
        x, m = float(p0[i]), 0.0
        for g in grads:
            c = b1 * m + (1 - b1) * float(g[i])
            x = x * (1 - lr * wd) - lr * math.copysign(1.0, c) * (c != 0)
            m = b2 * m + (1 - b2) * float(g[i])
        assert abs(float(got[i]) - x) < 1e-6


def test_non_elementwise_and_torch_optimizers_are_refused() -> None:
    class Normalised(ElementwiseOptimizer):
        name = "normalised"

        def update(self, p_in, s_in, grad, step, lr, p_out, s_out, hook=None):  # type: ignore[no-untyped-def]
            torch.add(p_in, grad / grad.norm(), alpha=-lr, out=p_out)

    with pytest.raises(UserError, match="not elementwise"):
        check_elementwise(Normalised())
    q = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(UserError, match="torch.optim.SGD"):
        make_optimizer("adamw", weight_decay=0, beta1=0.9, beta2=0.9, eps=1e-8, momentum=0, nesterov=False,
                       custom=torch.optim.SGD([q], lr=0.1))
    for builtin in (AdamW(), Adam(), SGD(nesterov=True), Lion()):
        check_elementwise(builtin)


def test_schedules_by_hand() -> None:
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup": 10, "decay": 0, "total": 110}
    for sched in ("constant", "cosine", "linear", "wsd"):
        assert lr_at(1, schedule=sched, **kw) == pytest.approx(0.1)  # type: ignore[arg-type]
        assert lr_at(10, schedule=sched, **kw) == pytest.approx(1.0)  # type: ignore[arg-type]
    assert lr_at(60, schedule="constant", **kw) == 1.0  # type: ignore[arg-type]
    # cosine over the 100 steps after the warm-up: half way is the mean of lr and min_lr
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(0.55)  # type: ignore[arg-type]
    assert lr_at(110, schedule="cosine", **kw) == pytest.approx(0.1)  # type: ignore[arg-type]
    assert lr_at(35, schedule="cosine", **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))  # type: ignore[arg-type]
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.55)  # type: ignore[arg-type]
    # wsd: stable until the last 20% (22 steps), then linear to min_lr
    assert lr_at(88, schedule="wsd", **kw) == 1.0  # type: ignore[arg-type]
    assert lr_at(99, schedule="wsd", **kw) == pytest.approx(1.0 - 0.9 * 11 / 22)  # type: ignore[arg-type]
    assert lr_at(110, schedule="wsd", **kw) == pytest.approx(0.1)  # type: ignore[arg-type]
