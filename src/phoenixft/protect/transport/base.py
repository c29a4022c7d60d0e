"""The replica transport seam: how the bytes of one (owner, holder) pair move for a step.

A rank's committed optimizer shard is replicated to its holders once per step (replication.py). Each
(owner, holder) pair is carried by one `ReplicaTransport` backend, chosen per epoch by the link
handshake (routes.py): `shm.ShmTransport` when the holder shares the owner's host memory (it reads the
owner's committed half from the owner's shard file), `tcp.TcpTransport` otherwise (the bytes travel in
the epoch's replication group's collectives).

Every rank of the group makes the same sequence of collective calls whatever its pairs' backends: per
ring round, one header collective, then (unless every pair of the group reads through shared memory)
one payload collective per chunk, to which a pair that does not move over the group contributes
nothing. A backend therefore answers two questions per chunk (what the owner puts in the collective,
what the holder takes out of it) and one per step, after the collectives completed (what the holder
still has to fetch itself).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

__all__ = ["TransportMode", "ReplicaTransport"]


class TransportMode(enum.Enum):
    """`--replica-transport`: which backends the handshake may choose."""

    AUTO = "auto"  # shared memory with holders on the owner's host, TCP with the others
    TCP = "tcp"  # TCP for every pair

    @classmethod
    def parse(cls, value: str | TransportMode) -> TransportMode:
        if isinstance(value, TransportMode):
            return value
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"--replica-transport={value!r} is invalid: expected one of {valid}") from None


class ReplicaTransport(ABC):
    """One (owner, holder) pair's backend, as one end of the pair sees it."""

    name: ClassVar[str]  # what reports call it ("shm", "tcp")
    over_group: ClassVar[bool]  # the pair's bytes travel in the group's payload collectives

    @abstractmethod
    def send(self, dst: int, part: torch.Tensor) -> dict[int, torch.Tensor]:
        """Owner's end: what it contributes to a payload collective for `part` of its payload."""

    @abstractmethod
    def receive(self, src: int, part: torch.Tensor) -> tuple[dict[int, int], torch.Tensor | None]:
        """Holder's end: the element counts it takes from a payload collective, and where they land."""

    @abstractmethod
    def complete(self, dst: torch.Tensor, half: int) -> int:
        """Holder's end, once the step's collectives completed: fetch what did not travel in them into
        `dst` from the owner's `half` (the one its header names: the committed one); returns the bytes
        fetched."""

    def close(self) -> None:  # noqa: B027 - a backend without resources has nothing to release
        """Release what the backend holds for the epoch (an owner's file)."""
