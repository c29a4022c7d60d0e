"""A user workload that is not the GPT: a small MLP regressing a fixed random linear map.

Used by the tests through `--workload user_workload:workload` (with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import torch

from phoenixft import Workload, WorkloadContext


def workload(ctx: WorkloadContext) -> Workload:
    teacher = torch.Generator().manual_seed(99)
    w_true = torch.randn(16, 1, generator=teacher)

    def build_model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 1009 + index)
        x = torch.randn(ctx.micro_batch, 16, generator=g)
        return x, x @ w_true

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return torch.nn.functional.mse_loss(model(x), y)

    return Workload(build_model=build_model, loss=loss, batch=batch)


def broken_workload(ctx: WorkloadContext) -> Workload:
    """The same workload with a bug that fires at step 4 (a software error: not ours to heal)."""
    wl = workload(ctx)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if b[0].shape[0] and torch.is_grad_enabled() and _step[0] >= 4:
            raise ValueError("shapes do not line up (deliberate bug)")
        return wl.loss(model, b)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _step[0] = step
        return wl.batch(step, index)

    return Workload(build_model=wl.build_model, loss=loss, batch=batch)


_step = [0]
