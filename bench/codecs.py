"""Erasure codes for `--redundancy ec:D+H`, measured on this CPU: which one phoenixft uses, and why.

    python bench/codecs.py [--mb 8] [--repeat 5] [--out bench/results/codecs.json]

Each candidate encodes D blocks of float32 training state (random normal values, as bytes) of
--mb MB each into H parity blocks, then rebuilds H lost data blocks from the D survivors; every
decode is checked bit for bit. Encode GB/s = data bytes in (D x block) / seconds; decode GB/s =
the same data bytes / seconds to rebuild the H lost blocks. Best of --repeat, one process, the
same buffers for every candidate, so the ratios are comparable. Candidates that are not
installed are listed as such; the pure-Python ones (reedsolo, galois) are timed on a smaller
block (--small-mb) and say so. Writes bench/results/codecs.json.

Also measured, because phoenixft encodes on a background thread while the training loop runs:
`main_thread` = how fast a pure-Python loop on the main thread runs while the encode runs on a
second thread, relative to the same loop alone (1.0: the codec releases the GIL and another core
is free; near 0: it holds the GIL for the whole encode, stalling the training loop).

Candidates: XOR in torch and numpy (H = 1 only); zfec (Rizzo's Vandermonde RS, GF(2^8));
pyeclib (liberasurecode) with ISA-L's RS (Vandermonde and Cauchy) and liberasurecode's own RS;
reed-solomon-leopard (Python binding of the Rust crate reed-solomon-simd: Leopard-RS in
GF(2^16), SIMD); galois (numpy + numba GF(2^8) matrix product); reedsolo (pure Python).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

Blocks = list[np.ndarray]
Codec = tuple[Callable[[Blocks], list[Any]], Callable[[dict[int, Any], list[int]], dict[int, Any]]]


def _xor_torch(d: int, h: int) -> Codec | str:
    if h != 1:
        return "XOR is a single-parity code (H = 1 only)"

    def enc(blocks: Blocks) -> list[Any]:
        ts = [torch.from_numpy(b).view(torch.int64) for b in blocks]
        p = ts[0].clone()
        for t in ts[1:]:
            p.bitwise_xor_(t)
        return [p]

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        ts = [torch.from_numpy(np.asarray(v)).view(torch.int64) if isinstance(v, np.ndarray) else v
              for v in avail.values()]
        p = ts[0].clone()
        for t in ts[1:]:
            p.bitwise_xor_(t)
        return {lost[0]: p}

    return enc, dec


def _xor_numpy(d: int, h: int) -> Codec | str:
    if h != 1:
        return "XOR is a single-parity code (H = 1 only)"

    def enc(blocks: Blocks) -> list[Any]:
        vs = [b.view(np.uint64) for b in blocks]
        p = vs[0].copy()
        for v in vs[1:]:
            np.bitwise_xor(p, v, out=p)
        return [p]

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        vs = [np.asarray(v).view(np.uint64) for v in avail.values()]
        p = vs[0].copy()
        for v in vs[1:]:
            np.bitwise_xor(p, v, out=p)
        return {lost[0]: p}

    return enc, dec


def _zfec(d: int, h: int) -> Codec | str:
    try:
        import zfec
    except ImportError:
        return "not installed (pip install zfec)"
    e, dc = zfec.Encoder(d, d + h), zfec.Decoder(d, d + h)

    def enc(blocks: Blocks) -> list[Any]:
        return list(e.encode(blocks, list(range(d, d + h))))

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        nums = sorted(avail)[:d]
        out = dc.decode([avail[i] for i in nums], nums)
        return {i: out[i] for i in lost}

    return enc, dec


_CONTIG: dict[int, np.ndarray] = {}


def contiguous(blocks: Blocks) -> np.ndarray:
    """The d blocks as one buffer, made once per set of blocks (outside the timed region)."""
    key = id(blocks[0])
    if key not in _CONTIG:
        _CONTIG.clear()
        _CONTIG[key] = np.concatenate(blocks)
    return _CONTIG[key]


def _pyeclib(ec_type: str) -> Callable[[int, int], Codec | str]:
    def make(d: int, h: int) -> Codec | str:
        try:
            from pyeclib.ec_iface import ECDriver
        except ImportError:
            return "not installed (pip install pyeclib)"
        try:
            drv = ECDriver(k=d, m=h, ec_type=ec_type)
        except Exception as e:  # noqa: BLE001 - backend missing in this build
            return f"{ec_type} unavailable: {e}"
        frags: dict[str, Any] = {}

        def enc(blocks: Blocks) -> list[Any]:
            # its API takes one buffer and cuts it into d fragments (each with an 80-byte header); the
            # d stripes arrive contiguous in one receive buffer in phoenixft's exchange, so the
            # concatenation is not timed (see `contiguous` below)
            out = drv.encode(contiguous(blocks))
            frags["all"] = out
            return out[d:]

        def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
            allf = frags["all"]
            keep = [allf[i] for i in sorted(avail)[:d]]
            got = drv.reconstruct(keep, lost)
            return dict(zip(lost, got, strict=True))

        return enc, dec

    return make


def _leopard(d: int, h: int) -> Codec | str:
    try:
        import reed_solomon_leopard as rsl
    except ImportError:
        return "not installed (pip install reed-solomon-leopard)"

    def enc(blocks: Blocks) -> list[Any]:
        return list(rsl.encode([b.tobytes() for b in blocks], h))  # its API takes bytes: one copy each

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        orig = {i: (v.tobytes() if isinstance(v, np.ndarray) else v) for i, v in avail.items() if i < d}
        rec = {i - d: v for i, v in avail.items() if i >= d}
        out = rsl.decode(d, h, orig, rec)
        return {i: out[i] for i in lost}

    return enc, dec


def _galois(d: int, h: int) -> Codec | str:
    try:
        import galois
    except ImportError:
        return "not installed (pip install galois)"
    gf = galois.GF(2**8)
    # systematic Cauchy matrix: any D rows of [I; C] are invertible (MDS)
    xs, ys = np.arange(d, dtype=np.int64), np.arange(d, d + h, dtype=np.int64)
    c = gf(1) / (gf(ys[:, None]) + gf(xs[None, :]))
    g = np.concatenate([gf.Identity(d), c])

    def enc(blocks: Blocks) -> list[Any]:
        return list(c @ gf(np.stack(blocks)))

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        rows = sorted(avail)[:d]
        a = np.linalg.inv(g[rows])
        data = a @ gf(np.stack([np.asarray(avail[i]) for i in rows]))
        return {i: data[i] for i in lost}

    return enc, dec


def _reedsolo(d: int, h: int) -> Codec | str:
    try:
        import reedsolo
    except ImportError:
        return "not installed (pip install reedsolo)"
    rs = reedsolo.RSCodec(h)

    # a codeword per byte position: d data symbols + h parity symbols (its API is per message)
    def enc(blocks: Blocks) -> list[Any]:
        cols = np.stack(blocks).T
        par = np.empty((cols.shape[0], h), dtype=np.uint8)
        for k, col in enumerate(cols):
            par[k] = np.frombuffer(bytes(rs.encode(col.tobytes()))[d:], dtype=np.uint8)
        return list(par.T.copy())

    def dec(avail: dict[int, Any], lost: list[int]) -> dict[int, Any]:
        n = len(next(iter(avail.values())))
        out = {i: np.empty(n, dtype=np.uint8) for i in lost}
        for k in range(n):
            msg = bytearray(d + h)
            for i, v in avail.items():
                msg[i] = int(np.asarray(v)[k])
            dec_msg = rs.decode(msg, erase_pos=lost)[0]
            for i in lost:
                out[i][k] = dec_msg[i]
        return out

    return enc, dec


CANDIDATES: dict[str, tuple[Callable[[int, int], Codec | str], bool]] = {
    # name: (factory, slow: timed on --small-mb)
    "xor (torch int64)": (_xor_torch, False),
    "xor (numpy uint64)": (_xor_numpy, False),
    "zfec": (_zfec, False),
    "pyeclib isa_l_rs_vand": (_pyeclib("isa_l_rs_vand"), False),
    "pyeclib isa_l_rs_cauchy": (_pyeclib("isa_l_rs_cauchy"), False),
    "pyeclib liberasurecode_rs_vand": (_pyeclib("liberasurecode_rs_vand"), False),
    "reed-solomon-leopard (reed-solomon-simd)": (_leopard, False),
    "galois (GF(2^8) matmul)": (_galois, True),
    "reedsolo (pure Python)": (_reedsolo, True),
}


def _as_bytes(x: Any) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.numpy().tobytes()
    if isinstance(x, np.ndarray):
        return x.tobytes()
    return bytes(x)


def measure(name: str, d: int, h: int, block_bytes: int, repeat: int) -> dict[str, Any]:
    factory, _slow = CANDIDATES[name]
    codec = factory(d, h)
    if isinstance(codec, str):
        return {"skipped": codec}
    enc, dec = codec
    rng = np.random.default_rng(7)
    blocks = [rng.standard_normal(block_bytes // 4, dtype=np.float32).view(np.uint8) for _ in range(d)]
    parity = enc(blocks)
    lost = list(range(h))  # the worst case for a systematic code: H data blocks lost
    avail: dict[int, Any] = {i: blocks[i] for i in range(h, d)}
    avail.update({d + j: parity[j] for j in range(h)})
    got = dec(avail, lost)
    skip = 80 if name.startswith("pyeclib") else 0  # liberasurecode's fragment header
    exact = all(_as_bytes(got[i])[skip : skip + block_bytes] == blocks[i].tobytes() for i in lost)
    t_enc = min(_timed(lambda: enc(blocks)) for _ in range(repeat))
    t_dec = min(_timed(lambda: dec(avail, lost)) for _ in range(repeat))
    data = d * block_bytes
    share = gil_share(lambda: enc(blocks)) if not CANDIDATES[name][1] else None
    return {"encode_s": t_enc, "decode_s": t_dec, "encode_gbps": data / t_enc / 1e9,
            "decode_gbps": data / t_dec / 1e9, "bit_exact": exact, "block_bytes": block_bytes,
            "main_thread": share}


def gil_share(f: Callable[[], Any], seconds: float = 0.6) -> float:
    """Main-thread loop rate while `f` runs repeatedly on another thread, relative to the rate alone."""
    import threading

    def spin(until: float) -> int:
        n = 0
        while time.perf_counter() < until:
            n += 1
        return n

    alone = spin(time.perf_counter() + 0.3) / 0.3
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            f()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    time.sleep(0.05)
    n = spin(time.perf_counter() + seconds)
    stop.set()
    t.join()
    return (n / seconds) / alone


def _timed(f: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="block size in MB (one shard's protected payload)")
    ap.add_argument("--small-mb", type=float, default=0.25, help="block size for the pure-Python candidates")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--codes", default="4+1,4+2,8+2", help="D+H pairs, comma-separated")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "codecs.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    import os

    load0 = os.getloadavg()[0]
    print(f"load average at start {load0:.1f} (on a shared machine the absolute numbers move with it)")
    results: dict[str, Any] = {}
    for code in a.codes.split(","):
        d, h = (int(x) for x in code.split("+"))
        print(f"ec:{d}+{h}: {d} blocks of {a.mb:g} MB, rebuild {h} lost")
        rows: dict[str, Any] = {}
        for name, (_f, slow) in CANDIDATES.items():
            mb = a.small_mb if slow else a.mb
            size = int(mb * 1e6) // 64 * 64
            r = measure(name, d, h, size, 1 if slow else a.repeat)
            rows[name] = r
            if "skipped" in r:
                print(f"  {name:42s} -- {r['skipped']}")
            else:
                note = f"  ({mb:g} MB blocks)" if slow else ""
                mt = "   -" if r["main_thread"] is None else f"{r['main_thread']:4.2f}"
                print(f"  {name:42s} encode {r['encode_gbps']:7.3f} GB/s  decode {r['decode_gbps']:7.3f} GB/s"
                      f"  main thread {mt}  exact={r['bit_exact']}{note}")
        base = rows.get("zfec", {})
        for r in rows.values():
            if "encode_gbps" in r and "encode_gbps" in base:
                r["encode_vs_zfec"] = r["encode_gbps"] / base["encode_gbps"]
                r["decode_vs_zfec"] = r["decode_gbps"] / base["decode_gbps"]
        results[f"{d}+{h}"] = rows
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for pkg in ("zfec", "pyeclib", "reed-solomon-leopard", "galois", "reedsolo", "numpy", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    out = {"block_mb": a.mb, "threads": 1, "versions": versions, "load_avg_start": load0,
           "load_avg_end": os.getloadavg()[0], "cpus": os.cpu_count(), "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
