"""`phoenixft prepare-data TEXT_FILES... --out PATH`: text to a byte-level token file for `--data`.

`--out PATH.bin` writes one token file and its sidecar `PATH.bin.json`; any other `--out` is a
directory in nanoGPT's layout (train.bin, val.bin, meta.json). The work is done by
`phoenixft.train.prepare_data.prepare_data`.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "prepare"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="turn text files into a token file for `phoenixft run --data` (byte level, uint16)",
        description="Concatenate TEXT_FILES and write every byte as one uint16 token (vocabulary 256), "
        "with a sidecar JSON (dtype, vocab_size, tokens, sources, sha256). --out PATH.bin: one token "
        "file, whose last 5 percent `run --data` holds out; --out DIR: nanoGPT's layout, DIR/train.bin, "
        "DIR/val.bin (the last --val-fraction of the bytes) and DIR/meta.json. Writes are atomic.",
    )
    p.add_argument("files", nargs="+", metavar="TEXT_FILES", help="input text files, concatenated in this order")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="PATH.bin (one token file + PATH.bin.json) or a DIR (train.bin, val.bin, meta.json)")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="held-out fraction: the tail of the bytes (0.05)")
    p.set_defaults(func=prepare)


def prepare(args: argparse.Namespace) -> int:
    from phoenixft.train.prepare_data import prepare_data

    meta = prepare_data(args.files, args.out, val_fraction=args.val_fraction, progress=sys.stderr)
    split = (f" (train {meta['train_tokens']}, val {meta['val_tokens']})" if "train_tokens" in meta
             else f" (the last {meta['val_fraction']:g} held out)")
    print(f"{args.out}: {meta['tokens']} tokens{split}, dtype {meta['dtype']}, vocab {meta['vocab_size']}, "
          f"sha256 {meta['sha256'][:12]}")
    return 0
