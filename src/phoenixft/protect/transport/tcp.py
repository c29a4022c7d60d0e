"""The TCP backend: a pair's bytes travel in the epoch's replication group's payload collectives."""

from __future__ import annotations

from typing import ClassVar

import torch

from phoenixft.protect.transport.base import ReplicaTransport

__all__ = ["TcpTransport"]


class TcpTransport(ReplicaTransport):
    """The owner sends each chunk to the holder; the holder receives it into its staging half in place."""

    name: ClassVar[str] = "tcp"
    over_group: ClassVar[bool] = True

    def send(self, dst: int, part: torch.Tensor) -> dict[int, torch.Tensor]:
        return {dst: part}

    def receive(self, src: int, part: torch.Tensor) -> tuple[dict[int, int], torch.Tensor | None]:
        return {src: part.numel()}, part

    def complete(self, dst: torch.Tensor, half: int) -> int:
        return 0  # everything arrived in the collectives
