"""One rank's model, shard and training step: what a step computes, apart from how it is protected.

`Trainer` owns the workload's model as a `FlatModel` (parameters and buffers in flat ping-pong
buffers), the rank's optimizer shard (`ShardState`: fp32 master weights + optimizer state in
host shared memory), the elementwise shard optimizer and the learning-rate schedule. A step:

1. forward/backward of this rank's microbatches (bf16: accumulated into fp32 gradients);
2. `before_reduce()` - the protection layer waits for the previous step's replication here;
3. gradient sum and loss sum across data-parallel ranks; a non-finite loss stops the run;
4. optional clipping by the global norm (over every shard: each rank's slice of the summed
   gradient, squared norms summed across ranks);
5. the optimizer reads the committed half of the shard and writes the staging half;
6. model buffers broadcast from data-parallel rank 0 (as DistributedDataParallel does), then
   the updated master slices are all-gathered (cast to the parameter dtype) into the other flat
   buffer, and only then the shard and the flat buffers commit the step.

`final_state()` gathers every shard's rows in logical order and returns the sha256 over the full,
unsharded state (master weights, optimizer state, buffers), independent of the layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.buckets import GradBuckets
from phoenixft.config import RunConfig
from phoenixft.data import _mix
from phoenixft.errors import PeerFailure, Unhealable
from phoenixft.optim import ElementwiseOptimizer, lr_at, make_optimizer
from phoenixft.snapshot import INVALID, ShardState
from phoenixft.workload import Workload
from phoenixft.zero import DTYPES, FlatModel

__all__ = ["Trainer", "StepResult"]

Wait = Callable[[Any, str], None]


@dataclass
class StepResult:
    loss: float
    lr: float
    grad_norm: float | None
    compute_s: float
    repl_wait_s: float
    val_loss: float | None = None


class Trainer:
    def __init__(self, cfg: RunConfig, wl: Workload, model: torch.nn.Module) -> None:
        self.cfg, self.wl, self.model = cfg, wl, model
        self.dtype = DTYPES[cfg.precision]
        self.opt: ElementwiseOptimizer = make_optimizer(
            cfg.optimizer, weight_decay=cfg.weight_decay, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
            momentum=cfg.momentum, nesterov=cfg.nesterov, custom=wl.optimizer)
        self.rows = 1 + len(self.opt.state_names)
        self.payload_from = 0 if self.dtype != torch.float32 else 1
        self.flat: FlatModel
        self.state: ShardState
        self.interrupt: Callable[[], None] = lambda: None  # raises PeerFailure when a recovery started
        self.buckets: GradBuckets
        self._hooked = False

    def watch(self, interrupt: Callable[[], None]) -> None:
        """Leave the step within one layer when a recovery starts: `interrupt` is called between
        microbatches, before every module's forward and after every parameter's gradient."""
        self.interrupt = interrupt
        for mod in self.model.modules():
            mod.register_forward_pre_hook(lambda _m, _i: interrupt())

    def _grad_ready(self, p: torch.Tensor) -> None:
        self.interrupt()
        self.buckets.on_grad(p)

    @property
    def payload_rows(self) -> int:
        return self.rows - self.payload_from

    def partition(self, world: int, shm: str | None, step: int = 0) -> None:
        """Flat parameters and the own optimizer shard for a `world`-way partition."""
        self.flat = FlatModel(self.model, shards=world, path=shm and shm + "-params", step=step, dtype=self.dtype)
        self.buckets = GradBuckets(self.flat, self.cfg.bucket_mb)
        if not self._hooked:  # the hooks stay on the parameters; they find the current buckets
            for p in self.flat.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            self._hooked = True
        self.state = ShardState(self.flat.shard_numel, shm and shm + "-state", rows=self.rows,
                                payload_from=self.payload_from)

    def init_shard(self, rank: int, world: int) -> None:
        """Epoch 0: the shard's master weights as the model was built, optimizer state zero."""
        master = torch.zeros(self.flat.padded)
        master[: self.flat.numel] = self.flat.init_master
        self.state.data[0, 0].copy_(master[self.flat.shard_slice(rank)])
        self.state.data[0, 1:].zero_()
        self.state.commit(0, 0, 0, (rank, world))
        self.state.begin_write(1)

    def lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(step, schedule=c.lr_schedule, lr=c.lr, min_lr=c.min_lr, warmup=c.warmup_steps,
                     decay=c.decay_steps, total=c.steps)

    # ------------------------------------------------------------------ the step
    def step(self, s: int, pg: Any, rank: int, world: int, microbatches: tuple[int, int], wait: Wait,
             before_reduce: Callable[[], float], fault: Callable[[str], None], nan: bool = False) -> StepResult:
        cfg, flat = self.cfg, self.flat
        t0 = time.perf_counter()
        flat.zero_grad()
        m_total = cfg.total_microbatches
        lo, hi = microbatches
        loss_sum = 0.0
        grad = flat.grad32
        works: list[Any] = []
        waited = [0.0]

        def launch(b: int) -> None:  # a bucket's gradients are complete on the last microbatch
            if not works:
                waited[0] = before_reduce()  # replication of the previous step committed before any reduction
            blo, bhi = self.buckets.ranges[b]
            works.append(pg.allreduce([grad[blo:bhi]]))

        for j, mb in enumerate(range(lo, hi)):
            self.interrupt()
            self.buckets.begin_microbatch(last=mb == hi - 1, launch=launch)
            torch.manual_seed(_mix(cfg.seed, s, mb))
            if j == 0:
                fault("forward")
            with self._user_code(s, rank):
                loss = self.wl.loss(self.model, self.wl.batch(s, mb))
            if j == 0:
                fault("backward")
            with self._user_code(s, rank):
                (loss / m_total).backward()
            self.buckets.end_microbatch()
            loss_sum += float(loss.detach().float())
        if nan:
            loss_sum = math.nan
        t_compute = time.perf_counter() - t0
        if lo == hi:  # no microbatch on this rank (an uneven split): it still takes part in every reduction
            self.buckets.begin_microbatch(last=True, launch=launch)
            self.buckets.end_microbatch()
        lt = torch.tensor([loss_sum], dtype=torch.float64)
        w_loss = pg.allreduce([lt])
        for w in works:
            wait(w, f"gradient reduction of step {s}")
        wait(w_loss, f"loss all-reduce of step {s}")
        if not math.isfinite(float(lt)):
            raise Unhealable(f"the loss of step {s} is {float(lt) / m_total} (numerical error in the training itself)")
        gshard = grad[flat.shard_slice(rank)]
        norm = None
        if cfg.clip_grad_norm > 0:
            sq = torch.tensor([float(gshard.double().square().sum())], dtype=torch.float64)
            wait(pg.allreduce([sq]), f"gradient norm of step {s}")
            norm = math.sqrt(float(sq))
            coef = cfg.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                gshard = gshard * coef
        src = self.state.half_with(s - 1)
        if src is None:
            raise RuntimeError(f"no committed optimizer state for step {s - 1}")
        dst = 1 - src
        lr = self.lr(s)
        self.state.begin_write(dst)
        rows_in, rows_out = self.state.data[src], self.state.data[dst]
        self.opt.update(rows_in[0], list(rows_in[1:]), gshard, s, lr, rows_out[0], list(rows_out[1:]),
                        hook=lambda: fault("optimizer"))
        if flat.buffers:
            raw = flat.buffer_bytes_now()
            opts = dist.BroadcastOptions()
            opts.rootRank = 0  # data-parallel rank 0's buffers, as DistributedDataParallel broadcasts them
            wait(pg.broadcast([raw], opts), f"buffer broadcast of step {s}")
            flat.set_buffers(raw)
        master = rows_out[0] if self.dtype == torch.float32 else rows_out[0].to(self.dtype)
        wait(pg._allgather_base(flat.begin_gather(), master), f"all-gather of step {s}")
        self.state.commit(dst, s, 0, (rank, world))
        flat.flip(s)
        val = self.evaluate(s, pg, rank, world, wait) if cfg.eval_every and s % cfg.eval_every == 0 else None
        return StepResult(loss=float(lt) / m_total, lr=lr, grad_norm=norm, compute_s=t_compute, repl_wait_s=waited[0],
                          val_loss=val)

    @staticmethod
    @contextlib.contextmanager
    def _user_code(s: int, rank: int) -> Iterator[None]:
        """Workload code runs here: a failure of ours passes through, a bug in user code is not ours to heal."""
        try:
            yield
        except PeerFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise Unhealable(f"exception in the workload at step {s} on rank {rank}: {type(e).__name__}: {e}") from e

    def evaluate(self, s: int, pg: Any, rank: int, world: int, wait: Wait) -> float | None:
        """Mean loss over `--eval-batches` held-out microbatches, spread over the ranks."""
        if self.wl.eval_batch is None:
            return None
        n = self.cfg.eval_batches
        total = torch.tensor([0.0], dtype=torch.float64)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for i in range(rank, n, world):
                    torch.manual_seed(_mix(self.cfg.seed, -1, i))
                    total += float(self.wl.loss(self.model, self.wl.eval_batch(i)).float())
        finally:
            self.model.train(was_training)
        wait(pg.allreduce([total]), f"evaluation after step {s}")
        return float(total) / n

    # ------------------------------------------------------------------ the end
    def final_state(self, pg: Any, step: int, wait: Wait) -> tuple[str, torch.Tensor]:
        """sha256 over the full state in logical order (every row of every shard, then the buffers),
        and the full master weights. Every rank must call it."""
        half = self.state.half_with(step)
        assert half is not None
        flat = self.flat
        rows = torch.empty(self.rows, flat.padded)
        works = [pg._allgather_base(rows[i], self.state.data[half, i].contiguous()) for i in range(self.rows)]
        for w in works:
            wait(w, "final gather")
        n = flat.numel
        h = hashlib.sha256()
        for i in range(self.rows):
            h.update(rows[i, :n].numpy().tobytes())
        h.update(flat.buffer_bytes_now().numpy().tobytes())
        h.update(str(step).encode())
        return h.hexdigest(), rows[0, :n].clone()

    def steps_held(self) -> list[int]:
        return [st for st in self.flat.buf_step if st != INVALID]
