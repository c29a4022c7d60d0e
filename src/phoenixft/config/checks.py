"""The small checks every config section uses: one-line UserErrors naming the flag, the value and what
would be valid, and whether an output file or directory can be written before anything starts."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

from phoenixft.errors import UserError

__all__ = ["need", "real", "check_output_file", "unwritable", "existing", "mib", "checkpoint_bytes",
           "MAX_FAILURE_TIMEOUT_S", "MAX_THREADS", "MAX_WORKERS"]

MAX_FAILURE_TIMEOUT_S = 86400.0  # larger ones overflow the collectives' timeouts (gloo: int milliseconds)
MAX_THREADS = 1024  # --threads: more intra-op threads per worker than any host has cores is a typo
MAX_WORKERS = 1 << 20  # (--nodes + --spares) x --workers-per-node: beyond any job (a --dry-run of it: ~25 s)


def need(cond: bool, flag: str, value: Any, valid: str) -> None:
    """UserError `FLAG=VALUE is invalid: VALID` unless `cond`."""
    if not cond:
        raise UserError(f"{flag}={value!r} is invalid: {valid}")


def real(x: float, ok: bool, flag: str, valid: str) -> None:
    """A float flag: finite (inf and nan make no sense for any of them) and in its range."""
    need(math.isfinite(x) and ok, flag, x, f"must be a finite number {valid}")


def checkpoint_bytes(numel: int) -> int:
    """Estimated size of one persistent checkpoint: param, exp_avg and exp_avg_sq in float32, plus
    DCP metadata (5%)."""
    return int(3 * 4 * numel * 1.05)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def existing(d: str) -> str:
    """`d`, or its nearest ancestor that exists (where `d` would be created)."""
    p = os.path.abspath(d)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def check_output_file(flag: str, path: str) -> None:
    """UserError unless the file `path` ('' = none) can be written once the run is over: not a directory,
    and creatable (its directory, or the nearest existing ancestor it would be created in, writable) or
    an existing writable file. Checked before anything starts, not after the whole run."""
    if not path:
        return
    if os.path.isdir(path):
        raise UserError(f"{flag}={path!r} is invalid: it is a directory; give a file name")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag}={path!r} is invalid: the file exists and is not writable")
        return
    why = unwritable(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        raise UserError(f"{flag}={path!r} is invalid: cannot create a file there ({why})")


def unwritable(d: str) -> str | None:
    """None if a file can be created in directory `d` (or, if it does not exist yet, `d` can be
    created in its nearest existing ancestor), else why not. Creates nothing that stays."""
    base = existing(d)
    if not os.path.isdir(base):
        return f"{base} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".phoenixft-probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None
