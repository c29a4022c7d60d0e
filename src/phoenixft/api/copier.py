"""The copy thread of a script's snapshots: the parameters and optimizer state copied while the next step computes.

A step's snapshot packs its small values at once; the large tensors that only an optimizer's `step()` changes
(every model's parameters, every optimizer's state) are copied here, on a thread of their own (torch's copies
release the GIL), while the next step's forward and backward run. The copy's completion commits the half
(`then`), so the half is never a recovery point before every byte of it is in; `wait()` is called before
anything that would change those tensors or read the half: the next update, the next snapshot, a recovery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["Copier", "COPY_TIMEOUT_S"]

COPY_TIMEOUT_S = 600.0  # a host memory copy of a step's state: far below this, unless the machine is stuck


class Copier:
    """One copy in flight at most."""

    def __init__(self) -> None:
        self._job: tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]] | None = None
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._t: threading.Thread | None = None
        self._busy = False

    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor], then: Callable[[], None]) -> None:
        """Copy src[i] into dst[i], then call `then()` (on the copy thread); a copy in flight completes first."""
        self.wait()
        with self._cv:
            if self._t is None:
                self._t = threading.Thread(target=self._run, name="phoenixft-snapshot-copy", daemon=True)
                self._t.start()
            self._job, self._busy = (dst, src, then), True
            self._cv.notify_all()

    def wait(self) -> None:
        """Until the copy in flight (if any) completed; its error, if it failed, is raised here."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._busy, timeout=COPY_TIMEOUT_S):
                raise RuntimeError(f"phoenixft: a snapshot copy did not complete in {COPY_TIMEOUT_S:.0f}s")
            err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"phoenixft: a snapshot copy failed: {type(err).__name__}: {err}") from err

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None)
                job, self._job = self._job, None
            assert job is not None
            dst, src, then = job
            try:
                torch._foreach_copy_(dst, src)
                then()
            except BaseException as e:  # noqa: BLE001 - raised to the training thread at its next wait
                with self._cv:
                    self._error = e
            with self._cv:
                self._busy = False
                self._cv.notify_all()
