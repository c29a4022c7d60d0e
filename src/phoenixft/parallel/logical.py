"""The logical, layout-free view of a model's state: where each element of a stage sits in the full model.

A stage's parameters are slices of the full model's (a tensor-parallel rank holds some rows or
columns, a pipeline stage some layers). Each local parameter is described by its *pieces*: slices
`(full_name, dim, start, stop)` of full parameters, concatenated along `dim`. From them `segments`
computes runs `(local_offset, full_offset, length)` between the stage's flat vector (its parameters
in order) and the full model's flat vector (the full model's trainable parameters in order), so
any per-element state (master weights, optimizer moments) moves between layouts with slice copies:
`to_full` scatters a stage's rows into the full rows, `from_full` cuts them out. The final state
hash, the export and a resume on another layout all go through the full rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Piece", "segments", "to_full", "from_full", "full_numel"]

Piece = tuple[str, int, int, int]  # (full parameter name, dim, start, stop)
Segment = tuple[int, int, int]  # (local offset, full offset, length)


def _offsets(full: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    out, off = {}, 0
    for name, shape in full:
        out[name] = (off, tuple(shape))
        off += math.prod(shape)
    return out


def full_numel(full: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in full)


def segments(local: Sequence[Sequence[Piece]], full: Sequence[tuple[str, tuple[int, ...]]]) -> list[Segment]:
    """Runs mapping the stage's flat vector (`local`: the pieces of each of its parameters, in order)
    onto the full flat vector (`full`: (name, shape) of the full model's parameters, in order)."""
    where = _offsets(full)
    runs: list[Segment] = []
    lbase = 0
    for pieces in local:
        if not pieces:
            continue
        dim = pieces[0][1]
        shape0 = where[pieces[0][0]][1]
        outer, inner = math.prod(shape0[:dim]), math.prod(shape0[dim + 1:])
        width = sum(b - a for _, _, a, b in pieces)
        for o in range(outer):
            cum = 0
            for name, d, a, b in pieces:
                fbase, shape = where[name]
                if d != dim or math.prod(shape[:d]) != outer or math.prod(shape[d + 1:]) != inner:
                    raise ValueError(f"pieces of one parameter must cut full tensors of matching shape: {pieces}")
                n = (b - a) * inner
                lo = lbase + (o * width + cum) * inner
                fo = fbase + (o * shape[d] + a) * inner
                if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == fo:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
                else:
                    runs.append((lo, fo, n))
                cum += b - a
        lbase += outer * width * inner
    return runs


def to_full(local_rows: torch.Tensor, segs: Sequence[Segment], full_rows: torch.Tensor) -> None:
    """Scatter a stage's rows (rows x local numel) into the full rows (rows x full numel)."""
    for lo, fo, n in segs:
        full_rows[..., fo : fo + n] = local_rows[..., lo : lo + n]


def from_full(full_rows: torch.Tensor, segs: Sequence[Segment], local_numel: int) -> torch.Tensor:
    """A stage's rows cut out of the full rows."""
    out = torch.empty(*full_rows.shape[:-1], local_numel, dtype=full_rows.dtype)
    for lo, fo, n in segs:
        out[..., lo : lo + n] = full_rows[..., fo : fo + n]
    return out
