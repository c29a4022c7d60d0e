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
