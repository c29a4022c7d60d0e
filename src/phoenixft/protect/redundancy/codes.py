"""Erasure codes over bytes: d data blocks -> h parity blocks; any d of the d + h rebuild the rest.

- `XorCode` (h = 1): the parity is the XOR of the data blocks (numpy on uint64 views, ~10 GB/s here).
- `ReedSolomon` (any h): zfec's systematic Vandermonde Reed-Solomon code over GF(2^8), MDS.

Chosen by measurement (bench/codecs.py, README "Erasure-coded protection"): zfec is the Reed-Solomon
library measured here that releases the GIL while it encodes (ISA-L through pyeclib and
reed-solomon-simd encode as fast or faster but hold the GIL: on phoenixft's background thread they
would stall the training loop for the whole encode).

Blocks are C-contiguous uint8 numpy arrays of one length (a multiple of 64 bytes, see
`stripe_bytes`); block indices 0..d-1 are data, d..d+h-1 parity. Every code is position-wise (byte
k of a parity block depends only on byte k of the data blocks), so stripes of blocks can be encoded
separately and decoded separately; phoenixft encodes stripe by stripe anyway and never relies on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

__all__ = ["Code", "XorCode", "ReedSolomon", "make_code", "stripe_bytes", "ALIGN"]

ALIGN = 64  # stripe lengths are multiples of this (uint64 views; SIMD-friendly)


def stripe_bytes(payload_bytes: int, d: int) -> int:
    """Bytes of one stripe when a payload of `payload_bytes` is cut into d stripes (padded, aligned)."""
    return max(ALIGN, math.ceil(payload_bytes / d / ALIGN) * ALIGN)


class Code(Protocol):
    d: int
    h: int
    name: str

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The h parity blocks of d data blocks."""
        ...

    def decode(self, pieces: Mapping[int, np.ndarray], lost: Sequence[int]) -> dict[int, np.ndarray]:
        """The data blocks `lost` (indices < d) from at least d pieces (index -> block)."""
        ...


def _check(pieces: Mapping[int, np.ndarray], lost: Sequence[int], d: int, h: int) -> list[int]:
    have = sorted(i for i in pieces if 0 <= i < d + h)
    if len(have) < d:
        raise ValueError(f"{len(have)} pieces cannot rebuild a {d}+{h} group: need {d}")
    if any(not 0 <= i < d for i in lost) or any(i in pieces for i in lost):
        raise ValueError(f"lost blocks {list(lost)} must be data blocks (0..{d - 1}) that are not given")
    return have


class XorCode:
    """Single parity: p = b0 ^ b1 ^ ... ^ b(d-1); any one lost block is the XOR of the other d."""

    name = "xor"

    def __init__(self, d: int, h: int = 1) -> None:
        if h != 1:
            raise ValueError("XOR protects against one loss only (h = 1)")
        self.d, self.h = d, 1

    @staticmethod
    def _xor(blocks: Sequence[np.ndarray]) -> np.ndarray:
        out = np.array(blocks[0], dtype=np.uint8, copy=True)
        acc = out.view(np.uint64)
        for b in blocks[1:]:
            np.bitwise_xor(acc, np.asarray(b).view(np.uint64), out=acc)
        return out

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(data) != self.d:
            raise ValueError(f"need {self.d} data blocks, got {len(data)}")
        return [self._xor(data)]

    def decode(self, pieces: Mapping[int, np.ndarray], lost: Sequence[int]) -> dict[int, np.ndarray]:
        have = _check(pieces, lost, self.d, 1)
        if not lost:
            return {}
        if len(lost) != 1:
            raise ValueError("XOR rebuilds one lost block")
        return {lost[0]: self._xor([pieces[i] for i in have[: self.d]])}


class ReedSolomon:
    """zfec's Reed-Solomon code (GF(2^8), systematic, MDS): any d of the d + h blocks rebuild the rest."""

    name = "reed-solomon (zfec)"

    def __init__(self, d: int, h: int) -> None:
        import zfec

        if d < 1 or h < 1 or d + h > 256:
            raise ValueError(f"ec:{d}+{h}: need d >= 1, h >= 1, d + h <= 256")
        self.d, self.h = d, h
        self._enc = zfec.Encoder(d, d + h)
        self._dec = zfec.Decoder(d, d + h)

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(data) != self.d:
            raise ValueError(f"need {self.d} data blocks, got {len(data)}")
        out = self._enc.encode([np.ascontiguousarray(b) for b in data], list(range(self.d, self.d + self.h)))
        return [np.frombuffer(p, dtype=np.uint8) for p in out]

    def decode(self, pieces: Mapping[int, np.ndarray], lost: Sequence[int]) -> dict[int, np.ndarray]:
        have = _check(pieces, lost, self.d, self.h)
        if not lost:
            return {}
        use = have[: self.d]
        got = self._dec.decode([np.ascontiguousarray(pieces[i]) for i in use], use)
        return {i: np.frombuffer(got[i], dtype=np.uint8) if isinstance(got[i], bytes) else np.asarray(got[i])
                for i in lost}


def make_code(d: int, h: int) -> Code:
    """The code phoenixft uses for a d + h group: XOR for one parity block, Reed-Solomon otherwise."""
    return XorCode(d) if h == 1 else ReedSolomon(d, h)
