"""Text files to a token file for `--data`, with the byte-level vocabulary (behind `phoenixft prepare-data`).

Each byte of the input (the files concatenated, in the order given) is one token, stored as
uint16, so the vocabulary is 256 and the bytes round-trip exactly. Two layouts:

- `--out PATH.bin`: one token file plus its sidecar `PATH.bin.json`; the trainer holds out
  the last `val_fraction` of it;
- `--out DIR` (any path not ending in `.bin`): nanoGPT's layout, `DIR/train.bin`,
  `DIR/val.bin` (the last `val_fraction` of the bytes) and `DIR/meta.json`.

The sidecar records `dtype`, `vocab_size`, `tokens`, the source files and the sha256 of the
input bytes. Every file is written to a temporary name and renamed into place (atomic); the
bin files before their metadata. Bad input is a `UserError` (one line, exit 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

import numpy as np

from phoenixft.errors import UserError

__all__ = ["prepare_data", "CHUNK_BYTES", "PROGRESS_MIN_BYTES"]

CHUNK_BYTES = 1 << 22  # 4 MiB read at a time
PROGRESS_MIN_BYTES = 1 << 25  # show progress for inputs of 32 MiB or more


def _inputs(files: list[str]) -> list[tuple[Path, int]]:
    if not files:
        raise UserError("no input: give one or more TEXT_FILES")
    out = []
    for name in files:
        p = Path(name)
        if not p.exists():
            raise UserError(f"input {name!r} does not exist")
        if not p.is_file():
            raise UserError(f"input {name!r} is not a regular file")
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise UserError(f"input {name!r} cannot be read: {e.strerror or e}") from None
        out.append((p, p.stat().st_size))
    if sum(size for _, size in out) == 0:
        raise UserError(f"the input is empty (0 bytes in {len(out)} file(s)): nothing to tokenize")
    return out


def _chunks(inputs: list[tuple[Path, int]]) -> Iterator[bytes]:
    for p, _ in inputs:
        try:
            with open(p, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    yield chunk
        except OSError as e:
            raise UserError(f"input {str(p)!r} cannot be read: {e.strerror or e}") from None


class _Progress:
    """`bytes done / total` on stderr, at most twice a second, for large inputs only."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.show = stream is not None and total >= PROGRESS_MIN_BYTES
        self._last = 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and (now - self._last >= 0.5 or self.done >= self.total):
            self._last = now
            mib = 1 << 20
            assert self.stream is not None
            print(f"prepare-data: {self.done / mib:.1f} / {self.total / mib:.1f} MiB "
                  f"({100 * self.done / max(1, self.total):.0f}%)", file=self.stream, flush=True)


class _AtomicFiles:
    """Temporary files next to their targets, renamed into place by `commit` (or removed)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []

    def open(self, target: Path, out_flag: str) -> IO[bytes]:
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            f = open(tmp, "wb")
        except OSError as e:
            raise UserError(f"--out={out_flag!r} is not writable: {e.strerror or e} ({tmp.parent})") from None
        self.pending.append((tmp, target))
        return f

    def commit(self) -> None:
        for tmp, target in self.pending:
            os.replace(tmp, target)
        self.pending.clear()

    def discard(self) -> None:
        for tmp, _ in self.pending:
            tmp.unlink(missing_ok=True)
        self.pending.clear()


def _meta(inputs: list[tuple[Path, int]], sha: str, **extra: Any) -> bytes:
    meta = {"format": "phoenixft-tokens/1", "tokenizer": "bytes", "dtype": "uint16", "vocab_size": 256, **extra,
            "sources": [str(p.resolve()) for p, _ in inputs], "sha256": sha}
    return (json.dumps(meta, indent=2) + "\n").encode()


def prepare_data(files: list[str], out: str, *, val_fraction: float = 0.05,
                 progress: IO[str] | None = sys.stderr) -> dict[str, Any]:
    """Tokenize `files` (bytes -> uint16 tokens) into `out`; returns the metadata written."""
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction={val_fraction!r} is invalid: must be > 0 and < 1")
    if not out:
        raise UserError("--out='' is invalid: give a PATH.bin (one token file) or a DIR (train.bin, val.bin)")
    inputs = _inputs(files)
    total = sum(size for _, size in inputs)
    single = out.endswith(".bin")
    target = Path(out)
    if single:
        if target.is_dir():
            raise UserError(f"--out={out!r} is invalid: it is a directory (a DIR output must not end in .bin)")
        try:  # (as a DIR output is created: `--out data/notes.bin` on a checkout without data/)
            if not target.parent.exists():
                target.parent.mkdir(parents=True)
        except OSError as e:
            raise UserError(f"--out={out!r} is not writable: {e.strerror or e} ({target.parent})") from None
        bins = [target]
        meta_path = target.with_name(target.name + ".json")
        split_at = total  # one file: the trainer holds out its tail itself
    else:
        if target.exists() and not target.is_dir():
            raise UserError(f"--out={out!r} is invalid: it exists and is not a directory (end a single token "
                            "file's name in .bin)")
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out={out!r} is not writable: {e.strerror or e}") from None
        bins = [target / "train.bin", target / "val.bin"]
        meta_path = target / "meta.json"
        split_at = int(total * (1 - val_fraction))
        if split_at < 1 or split_at >= total:
            raise UserError(f"--val-fraction={val_fraction!r} is invalid for {total} input bytes: "
                            "both train.bin and val.bin need at least one token")

    files_out = _AtomicFiles()
    try:
        with ExitStack() as stack:
            handles = [stack.enter_context(files_out.open(b, out)) for b in bins]
            sha = hashlib.sha256()
            bar = _Progress(total, progress)
            written = [0] * len(bins)
            pos = 0
            for chunk in _chunks(inputs):
                sha.update(chunk)
                cut = min(max(split_at - pos, 0), len(chunk))
                for i, part in ((0, chunk[:cut]), (len(bins) - 1, chunk[cut:])):
                    if part:
                        np.frombuffer(part, dtype=np.uint8).astype(np.uint16).tofile(handles[i])
                        written[i] += len(part)
                pos += len(chunk)
                bar.add(len(chunk))
            for h in handles:
                h.flush()
                os.fsync(h.fileno())
        if pos == 0 or (not single and 0 in written):
            raise UserError(f"the input is empty or too small to split ({pos} bytes in {len(inputs)} file(s))")
        extra: dict[str, Any] = {"tokens": pos, "val_fraction": val_fraction}
        if not single:
            extra.update(train_tokens=written[0], val_tokens=written[1])
        meta = _meta(inputs, sha.hexdigest(), **extra)
        with files_out.open(meta_path, out) as m:
            m.write(meta)
        files_out.commit()  # the bins first, then their metadata
    except OSError as e:
        raise UserError(f"--out={out!r} could not be written: {e.strerror or e}") from None
    finally:
        files_out.discard()
    return json.loads(meta)
