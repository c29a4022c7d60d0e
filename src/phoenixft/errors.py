"""Exceptions shared by every part of phoenixft, and the traceback of an error in the user's own code."""

from __future__ import annotations

import os
import sysconfig
import traceback

__all__ = ["UserError", "PeerFailure", "RunAborted", "Unhealable", "Drained", "NOT_INSTALLED", "user_traceback"]

_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep  # phoenixft's own frames
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})

#: how a worker's failure report starts when it refused to install the persistent checkpoint it was given
#: (here, not in protect/persist.py, so that the coordinator reads it without importing torch)
NOT_INSTALLED = "the persistent checkpoint was not installed"


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback of phoenixft's own. `detail`: what
    is printed above that line (the traceback of the user's own code that failed, `user_traceback`)."""

    def __init__(self, message: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class PeerFailure(Exception):
    """A collective, a replication transfer or the control plane reported that a peer is gone.

    Raised inside a training step; the worker answers it by entering the recovery protocol.
    """


class RunAborted(Exception):
    """The control plane ended the run (finished elsewhere, failed, or this process was fenced)."""


class Unhealable(Exception):
    """NaN/Inf loss or an exception in user code: not a node failure; stop cleanly, say why."""


class Drained(RunAborted):
    """This node was drained (a planned departure): a spare took its role and nothing was lost; its
    processes leave cleanly (exit code 0)."""


def _users(filename: str) -> bool:
    """A frame of the user's own code: not phoenixft's, not the standard library's, not an installed package's."""
    path = os.path.abspath(filename)
    return not (filename.startswith("<") or path.startswith(_OWN) or path.startswith(_STDLIB)
                or f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path)


def user_traceback(exc: BaseException) -> tuple[str, str]:
    """(where, traceback) of `exc`, raised in code phoenixft called (a workload's factory, model, loss, batch,
    split, optimizer): `where` is `FILE:LINE in FUNCTION` of the innermost frame of the user's own code
    (else of the innermost frame), `traceback` the traceback from the user's first frame on (the frames of
    phoenixft that called it left out, named in one line), then the exception."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [i for i, f in enumerate(frames) if _users(f.filename)]
    first = mine[0] if mine else next((i for i, f in enumerate(frames) if not f.filename.startswith(_OWN)), 0)
    inner = frames[mine[-1]] if mine else (frames[-1] if frames else None)
    where = f"{inner.filename}:{inner.lineno} in {inner.name}" if inner is not None else "(no frame)"
    callers = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[:first])
                          if f.filename.startswith(_OWN))
    head = "Traceback of the error in your code (most recent call last)" + (
        f"; called from phoenixft at {callers}" if callers else "") + ":\n"
    text = head + "".join(traceback.format_list(frames[first:])) + "".join(traceback.format_exception_only(exc))
    return where, text.rstrip("\n")
