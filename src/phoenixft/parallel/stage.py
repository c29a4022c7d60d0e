"""The `Stage` seam: the part of a model one rank runs, and how its parameters map onto the full model.

A data-parallel rank runs the whole model (`WholeModel`: the workload's own module and loss). Under
tensor or pipeline parallelism the workload's `split(full_model, spec)` returns the stage of one
(pp, tp) coordinate: its own module (the parameters this rank trains), a forward that takes the
previous stage's activation (or the batch, on the first stage) and returns the next activation (or
the loss, on the last stage), and the logical pieces of each parameter (parallel/logical.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phoenixft.parallel.layers import TPHandle, Wait
from phoenixft.parallel.logical import Piece

__all__ = ["Stage", "StageSpec", "WholeModel"]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """Which stage to cut: pipeline stage pp of pp_size, tensor-parallel rank tp of tp_size."""

    pp: int
    pp_size: int
    tp: int
    tp_size: int
    handle: TPHandle

    @property
    def first(self) -> bool:
        return self.pp == 0

    @property
    def last(self) -> bool:
        return self.pp == self.pp_size - 1


class Stage:
    """Base of every stage. Subclasses set `module` and implement `forward` and `pieces`."""

    module: torch.nn.Module
    first: bool = True
    last: bool = True
    handle: TPHandle | None = None

    def forward(self, inp: torch.Tensor | None, batch: Any) -> torch.Tensor:
        """The activation for the next stage, or on the last stage the microbatch's scalar loss."""
        raise NotImplementedError

    def act_shape(self, batch: Any) -> tuple[int, ...]:
        """Shape of the activation passed between stages for `batch` (pipelines only)."""
        raise NotImplementedError

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def pieces(self) -> list[list[Piece]]:
        """Per trainable parameter (module order): the slices of full parameters it concatenates."""
        raise NotImplementedError

    def full(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every trainable parameter of the full model, in its order."""
        raise NotImplementedError

    def counted(self) -> list[bool]:
        """Per parameter: whether it counts in the global gradient norm (copies count once)."""
        return [True] * len(self.params())

    def tied(self) -> list[bool]:
        """Per parameter: whether its gradient is summed with the other end of the pipeline."""
        return [False] * len(self.params())

    def bind(self, pg: Any, wait: Wait) -> None:
        """The epoch's tensor-parallel group (None when tp = 1)."""
        if self.handle is not None:
            self.handle.bind(pg, wait)


class WholeModel(Stage):
    """Data-parallel only: the workload's whole model and loss on every rank."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
        self.module, self._loss = model, loss

    def forward(self, inp: torch.Tensor | None, batch: Any) -> torch.Tensor:
        return self._loss(self.module, batch)

    def pieces(self) -> list[list[Piece]]:
        return [[(n, 0, 0, p.shape[0] if p.dim() else 1)] for n, p in self._named()]

    def full(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape) or (1,)) for n, p in self._named()]

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
