"""The reference corpus: the CPython standard library's own `.py` sources, byte level.

Every machine with Python has it offline. Files are read in sorted path order (site-packages
excluded), concatenated, cached once as a flat uint8 file, and memory-mapped by every worker.
The last 5% is the held-out validation split. `sample(...)` is a pure function of
(seed, split, step, index): any rank can produce any microbatch.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig

import numpy as np
import torch

__all__ = ["corpus_path", "ensure_corpus", "Corpus"]

VAL_FRACTION = 0.05


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("PHOENIXFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "phoenixft")
    return pathlib.Path(base)


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.parts))


def corpus_path() -> pathlib.Path:
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return _cache_dir() / f"corpus-stdlib-{tag}.bin"


def ensure_corpus() -> pathlib.Path:
    """Build the cached corpus file if it is missing (atomic: write to a temp file, then rename)."""
    path = corpus_path()
    if path.exists() and path.stat().st_size > 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in _stdlib_files():
            try:
                data = p.read_bytes()
            except OSError:
                continue
            out.write(data)
            h.update(data)
    os.replace(tmp, path)
    return path


class Corpus:
    """Memory-mapped byte corpus with a train / validation split."""

    def __init__(self, path: pathlib.Path | None = None) -> None:
        self.data = np.memmap(path or ensure_corpus(), dtype=np.uint8, mode="r")
        n = len(self.data)
        self.split_at = int(n * (1 - VAL_FRACTION))

    def sample(self, *, seed: int, step: int, index: int, batch: int, block: int, split: str = "train") -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """Microbatch `index` of step `step`: (x, y) int64 tensors of shape (batch, block)."""
        lo, hi = (0, self.split_at) if split == "train" else (self.split_at, len(self.data))
        g = torch.Generator().manual_seed(_mix(seed, step, index, 0 if split == "train" else 1))
        starts = torch.randint(lo, hi - block - 1, (batch,), generator=g).tolist()
        rows = np.stack([np.asarray(self.data[s : s + block + 1]) for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _mix(*xs: int) -> int:
    h = hashlib.blake2b(repr(xs).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)
