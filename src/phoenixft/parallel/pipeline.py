"""The 1F1B pipeline schedule of one step, over a data-parallel rank's microbatches.

Stage p of P runs `P - p - 1` warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards (PipeDream-flush / Megatron's 1F1B): at most P microbatches'
activations are alive on a stage. With P = 1 it is the plain loop forward, backward per microbatch.

Activations go forward and their gradients backward over the epoch's pipeline edges: one 2-rank
process group per direction and stage boundary, where a transfer is a broadcast from the sender
(gloo's point-to-point works cannot be polled for completion; a broadcast can, so every transfer
stays abortable). Each edge carries one direction in microbatch order, so sender and receiver
always issue its transfers in the same order. Sends are asynchronous and waited at the end.
Receives are waited with `device_wait`: on NCCL stream-ordered (distributed/streams.py: the received tensor
is read only by kernels), on gloo the polled wait. On CUDA the last stage's loss is read on the host
only after the polled wait saw the stream's work complete (a `StreamMark`), so that a collective
stuck on a dead peer ahead of it is noticed as in any other wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.distributed.streams import StreamMark
from phoenixft.parallel.stage import Stage

__all__ = ["Pipeline"]

Wait = Callable[[Any, str], None]


def _bcast(pg: Any, t: torch.Tensor, root: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return pg.broadcast([t], opts)


class Pipeline:
    """One stage's view of the pipeline: its edges of this epoch and how it waits."""

    def __init__(self, stage: Stage, pp: int, pp_size: int, edges: dict[tuple[str, int], Any], wait: Wait,
                 dtype: torch.dtype, device: torch.device | None = None, device_wait: Wait | None = None) -> None:
        self.stage, self.p, self.P, self.edges, self.wait, self.dtype = stage, pp, pp_size, edges, wait, dtype
        self.device = device or torch.device("cpu")  # where activations are received (the stage's device)
        self.device_wait = device_wait or wait  # for the receives (see the module docstring)
        self._sends: list[tuple[Any, torch.Tensor]] = []

    # ------------------------------------------------------------------ transfers
    def _recv_act(self, batch: Any, j: int) -> torch.Tensor:
        buf = torch.empty(self.stage.act_shape(batch), dtype=self.dtype, device=self.device)
        what = f"activation of microbatch {j} from stage {self.p - 1}"
        self.device_wait(_bcast(self.edges[("fwd", self.p - 1)], buf, 0), what)
        return buf.requires_grad_()

    def _send(self, way: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        edge, root = (self.p, 0) if way == "fwd" else (self.p - 1, 1)
        self._sends.append((_bcast(self.edges[(way, edge)], t, root), t))

    def _recv_grad(self, like: torch.Tensor, j: int) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self.device_wait(_bcast(self.edges[("bwd", self.p)], buf, 1),
                         f"gradient of microbatch {j} from stage {self.p + 1}")
        return buf

    def _loss(self, out: torch.Tensor, j: int) -> float:
        """The host's value of a microbatch's loss (CUDA: once the polled wait saw the stream reach it)."""
        if self.device.type == "cuda":
            self.wait(StreamMark(self.device), f"loss of microbatch {j}")
        return float(out.detach().float())

    def flush(self) -> None:
        for w, _t in self._sends:
            self.wait(w, "pipeline send")
        self._sends = []

    # ------------------------------------------------------------------ schedules
    def train(self, n: int, batch: Callable[[int], Any],
              forward: Callable[[int, Any, torch.Tensor | None], torch.Tensor],
              backward: Callable[[int, torch.Tensor, torch.Tensor | None], None],
              before: Callable[[str, int], None] | None = None) -> float:
        """Forward and backward of microbatches 0..n-1; returns the sum of their losses (last stage).

        `before(phase, j)` runs as a microbatch's forward or backward begins, before it waits for its input
        from the neighbouring stage: a fault hook there never waits on another stage (a fault striking nodes
        of two stages at once holds the first to arrive until the others are there: inside the wait, the
        later stage would never get its input, and the nodes died apart, one recovery each)."""
        st = self.stage
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = 0.0

        def f(j: int) -> None:
            nonlocal loss_sum
            if before is not None:
                before("forward", j)
            b = batch(j)
            inp = None if st.first else self._recv_act(b, j)
            out = forward(j, b, inp)
            if st.last:
                loss_sum += self._loss(out, j)
            else:
                self._send("fwd", out)
            saved[j] = (inp, out)

        def b(j: int) -> None:
            if before is not None:
                before("backward", j)
            inp, out = saved.pop(j)
            backward(j, out, None if st.last else self._recv_grad(out, j))
            if not st.first:
                assert inp is not None and inp.grad is not None
                self._send("bwd", inp.grad)

        warm = min(self.P - self.p - 1, n)
        for j in range(warm):
            f(j)
        for j in range(warm, n):
            f(j)
            b(j - warm)
        for j in range(n - warm, n):
            b(j)
        self.flush()
        return loss_sum

    def forward_only(self, n: int, batch: Callable[[int], Any],
                     check: Callable[[Any], None] = lambda _out: None) -> float:
        """Forward of microbatches 0..n-1 without gradients (evaluation); the sum of their losses
        (`check` sees each loss first, on the last stage)."""
        st = self.stage
        total = 0.0
        with torch.no_grad():
            for j in range(n):
                bt = batch(j)
                inp = None if st.first else self._recv_act(bt, j).detach()
                out = st.forward(inp, bt)
                if st.last:
                    check(out)
                    total += self._loss(out, j)
                else:
                    self._send("fwd", out)
        self.flush()
        return total
