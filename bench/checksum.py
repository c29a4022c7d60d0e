"""Checksums for the protection path, measured on this CPU: which one phoenixft uses, and why.

    python bench/checksum.py [--mb 43] [--repeat 20]

Hashes one buffer of the size replicated per step and worker on `small` (43 MB) with each
candidate a maintained library offers, prints GB/s (best of --repeat) and writes
bench/results/checksum.json. phoenixft.protect.snapshot.checksum uses the fastest that detects flipped
bits and torn copies (all of these do).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def candidates() -> dict[str, Callable[[Any], int]]:
    out: dict[str, Callable[[Any], int]] = {"zlib.crc32": zlib.crc32}
    try:
        import crc32c

        out["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        out["crc32c (google-crc32c)"] = lambda mv: google_crc32c.value(bytes(mv))  # copies: the API wants bytes
    except ImportError:
        pass
    import xxhash

    out["xxh3_64 (xxhash)"] = xxhash.xxh3_64_intdigest
    out["xxh64 (xxhash)"] = xxhash.xxh64_intdigest
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=43.0)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    t = torch.randn(int(a.mb * 1e6 / 4))
    mv = memoryview(t.numpy()).cast("B")
    rows = {}
    for name, f in candidates().items():
        f(mv)
        best = min(_timed(f, mv) for _ in range(a.repeat))
        rows[name] = {"seconds": best, "gbps": mv.nbytes / best / 1e9}
        print(f"{name:24s} {best * 1e3:7.2f} ms  {mv.nbytes / best / 1e9:6.1f} GB/s")
    out = Path(__file__).parent / "results" / "checksum.json"
    out.write_text(json.dumps({"bytes": mv.nbytes, "results": rows}, indent=2))


def _timed(f: Callable[[Any], int], mv: Any) -> float:
    t0 = time.perf_counter()
    f(mv)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
