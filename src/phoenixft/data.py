"""Training data: the built-in stdlib corpus and token files (`--data`).

The reference corpus is the CPython standard library's own `.py` sources, byte level. Every
machine with Python has it offline. Files are read in sorted path order (site-packages
excluded), concatenated, cached once as a flat uint8 file, and memory-mapped by every worker.
The last 5% is the held-out validation split. `Corpus.sample(...)` is a pure function of
(seed, split, step, index): any rank can produce any microbatch.

A token file (`--data PATH`) is a flat array of uint16 or uint32 token ids, the format of
nanoGPT's `prepare.py`: either a directory holding `train.bin` and `val.bin`, or one `.bin` file
whose last 5% is held out. Its dtype and vocabulary come from a sidecar JSON (`<file>.json`, or
`meta.json` in the directory: `{"dtype": "uint16", "vocab_size": N}`), else from `--data-dtype`
and max token id + 1 (computed once, memory-mapped, and cached). `TokenData.sample` cuts the
train split into non-overlapping windows of block+1 tokens and visits them in a fresh seeded
permutation every epoch; a sample is a pure function of (seed, step, microbatch).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phoenixft.errors import UserError

__all__ = [
    "corpus_path",
    "ensure_corpus",
    "Corpus",
    "DTYPES",
    "DataSpec",
    "TokenData",
    "resolve_data",
    "check_data",
    "open_data",
]

VAL_FRACTION = 0.05
DTYPES: dict[str, type[np.unsignedinteger[Any]]] = {"uint16": np.uint16, "uint32": np.uint32}


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

    def eval_sample(self, *, seed: int, index: int, batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index` of the validation split: a pure function of (seed, index)."""
        return self.sample(seed=seed, step=0, index=index, batch=batch, block=block, split="val")


# ------------------------------------------------------------------------------------ token files
@dataclass(frozen=True)
class DataSpec:
    """Where the splits of a `--data` token file are, and how to read them."""

    train: pathlib.Path
    val: pathlib.Path | None  # None: one file, the held-out split is its last `val_fraction`
    dtype: str
    vocab_size: int  # from the sidecar, else max token id + 1
    val_fraction: float = VAL_FRACTION
    sidecar: pathlib.Path | None = None

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPES[self.dtype]).itemsize


def _bad(path: str, why: str) -> UserError:
    return UserError(f"--data={path!r} is invalid: {why}")


def _sidecar(p: pathlib.Path) -> pathlib.Path | None:
    """The metadata JSON of a token file or directory, if there is one."""
    if p.is_dir():
        cands = [p / "meta.json"]
    else:
        cands = [p.with_name(p.name + ".json"), p.with_suffix(".json"), p.parent / "meta.json"]
    return next((c for c in cands if c.is_file() and c != p), None)


def _read_sidecar(path: str, sc: pathlib.Path) -> dict[str, Any]:
    try:
        meta = json.loads(sc.read_text())
    except (OSError, ValueError) as e:
        raise _bad(path, f"its metadata {sc} does not read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise _bad(path, f"its metadata {sc} is not a JSON object")
    if "dtype" in meta and meta["dtype"] not in DTYPES:
        raise _bad(path, f"its metadata {sc} has dtype {meta['dtype']!r}; valid: {', '.join(DTYPES)}")
    vs = meta.get("vocab_size")
    if vs is not None and not (isinstance(vs, int) and vs >= 1):
        raise _bad(path, f"its metadata {sc} has vocab_size {vs!r}; expected an integer >= 1")
    vf = meta.get("val_fraction", VAL_FRACTION)
    if not (isinstance(vf, int | float) and 0 < vf < 1):
        raise _bad(path, f"its metadata {sc} has val_fraction {vf!r}; expected 0 < val_fraction < 1")
    return meta


def _check_file(path: str, f: pathlib.Path, dtype: str) -> int:
    """Number of tokens in `f`; raises the one-line error of an empty or misaligned file."""
    size = f.stat().st_size
    item = np.dtype(DTYPES[dtype]).itemsize
    if size == 0:
        raise _bad(path, f"{f.name} is empty (expected a flat array of {dtype} token ids)")
    if size % item:
        raise _bad(path, f"{f.name} has {size} bytes, not a multiple of {item} ({dtype} token ids); "
                         f"is --data-dtype right? (valid: {', '.join(DTYPES)})")
    return size // item


_vocab_memo: dict[tuple[Any, ...], int] = {}


def _vocab_cache_dir() -> pathlib.Path:
    return _cache_dir() / "vocab"


def _max_token(files: list[pathlib.Path], dtype: str) -> int:
    """max token id over `files`, memory-mapped, in chunks (never loaded whole)."""
    m = 0
    for f in files:
        arr = np.memmap(f, dtype=DTYPES[dtype], mode="r")
        step = 1 << 26
        for lo in range(0, len(arr), step):
            m = max(m, int(arr[lo : lo + step].max()))
        del arr
    return m


def _vocab_of(files: list[pathlib.Path], dtype: str) -> int:
    """max token id + 1, computed once per (files, sizes, mtimes) and cached in memory and on disk."""
    key = (dtype, *((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key in _vocab_memo:
        return _vocab_memo[key]
    cache = _vocab_cache_dir() / (hashlib.blake2b(repr(key).encode(), digest_size=12).hexdigest() + ".json")
    try:
        vocab = int(json.loads(cache.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        vocab = _max_token(files, dtype) + 1
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": repr(key), "vocab_size": vocab}))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only cache only costs the recomputation
    _vocab_memo[key] = vocab
    return vocab


def resolve_data(path: str, dtype: str = "uint16") -> DataSpec:
    """Resolve `--data PATH` (a .bin file, or a directory with train.bin and val.bin) and check its files.

    Raises UserError (one line naming --data, the value and what is valid) for a missing path, an
    empty file, a size that is not a multiple of the dtype's item size or a bad sidecar.
    """
    if dtype not in DTYPES:
        raise UserError(f"--data-dtype={dtype!r} is invalid: one of {', '.join(DTYPES)}")
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise _bad(path, "no such file or directory (expected a token file .bin, or a directory holding "
                         "train.bin and val.bin)")
    sc = _sidecar(p)
    meta = _read_sidecar(path, sc) if sc else {}
    dtype = meta.get("dtype", dtype)
    if p.is_dir():
        train, val = p / "train.bin", p / "val.bin"
        for f in (train, val):
            if not f.is_file():
                raise _bad(path, f"the directory has no {f.name} (expected train.bin and val.bin, nanoGPT layout, "
                                 "or a single .bin file)")
        files = [train, val]
    elif p.is_file():
        train, val, files = p, None, [p]
    else:
        raise _bad(path, "not a regular file or directory")
    for f in files:
        _check_file(path, f, dtype)
    vocab = meta.get("vocab_size") or _vocab_of(files, dtype)
    return DataSpec(train=train, val=val, dtype=dtype, vocab_size=int(vocab),
                    val_fraction=float(meta.get("val_fraction", VAL_FRACTION)), sidecar=sc)


def check_data(path: str, dtype: str, block: int | None) -> DataSpec:
    """Launcher-side validation of `--data`: `resolve_data`, and both splits hold one window of block+1 tokens."""
    spec = resolve_data(path, dtype)
    # a sidecar's vocab_size below a token id of the data: the model's embedding is cut to it, and the first
    # batch failed inside the workload ("IndexError: index out of range in self"). One pass over the files,
    # cached as the vocabulary of a file without a sidecar is (the same pass; free when that is the source)
    top = _vocab_of([spec.train, *([spec.val] if spec.val is not None else [])], spec.dtype)
    if top > spec.vocab_size:
        raise _bad(path, f"its metadata {spec.sidecar} says vocab_size {spec.vocab_size}, but the data holds token "
                         f"id {top - 1}: vocab_size must be larger than every token id ({top} or more)")
    if block is not None:
        data = TokenData(spec)
        for name, n in (("train", len(data.train)), ("held-out", len(data.val))):
            if n < block + 1:
                raise _bad(path, f"its {name} split has {n} tokens, shorter than one window of block_size+1 = "
                                 f"{block + 1} tokens")
    return spec


class TokenData:
    """Memory-mapped train / held-out splits of a token file, sampled by a seeded per-epoch permutation."""

    def __init__(self, spec: DataSpec) -> None:
        self.spec = spec
        np_dtype = DTYPES[spec.dtype]
        tr = np.memmap(spec.train, dtype=np_dtype, mode="r")
        if spec.val is None:
            split_at = int(len(tr) * (1 - spec.val_fraction))
            self.train, self.val = tr[:split_at], tr[split_at:]
        else:
            self.train, self.val = tr, np.memmap(spec.val, dtype=np_dtype, mode="r")
        self.vocab_size = spec.vocab_size
        self._perms: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()

    def n_windows(self, block: int, split: str = "train") -> int:
        """Non-overlapping windows of block+1 tokens in a split (the tail that does not fill one is unused)."""
        return len(self.train if split == "train" else self.val) // (block + 1)

    def permutation(self, seed: int, epoch: int, n: int) -> torch.Tensor:
        """The order of the `n` windows in `epoch`: torch.randperm seeded by (seed, epoch); a few cached."""
        key = (seed, epoch, n)
        perm = self._perms.get(key)
        if perm is None:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, epoch)))
            self._perms[key] = perm
            while len(self._perms) > 2:  # the current epoch and the one a microbatch may straddle
                self._perms.popitem(last=False)
        return perm

    def windows(self, *, seed: int, step: int, index: int, batch: int, microbatches: int, block: int) -> list[int]:
        """Window numbers of the rows of microbatch `index` of step `step` (steps count from 1).

        Row j is global sample g = (step-1)*microbatches*batch + index*batch + j; its epoch is
        g // n_windows and its window permutation(seed, epoch)[g % n_windows].
        """
        if step < 1 or not 0 <= index < microbatches:
            raise ValueError(f"no microbatch {index} of step {step} (steps count from 1, {microbatches} per step)")
        n = self.n_windows(block)
        g0 = (step - 1) * microbatches * batch + index * batch
        out = []
        for g in range(g0, g0 + batch):
            out.append(int(self.permutation(seed, g // n, n)[g % n]))
        return out

    def _rows(self, arr: np.ndarray[Any, Any], starts: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(arr[s : s + block + 1]) for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def sample(self, *, seed: int, step: int, index: int, batch: int, microbatches: int, block: int) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """Microbatch `index` of step `step`: (x, y) int64 tensors of shape (batch, block)."""
        ws = self.windows(seed=seed, step=step, index=index, batch=batch, microbatches=microbatches, block=block)
        return self._rows(self.train, [w * (block + 1) for w in ws], block)

    def eval_sample(self, *, seed: int, index: int, batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: consecutive windows of the held-out split (wrapping), a pure function of index.

        (`seed` is accepted for symmetry: the held-out batches are the same for every seed, so runs compare.)
        """
        n = self.n_windows(block, "val")
        if n < 1:
            raise ValueError(f"the held-out split has {len(self.val)} tokens, fewer than one window of {block + 1}")
        return self._rows(self.val, [((index * batch + j) % n) * (block + 1) for j in range(batch)], block)


def open_data(path: str, dtype: str = "uint16") -> TokenData:
    """Open `--data PATH` for sampling (resolving its splits, dtype and vocabulary)."""
    return TokenData(resolve_data(path, dtype))


def _mix(*xs: int) -> int:
    h = hashlib.blake2b(repr(xs).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)
