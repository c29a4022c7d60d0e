"""Exceptions shared by every part of phoenixft."""

from __future__ import annotations

__all__ = ["UserError", "PeerFailure", "RunAborted", "Unhealable", "Drained", "NOT_INSTALLED"]

#: how a worker's failure report starts when it refused to install the persistent checkpoint it was given
#: (here, not in protect/persist.py, so that the coordinator reads it without importing torch)
NOT_INSTALLED = "the persistent checkpoint was not installed"


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


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
