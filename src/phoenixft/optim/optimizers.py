"""Elementwise optimizers over one flat fp32 shard, out of place, with every state tensor protected.

A ZeRO-1 shard is a contiguous slice of the flattened model, so only *elementwise* optimizers can
run on it unchanged: each output element depends only on the same element of the inputs (and on
the step and the learning rate). Each optimizer reads the committed half of the shard's ping-pong
pair (fp32 master weights + its state tensors) and writes the staging half, so the local snapshot
costs no copy and a failure mid-update never damages the committed half.

Built in (`--optimizer`): `adamw`, `adam` (L2 weight decay added to the gradient, as
torch.optim.Adam), `sgd` (momentum, Nesterov; torch.optim.SGD's arithmetic) and `lion` (Chen et
al. 2023). A workload may bring its own through `Workload.optimizer`: subclass
`ElementwiseOptimizer`, name its `state_names` (each state tensor is shaped like the shard) and
write `update`. `check_elementwise` refuses one that is not elementwise (an update of the whole
shard must equal the updates of its halves done separately) with a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phoenixft.errors import UserError
from phoenixft.optim.native import ALIGN, adam_out_of_place

__all__ = ["ElementwiseOptimizer", "AdamW", "Adam", "SGD", "Lion", "OPTIMIZERS", "make_optimizer",
           "check_elementwise"]


class ElementwiseOptimizer:
    """Contract: `update` writes `p_out` and every `s_out[i]` from `p_in`, `s_in`, `grad` (all 1-D fp32,
    same length), element by element. It must not modify its inputs. `s_in` is all zeros at step 1.

    `in_place = True` declares that it is also right when every output is its input (`p_out is p_in`,
    `s_out[i] is s_in[i]`): then the trainer updates in place where nothing needs the old state
    (`--protect none`). A custom optimizer is not assumed to be."""

    name: str = "custom"
    state_names: tuple[str, ...] = ()
    in_place: bool = False

    def update(self, p_in: torch.Tensor, s_in: list[torch.Tensor], grad: torch.Tensor, step: int, lr: float,
               p_out: torch.Tensor, s_out: list[torch.Tensor], hook: Callable[[], None] | None = None) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def _hook(h: Callable[[], None] | None) -> None:
    if h is not None:
        h()  # fault injection "inside the optimizer step": the output half is half written


@dataclass
class AdamW(ElementwiseOptimizer):
    """torch.optim.AdamW's arithmetic: on CPU its fused kernel's (`fused=True`: one vectorized pass,
    2.4x faster out of place here than the single-tensor arithmetic: `python bench/optim_step.py`),
    elsewhere the single-tensor path's.

    torch's fused kernel updates in place. Where a C compiler is available, `optim/native.py` builds a
    kernel with its exact arithmetic that reads the committed half and writes the staging half in one
    pass; elsewhere the committed half is first copied into the staging half and torch's kernel runs
    there (the same bits either way). The fused kernel's vector body and its scalar tail round
    differently, so an update is elementwise (the same however the shard is cut) only on lengths and
    offsets that are multiples of 16 elements: shards are multiples of `parallel.layout.SHARD_ALIGN`
    (64), and so are the chunks Trainer.step updates. `check_elementwise` tests that on 64-element pieces."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    fused: bool = True  # CPU fp32: torch's fused kernel; False: the single-tensor arithmetic (CUDA's; tests)
    name = "adamw"
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = True
    in_place = True  # each output element is written after its inputs are read

    def update(self, p_in: torch.Tensor, s_in: list[torch.Tensor], grad: torch.Tensor, step: int, lr: float,
               p_out: torch.Tensor, s_out: list[torch.Tensor], hook: Callable[[], None] | None = None) -> None:
        m0, v0 = s_in
        m1, v1 = s_out
        if self.fused and p_out.device.type == "cpu" and p_out.dtype == torch.float32:
            if p_out.data_ptr() != p_in.data_ptr() and self._out_of_place(p_in, m0, v0, grad, p_out, m1, v1, step, lr,
                                                                          hook):
                return
            for dst, src in ((m1, m0), (v1, v0)):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            _hook(hook)
            if p_out.data_ptr() != p_in.data_ptr():
                p_out.copy_(p_in)
            fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            fused([p_out], [grad], [m1], [v1], [], [torch.tensor(float(step))], lr=lr, beta1=self.beta1,
                  beta2=self.beta2, weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)
            return
        if not self.decoupled and self.weight_decay:
            grad = grad.add(p_in, alpha=self.weight_decay)
        torch.lerp(m0, grad, 1 - self.beta1, out=m1)
        torch.mul(v0, self.beta2, out=v1)
        v1.addcmul_(grad, grad, value=1 - self.beta2)
        _hook(hook)
        if self.decoupled:
            torch.mul(p_in, 1 - lr * self.weight_decay, out=p_out)
        else:
            p_out.copy_(p_in)
        bc1 = 1 - self.beta1**step
        bc2 = 1 - self.beta2**step
        denom = (v1.sqrt() / math.sqrt(bc2)).add_(self.eps)
        p_out.addcdiv_(m1, denom, value=-lr / bc1)

    def _out_of_place(self, p_in: torch.Tensor, m0: torch.Tensor, v0: torch.Tensor, grad: torch.Tensor,
                      p_out: torch.Tensor, m1: torch.Tensor, v1: torch.Tensor, step: int, lr: float,
                      hook: Callable[[], None] | None) -> bool:
        """The fused kernel's arithmetic read from one half, written to the other, no copy (native.py);
        False when it does not apply here (then nothing was written and the hook has not run)."""
        ts = (p_in, m0, v0, grad, p_out, m1, v1)

        def run(lo: int, hi: int) -> bool:
            return adam_out_of_place(*(t[lo:hi] for t in ts), step=step, lr=lr, beta1=self.beta1, beta2=self.beta2,
                                     weight_decay=self.weight_decay, eps=self.eps, decoupled=self.decoupled)

        n = p_in.numel()
        if hook is None:
            return run(0, n)
        cut = n // 2 // ALIGN * ALIGN  # the hook fires with the output half written (a fault "inside" the update)
        if cut == 0:
            if not run(0, n):
                return False
            hook()
            return True
        if not run(0, cut):
            return False
        hook()
        if not run(cut, n):
            raise RuntimeError("the out-of-place AdamW kernel applied to the first part of a shard but not the rest")
        return True


@dataclass
class Adam(AdamW):
    """torch.optim.Adam: weight decay as L2 (added to the gradient), not decoupled."""

    weight_decay: float = 0.0
    name = "adam"
    decoupled = False


@dataclass
class SGD(ElementwiseOptimizer):
    """torch.optim.SGD with momentum (dampening 0; the buffer starts as the first gradient, which is
    what a zero buffer gives) and optional Nesterov; weight decay as L2."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    name = "sgd"
    state_names = ("momentum_buffer",)
    in_place = True

    def update(self, p_in: torch.Tensor, s_in: list[torch.Tensor], grad: torch.Tensor, step: int, lr: float,
               p_out: torch.Tensor, s_out: list[torch.Tensor], hook: Callable[[], None] | None = None) -> None:
        (b0,), (b1,) = s_in, s_out
        if self.weight_decay:
            grad = grad.add(p_in, alpha=self.weight_decay)
        torch.add(b0.mul(self.momentum), grad, out=b1)
        _hook(hook)
        d = grad.add(b1, alpha=self.momentum) if self.nesterov else b1
        torch.add(p_in, d, alpha=-lr, out=p_out)


@dataclass
class Lion(ElementwiseOptimizer):
    """Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    name = "lion"
    state_names = ("exp_avg",)
    in_place = True

    def update(self, p_in: torch.Tensor, s_in: list[torch.Tensor], grad: torch.Tensor, step: int, lr: float,
               p_out: torch.Tensor, s_out: list[torch.Tensor], hook: Callable[[], None] | None = None) -> None:
        (m0,), (m1,) = s_in, s_out
        c = torch.lerp(m0, grad, 1 - self.beta1).sign_()
        torch.lerp(m0, grad, 1 - self.beta2, out=m1)
        _hook(hook)
        torch.mul(p_in, 1 - lr * self.weight_decay, out=p_out)
        p_out.add_(c, alpha=-lr)


OPTIMIZERS = {"adamw": AdamW, "adam": Adam, "sgd": SGD, "lion": Lion}


def make_optimizer(name: str, *, weight_decay: float, beta1: float, beta2: float, eps: float, momentum: float,
                   nesterov: bool, custom: object = None) -> ElementwiseOptimizer:
    """The optimizer of a run: the workload's own (checked), else `--optimizer` with its flags."""
    if custom is not None:
        if isinstance(custom, torch.optim.Optimizer):
            raise UserError(f"the workload's optimizer is a torch.optim.{type(custom).__name__}: phoenixft shards "
                            "the optimizer state over data-parallel ranks, so it needs an ElementwiseOptimizer "
                            "(see phoenixft.optim), not a torch optimizer")
        if not isinstance(custom, ElementwiseOptimizer):
            raise UserError(f"the workload's optimizer is a {type(custom).__name__}, expected a "
                            "phoenixft.optim.ElementwiseOptimizer")
        check_elementwise(custom)
        return custom
    if name == "adamw":
        return AdamW(weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)
    if name == "adam":
        return Adam(weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)
    if name == "sgd":
        return SGD(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    if name == "lion":
        return Lion(weight_decay=weight_decay, beta1=beta1, beta2=beta2)
    raise UserError(f"--optimizer={name!r} is invalid: one of {', '.join(OPTIMIZERS)}")


def check_elementwise(opt: ElementwiseOptimizer, n: int = 192) -> None:
    """Refuse an optimizer whose update of a whole shard differs from the updates of its pieces
    (pieces of 64 and 128 elements: shards and chunks are multiples of SHARD_ALIGN)."""
    if not opt.state_names and type(opt).update is ElementwiseOptimizer.update:
        raise UserError(f"the workload's optimizer {opt.describe()!r} does not implement update()")
    g = torch.Generator().manual_seed(7)
    p = torch.randn(n, generator=g)
    s = [torch.randn(n, generator=g).abs() for _ in opt.state_names]
    grads = [torch.randn(n, generator=g) for _ in range(3)]

    def run(lo: int, hi: int) -> list[torch.Tensor]:
        pi, si = p[lo:hi].clone(), [x[lo:hi].clone() for x in s]
        for k, gr in enumerate(grads, 1):
            po, so = torch.empty_like(pi), [torch.empty_like(x) for x in si]
            opt.update(pi, si, gr[lo:hi].clone(), k, 1e-2, po, so)
            pi, si = po, so
        return [pi, *si]

    whole = run(0, n)
    parts = [torch.cat(x) for x in zip(run(0, n // 3), run(n // 3, n), strict=True)]
    if not all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True)):
        raise UserError(f"the workload's optimizer {opt.describe()!r} is not elementwise (updating a shard whole and "
                        "in two pieces gives different results), so it cannot run on ZeRO shards")
