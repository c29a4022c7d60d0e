"""One rank's model, shard and training step: what a step computes, apart from how it is protected.

`Trainer` owns the rank's `Stage` (the whole model when data-parallel only, one (pp, tp) slice of
it under 3D parallelism, see parallel/) as a `FlatModel` (parameters and buffers in flat ping-pong
buffers), the rank's optimizer shard (`ShardState`: fp32 master weights + optimizer state in host
shared memory, a 1/D slice of the stage's flat state over its data-parallel peers), the
elementwise shard optimizer and the learning-rate schedule, all on the rank's `Device`
(device.py: the model, gradients and the shard's working copy on the GPU with `--device cuda`,
the snapshot halves in pinned host memory; on CPU the working copy *is* the host halves). A step:

1. forward/backward of this data-parallel rank's microbatches through the pipeline (1F1B, see
   parallel/pipeline.py; one stage = the plain loop), bf16 gradients accumulated in fp32;
2. `before_reduce()` - the protection layer waits for the previous step's replication here;
3. gradient sum over the data-parallel peers in buckets started from backward hooks, a reduce-scatter
   onto each shard's owner (grad_reduce.py); the tied embedding's two copies (first and last stage)
   summed; the loss summed over every rank;
4. optional clipping by the global norm (each element counted once over the whole mesh);
5. the optimizer reads the committed half of the shard's working copy and writes the staging
   half (on gloo in 4 MiB chunks, each chunk's parameter gather posted as soon as it is computed:
   shard_gather.py); the staging half's copy into host memory starts (CUDA: on the copy stream,
   overlapping what follows; CPU: nothing to copy);
6. model buffers broadcast from data-parallel rank 0 (as DistributedDataParallel does), then
   the updated master slices are gathered (cast to the parameter dtype) into the other flat
   buffer (NCCL: its all-gather; gloo: the rounds posted in 5), and only then the flat buffers
   flip and the shard commits the step, at once on CPU, once its copy completed on CUDA
   (`ShardState.commit_when`).

`final_state()` gathers every shard's rows, maps every stage onto the full model (logical,
layout-free order, parallel/logical.py) and returns the sha256 over the full, unsharded state
(master weights, optimizer state, buffers): two layouts of the same model hash alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from phoenixft.config import RunConfig
from phoenixft.data import _mix
from phoenixft.distributed.device import DONE, Device
from phoenixft.distributed.streams import StreamOrdered, stream_ordered
from phoenixft.errors import PeerFailure, RunAborted, Unhealable
from phoenixft.optim import ElementwiseOptimizer, lr_at, make_optimizer
from phoenixft.parallel.layout import Coord, Layout
from phoenixft.parallel.logical import full_numel, segments, to_full
from phoenixft.parallel.pipeline import Pipeline
from phoenixft.parallel.stage import Stage
from phoenixft.protect.snapshot import H_VALID, INVALID, ShardState
from phoenixft.train.buckets import GradBuckets
from phoenixft.train.grad_reduce import OwnerReduce, gradient_reduction
from phoenixft.train.shard_gather import CHUNK_BYTES, ShardGather
from phoenixft.train.shard_reduce import ShardReduce
from phoenixft.train.zero import DTYPES, FlatModel
from phoenixft.workload import Workload

__all__ = ["Trainer", "StepResult", "StepChecks", "check_loss"]

Wait = Callable[[Any, str], None]


class _Timed:
    """A wait that adds up the time it blocks (`s`): the time a step spends waiting for other ranks is
    not the rank's own compute."""

    def __init__(self, inner: Wait) -> None:
        self.inner, self.s = inner, 0.0

    def __call__(self, work: Any, what: str) -> None:
        t = time.perf_counter()
        try:
            self.inner(work, what)
        finally:
            self.s += time.perf_counter() - t


class StepChecks(Protocol):
    """Checks a step runs against silent data corruption (phoenixft.sdc): a gradient bucket about to be
    reduced, and the step's loss and gradient norm before the optimizer writes anything (may raise)."""

    wants_norm: bool  # the gradient norm is computed even without --clip-grad-norm
    guards_loss: bool  # a non-finite loss goes to `before_update` instead of stopping the run at once

    def on_bucket(self, s: int, grad: torch.Tensor, lo: int, hi: int) -> None: ...

    def before_update(self, s: int, loss: float, norm: float | None) -> None: ...


@dataclass
class StepResult:
    loss: float
    lr: float
    grad_norm: float | None
    compute_s: float
    repl_wait_s: float
    val_loss: float | None = None
    own_s: float = 0.0  # this rank's own compute of the step: its spans, less every wait for another rank
    # every rank's own compute of its previous step (0.0: none measured yet), carried by the loss sum
    ranks_own_s: list[float] = field(default_factory=list)
    # after compute: reduce_s (the gradient buckets' wait), optimizer_s (tied-embedding sum, loss wait,
    # clipping, the update; on gloo also posting the gather), gather_s (the rest until the flip)
    phases: dict[str, float] = field(default_factory=dict)


def check_loss(out: Any, where: str) -> None:
    """The workload's loss of one microbatch must be one number that autograd can start from: a
    real floating-point tensor of one element. Anything else stops the run with one line saying what it was
    (otherwise it would fail inside phoenixft's own code: a traceback, and a worker crash loop that ended the
    run as "in-memory state lost")."""
    if isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point():
        return
    what = (f"a {out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}")
    raise Unhealable(f"the workload's loss returned {what} {where}: it must return the microbatch's loss as a "
                     "floating-point tensor of one element (e.g. reduce it with .mean())")


class Trainer:
    def __init__(self, cfg: RunConfig, wl: Workload, stage: Stage, full_model: torch.nn.Module | None = None,
                 device: Device | None = None) -> None:
        self.cfg, self.wl, self.stage = cfg, wl, stage
        self.device = device or Device("cpu")
        self.model = stage.module
        if self.device.is_cuda:  # built on the CPU under the seed (the same weights on any device), then moved
            self.model.to(self.device.torch)
        self.full_model = full_model if full_model is not None else stage.module  # structure of the whole model
        self.segs = segments(stage.pieces(), stage.full())  # this stage's elements in the full model
        self.full_numel = full_numel(stage.full())
        self.dtype = DTYPES[cfg.precision]
        self.opt: ElementwiseOptimizer = make_optimizer(
            cfg.optimizer, weight_decay=cfg.weight_decay, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
            momentum=cfg.momentum, nesterov=cfg.nesterov, custom=wl.optimizer)
        self.rows = 1 + len(self.opt.state_names)
        # the host snapshot halves are protection: without it (--protect none) the working copy is not
        # copied out (on CPU there is nothing to copy either way); headers then describe the working copy
        self.snapshot = cfg.protect != "none"
        self.payload_from = 0 if self.dtype != torch.float32 else 1
        self.flat: FlatModel
        self.state: ShardState
        self.interrupt: Callable[[], None] = lambda: None  # raises PeerFailure when a recovery started
        self.buckets: GradBuckets
        self._hooked = False
        self._rs: ShardReduce | OwnerReduce | None = None  # the gradient reduce-scatter of this group and buffer
        self._ordered: StreamOrdered | None = None  # NCCL: the stream-ordered wait of this epoch (device_wait)
        self.own_prev = 0.0  # this rank's own compute of its previous step (sent with the next loss sum)
        self._own_rest = 0.0  # ... of which the part after forward/backward (optimizer, hand-off)
        self.checks: StepChecks | None = None  # silent-data-corruption checks (phoenixft.sdc), if any

    def watch(self, interrupt: Callable[[], None]) -> None:
        """Leave the step within one layer when a recovery starts: `interrupt` is called between
        microbatches, before every module's forward and after every parameter's gradient."""
        self.interrupt = interrupt
        for mod in self.model.modules():
            mod.register_forward_pre_hook(lambda _m, _i: interrupt())

    def device_wait(self, wait: Wait) -> Wait:
        """The wait for collectives whose results only kernels read (tensor-parallel all-reduces, pipeline
        receives): stream-ordered on NCCL (distributed/streams.py), `wait` itself on gloo. Each epoch binds a
        fresh one (what a failed step's waits kept belongs to the retired groups)."""
        w = stream_ordered(wait, self.device.backend)
        self._ordered = w if isinstance(w, StreamOrdered) else None
        return w

    def _grad_ready(self, p: torch.Tensor) -> None:
        self.interrupt()
        self.buckets.on_grad(p)

    @property
    def payload_rows(self) -> int:
        return self.rows - self.payload_from

    def partition(self, world: int, shm: str | None, step: int = 0) -> None:
        """Flat parameters and the own optimizer shard for a `world`-way partition."""
        self.flat = FlatModel(self.model, shards=world, path=shm and shm + "-params", step=step, dtype=self.dtype,
                              device=self.device.torch)
        self.buckets = GradBuckets(self.flat, self.cfg.bucket_mb)
        self.norm_mask = self._mask(self.stage.counted())
        self.tied_ranges = self._ranges(self.stage.tied())
        if not self._hooked:  # the hooks stay on the parameters; they find the current buckets
            for p in self.flat.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            self._hooked = True
        self.state = ShardState(self.flat.shard_numel, shm and shm + "-state", rows=self.rows,
                                payload_from=self.payload_from, device=self.device)

    def _ranges(self, flags: list[bool]) -> list[tuple[int, int]]:
        out, off = [], 0
        for p, f in zip(self.flat.params, flags, strict=True):
            if f:
                out.append((off, off + p.numel()))
            off += p.numel()
        return out

    def _mask(self, counted: list[bool]) -> torch.Tensor | None:
        """1.0 for the flat elements that count in the global gradient norm; None when all do."""
        if all(counted):
            return None
        mask = torch.zeros(self.flat.padded, dtype=torch.float64, device=self.device.torch)
        for lo, hi in self._ranges(counted):
            mask[lo:hi] = 1.0
        return mask

    def prefault(self) -> None:
        """A warm spare: write (zero) the host memory a promotion will receive into - the flat buffer
        that is not live and every half of the shard that holds nothing - so that the page faults of
        first touch (about 0.1 s per 400 MB of /dev/shm under load) happen while it waits, not
        during a recovery's transfer."""
        flat, st = self.flat, self.state
        if flat.device.type == "cpu" and flat.buf_step[1 - flat.live] == INVALID:
            flat.bufs[1 - flat.live].zero_()
        for half in (0, 1):
            if not int(st.header[half, H_VALID]):
                st.data[half].zero_()

    def init_shard(self, dp: int, rank: int, world: int) -> None:
        """Epoch 0: the shard's master weights as the model was built, optimizer state zero."""
        master = torch.zeros(self.flat.padded)
        master[: self.flat.numel] = self.flat.init_master
        self.state.data[0, 0].copy_(master[self.flat.shard_slice(dp)])
        self.state.data[0, 1:].zero_()
        self.state.commit(0, 0, 0, (rank, world))
        self.state.begin_write(1)

    def resume(self, step: int) -> None:
        """After a restore wrote the host snapshot: the shard's working copy of `step` from it (H2D)."""
        self.state.load_device(step)

    def lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(step, schedule=c.lr_schedule, lr=c.lr, min_lr=c.min_lr, warmup=c.warmup_steps,
                     decay=c.decay_steps, total=c.steps)

    # ------------------------------------------------------------------ the step
    def step(self, s: int, comm: Any, rank: int, layout: Layout, microbatches: tuple[int, int], wait: Wait,
             before_reduce: Callable[[], float], fault: Callable[[str], None], nan: bool = False,
             slow: float = 1.0) -> StepResult:
        """Train step `s` on this rank (the phases of the module docstring); the shard commits step `s`.
        Its own compute (`StepResult.own_s`) is the step's time less the time blocked in waits for other
        ranks (collectives, the previous step's replication), its forward/backward scaled to an even share
        of the microbatches when the split is uneven (after a shrink); `slow` > 1 (the `slow:` fault) makes that
        compute `slow` times as long, with a sleep inside the rank's compute span."""
        cfg, c = self.cfg, layout.coord(rank)
        m_total = cfg.total_microbatches
        t0 = time.perf_counter()
        wait = timed = _Timed(wait)
        self.flat.zero_grad()
        grad = self.flat.grad32
        rs = self._reduce_scatter(comm.dp, grad)
        works: list[tuple[int, Any]] = []  # (bucket, its reduction), posted as backward completes each bucket
        waited = [0.0]  # how long the first bucket waited for the previous step's replication

        def launch(b: int) -> None:  # a bucket's gradients are complete on the last microbatch
            if not works:
                waited[0] = before_reduce()  # replication of the previous step committed before any reduction
            blo, bhi = self.buckets.ranges[b]
            if self.checks is not None:
                self.checks.on_bucket(s, grad, blo, bhi)
            works.append((b, rs.post(b, blo, bhi) if rs is not None else comm.dp.allreduce([grad[blo:bhi]])))

        # 1. forward/backward over the microbatches; backward starts the bucket reductions
        loss_sum = self._forward_backward(s, rank, c, layout, comm, microbatches, m_total, wait, fault, launch)
        own_fb = time.perf_counter() - t0 - timed.s - waited[0]
        if slow > 1.0:  # compute, not a wait: the peers wait for it in the loss sum
            time.sleep((slow - 1.0) * max(0.0, own_fb + self._own_rest))
        if nan:
            loss_sum = math.nan
        t_compute = time.perf_counter() - t0
        own_c, blocked_c = t_compute - timed.s - waited[0], timed.s
        mine = microbatches[1] - microbatches[0]  # (an uneven split: forward/backward scaled to an even share)
        own_c *= m_total / layout.dp / mine if mine and m_total % layout.dp else 1.0
        # 2-3. (the first bucket waited for the previous step's replication) gradients and loss summed
        lt, w_loss = self._reduce_gradients(s, comm, c, microbatches, loss_sum, launch, works, rs, wait,
                                            (rank, layout.world))
        if self._ordered is not None:  # NCCL: no gradient is used before every collective it came from succeeded
            self._ordered.settle()
        t_reduced = time.perf_counter()
        loss = self._sum_tied_and_loss(s, comm, grad, lt, w_loss, m_total, wait)
        # 4. clipping by the global norm
        gshard, norm = self._clip(s, comm, grad, c.dp, wait)
        if self.checks is not None:  # may raise: nothing of step s is written yet
            self.checks.before_update(s, loss, norm)
        norm = norm if cfg.clip_grad_norm > 0 else None
        # 5. the optimizer writes the staging half
        lr = self.lr(s)
        dst, rows_out, gather = self._optimizer_update(s, rank, comm.dp, gshard, lr, fault)
        t_opt = time.perf_counter()
        # 6. buffers, parameter gather, then the hand-off: the shard commits, the flat buffers flip
        self._hand_off(s, rank, layout.world, comm.dp, dst, rows_out, gather, wait)
        t_end = time.perf_counter()
        self._own_rest = max(0.0, t_end - t0 - t_compute - (timed.s - blocked_c))
        own, self.own_prev = own_c + self._own_rest, own_c + self._own_rest
        # metrics
        val = self.evaluate(s, comm, rank, layout, wait) if cfg.eval_every and s % cfg.eval_every == 0 else None
        phases = {"reduce_s": t_reduced - t0 - t_compute, "optimizer_s": t_opt - t_reduced, "gather_s": t_end - t_opt}
        return StepResult(loss=loss, lr=lr, grad_norm=norm, compute_s=t_compute, repl_wait_s=waited[0],
                          val_loss=val, phases=phases, own_s=own, ranks_own_s=lt[1:].tolist())

    def forward_backward_only(self, s: int, comm: Any, rank: int, layout: Layout, microbatches: tuple[int, int],
                              wait: Wait) -> float:
        """Forward and backward of step s's `microbatches` (any rank's) into the flat gradient, no reduction
        started: a recomputation that checks another computation (phoenixft.sdc)."""
        return self._forward_backward(s, rank, layout.coord(rank), layout, comm, microbatches,
                                      self.cfg.total_microbatches, wait, lambda _phase: None, None)

    def _forward_backward(self, s: int, rank: int, c: Coord, layout: Layout, comm: Any, microbatches: tuple[int, int],
                          m_total: int, wait: Wait, fault: Callable[[str], None],
                          launch: Callable[[int], None] | None) -> float:
        """Forward and backward of this rank's microbatches through the pipeline; the sum of their losses."""
        cfg, stage = self.cfg, self.stage
        lo, hi = microbatches

        def batch(j: int) -> Any:
            with self._user_code(s, rank):
                return self.device.move(self.wl.batch(s, lo + j))

        def forward(j: int, b: Any, inp: torch.Tensor | None) -> torch.Tensor:
            self.interrupt()
            self.device.seed(_mix(cfg.seed, s, lo + j))
            with self._user_code(s, rank):
                out = stage.forward(inp, b)
            if stage.last:
                check_loss(out, f"at step {s} on rank {rank}")
            return out

        def backward(j: int, out: torch.Tensor, g: torch.Tensor | None) -> None:
            self.interrupt()
            self.buckets.begin_microbatch(last=j == hi - lo - 1, launch=launch)
            with self._user_code(s, rank):
                if g is None:
                    (out / m_total).backward()
                else:
                    torch.autograd.backward(out, g)
            self.buckets.end_microbatch()

        ordered = self._ordered
        base = wait.inner if isinstance(wait, _Timed) else wait  # (NCCL: the stream-ordered wait of the epoch)
        dwait = ordered if ordered is not None and ordered.polled == base else self.device_wait(base)
        if dwait is base:  # gloo: the polled wait itself, timed
            dwait = wait
        pipe = Pipeline(stage, c.pp, layout.pp, comm.edges, wait, self.flat.dtype, self.device.torch, dwait)
        # the forward and backward fault phases: as microbatch 0's begins, before any wait on another stage
        return pipe.train(hi - lo, batch, forward, backward, before=lambda phase, j: fault(phase) if j == 0 else None)

    def _reduce_gradients(self, s: int, comm: Any, c: Coord, microbatches: tuple[int, int], loss_sum: float,
                          launch: Callable[[int], None], works: list[tuple[int, Any]],
                          rs: ShardReduce | OwnerReduce | None, wait: Wait,
                          me: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, Any]:
        """Post the loss all-reduce and wait for the gradient buckets; the loss tensor and its pending work.
        The sum carries every rank's own compute of its previous step too: rank r's in slot 1 + r of
        `me` = (rank, world) slots (no collective or store round trip of its own)."""
        lo, hi = microbatches
        if lo == hi:  # no microbatch on this rank (an uneven split): it still takes part in every reduction
            self.buckets.begin_microbatch(last=True, launch=launch)
            self.buckets.end_microbatch()
        mine = loss_sum if (self.stage.last and c.tp == 0) or math.isnan(loss_sum) else 0.0  # each loss counted once
        lt = torch.zeros(1 + me[1], dtype=torch.float64)
        lt[0], lt[1 + me[0]] = mine, self.own_prev
        w_loss = comm.train.allreduce([lt])
        for b, w in works:
            wait(w, f"gradient reduction of step {s}")
            if rs is not None:
                rs.finish(b)
        return lt, w_loss

    def _sum_tied_and_loss(self, s: int, comm: Any, grad: torch.Tensor, lt: torch.Tensor, w_loss: Any,
                           m_total: int, wait: Wait) -> float:
        """Sum the tied embedding's two gradient copies, then the step's loss (mean over microbatches), finite."""
        if self.tied_ranges and comm.emb is not None:  # the tied embedding: both copies get the summed gradient
            for tlo, thi in self.tied_ranges:
                wait(comm.emb.allreduce([grad[tlo:thi]]), f"tied-embedding gradient of step {s}")
        wait(w_loss, f"loss all-reduce of step {s}")
        total = float(lt[0])
        if not math.isfinite(total) and (self.checks is None or not self.checks.guards_loss):
            raise Unhealable(f"the loss of step {s} is {total / m_total} (numerical error in the training itself)")
        return total / m_total

    def _clip(self, s: int, comm: Any, grad: torch.Tensor, dp: int, wait: Wait) -> tuple[torch.Tensor, float | None]:
        """This rank's gradient shard, clipped by the global norm with `--clip-grad-norm`; and that norm."""
        sl = self.flat.shard_slice(dp)
        gshard = grad[sl]
        if not self.cfg.clip_grad_norm > 0 and (self.checks is None or not self.checks.wants_norm):
            return gshard, None
        if self.cfg.clip_grad_norm > 0:
            sq64 = gshard.double().square()
            if self.norm_mask is not None:
                sq64 = sq64 * self.norm_mask[sl]
            sq = torch.tensor([float(sq64.sum())], dtype=torch.float64)
        else:  # only watched (the spike guard): a float32 dot is enough, and 10x cheaper
            g32 = gshard if self.norm_mask is None else gshard * self.norm_mask[sl].float()
            sq = torch.tensor([float(torch.dot(g32, gshard))], dtype=torch.float64)
        wait(comm.train.allreduce([sq]), f"gradient norm of step {s}")
        norm = math.sqrt(float(sq))
        coef = self.cfg.clip_grad_norm / (norm + 1e-6)
        if self.cfg.clip_grad_norm > 0 and coef < 1.0:
            gshard = gshard * coef
        return gshard, norm

    def _optimizer_update(self, s: int, rank: int, dp_pg: Any, gshard: torch.Tensor, lr: float,
                          fault: Callable[[str], None]) -> tuple[int, torch.Tensor, ShardGather | None]:
        """The optimizer's update into the staging half (on gloo in chunks, each chunk's parameter gather
        posted at once); that half, its rows in the working copy and the gloo gather (None: NCCL)."""
        st = self.state
        src = st.half_with(s - 1)
        if src is None:
            raise RuntimeError(f"no committed optimizer state for step {s - 1}")
        # the update goes to the other half, so that the committed one stays the recovery point; with
        # nothing to recover (--protect none) an optimizer that allows it updates the state in place
        dst = src if not self.snapshot and self.opt.in_place else 1 - src
        st.begin_write(dst)
        rows_in, rows_out = st.dev[src], st.dev[dst]  # the working copy (CPU: the host halves themselves)
        if self.device.is_cuda:
            self._update(s, rank, rows_in[0], list(rows_in[1:]), gshard, s, lr, rows_out[0], list(rows_out[1:]),
                         hook=lambda: fault("optimizer"))
            return dst, rows_out, None
        gather = ShardGather(dp_pg, self.flat.begin_gather(), gshard.numel())
        n, chunk = gshard.numel(), CHUNK_BYTES // 4
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            self._update(s, rank, rows_in[0][lo:hi], [x[lo:hi] for x in rows_in[1:]], gshard[lo:hi], s, lr,
                         rows_out[0][lo:hi], [x[lo:hi] for x in rows_out[1:]],
                         hook=(lambda: fault("optimizer")) if lo == 0 else None)
            part = rows_out[0][lo:hi]
            gather.post(part if self.dtype == torch.float32 else part.to(self.dtype), lo)
        return dst, rows_out, gather

    def _hand_off(self, s: int, rank: int, world: int, dp_pg: Any, dst: int, rows_out: torch.Tensor,
                  gather: ShardGather | None, wait: Wait) -> None:
        """Start the staging half's copy to the host, broadcast the buffers, finish the parameter gather,
        then commit step `s` in the shard (once its copy is done) and flip the flat buffers."""
        st, flat = self.state, self.flat
        copy = st.copy_out(dst) if self.snapshot else DONE  # into the host half, off the compute stream
        try:
            if flat.buffers:
                raw = flat.buffer_bytes_now(on_device=self.device.is_cuda)
                opts = dist.BroadcastOptions()
                opts.rootRank = 0  # data-parallel rank 0's buffers, as DistributedDataParallel broadcasts them
                wait(dp_pg.broadcast([raw], opts), f"buffer broadcast of step {s}")
                flat.set_buffers(raw)
            if gather is None:
                master = rows_out[0] if self.dtype == torch.float32 else rows_out[0].to(self.dtype)
                wait(dp_pg._allgather_base(flat.begin_gather(), master), f"all-gather of step {s}")
            else:  # gloo: all-to-all rounds, 2x gloo's all-gather here (shard_gather.py)
                wait(gather.pending(), f"all-gather of step {s}")
        except BaseException:
            st.abandon(copy)  # the copy still writes the staging half: let it finish before anyone else does
            raise
        st.commit_when(dst, s, (rank, world), copy)
        flat.flip(s)

    def _reduce_scatter(self, dp_pg: Any, grad: torch.Tensor) -> ShardReduce | OwnerReduce | None:
        """The gradient reduction as a reduce-scatter: on gloo as all-to-alls (shard_reduce.py), on NCCL
        as reduces onto each part's owner (grad_reduce.py); None: an all-reduce (pipelines with a tied
        embedding, whose copies are summed over the whole tied range after the data-parallel reduction).
        The choice is fixed for a stage and backend, so a recovered run reduces as before."""
        how = gradient_reduction(self.device.backend, bool(self.tied_ranges))
        if how == "all-reduce":
            return None
        kind = OwnerReduce if how == "reduce-scatter" else ShardReduce
        rs = self._rs
        if not isinstance(rs, kind) or rs.pg is not dp_pg or rs.grad is not grad:
            rs = self._rs = kind(dp_pg, grad, self.flat.shard_numel)
        return rs

    @staticmethod
    @contextlib.contextmanager
    def _user_code(s: int, rank: int, what: str = "the workload") -> Iterator[None]:
        """Workload code runs here: a failure of ours passes through, a bug in user code is not ours to heal."""
        try:
            yield
        except (PeerFailure, RunAborted, Unhealable):  # (a wait inside backward's hooks: a peer failed, or the run
            raise  # ended; or already said why it cannot go on)
        except Exception as e:  # noqa: BLE001
            raise Unhealable(f"exception in {what} at step {s} on rank {rank}: {type(e).__name__}: {e}") from e

    def _update(self, s: int, rank: int, *args: Any, **kw: Any) -> None:
        """The optimizer's update of (a chunk of) the shard. The workload's own optimizer is user code: its
        exception stops the run saying so (it restarted every node in place, again and again, until the
        run failed as "in-memory state lost", its error in no report)."""
        if self.wl.optimizer is None:
            self.opt.update(*args, **kw)
            return
        with self._user_code(s, rank, "the workload's optimizer"):
            self.opt.update(*args, **kw)

    def evaluate(self, s: int, comm: Any, rank: int, layout: Layout, wait: Wait) -> float | None:
        """Mean loss over `--eval-batches` held-out microbatches, spread over the data-parallel ranks
        (and through the pipeline, forward only)."""
        if self.wl.eval_batch is None:
            return None
        n, c = self.cfg.eval_batches, layout.coord(rank)
        mine = list(range(c.dp, n, layout.dp))
        eval_batch = self.wl.eval_batch
        was_training = self.model.training
        self.model.eval()

        def batch(j: int) -> Any:
            self.device.seed(_mix(self.cfg.seed, -1, mine[j]))
            return self.device.move(eval_batch(mine[j]))

        try:
            pipe = Pipeline(self.stage, c.pp, layout.pp, comm.edges, wait, self.flat.dtype, self.device.torch)
            with self._user_code(s, rank):
                part = pipe.forward_only(len(mine), batch, check=lambda out: check_loss(
                    out, f"in the evaluation after step {s} on rank {rank}"))
        finally:
            self.model.train(was_training)
        total = torch.tensor([part if self.stage.last and c.tp == 0 else 0.0], dtype=torch.float64)
        wait(comm.train.allreduce([total]), f"evaluation after step {s}")
        return float(total) / n

    # ------------------------------------------------------------------ the end
    def final_state(self, comm: Any, rank: int, layout: Layout, step: int, wait: Wait) -> tuple[str, torch.Tensor]:
        """sha256 over the full state in logical order (every row of the full model, then the buffers),
        and the full master weights; both on rank 0 only ("" and an empty tensor elsewhere). Every
        rank must call it."""
        half = self.state.half_with(step)
        assert half is not None
        flat = self.flat
        dev = self.device  # the data-parallel group is NCCL on CUDA: gather on the device, from the working copy
        rows = torch.empty(self.rows, flat.padded, device=dev.torch)
        works = [comm.dp._allgather_base(rows[i], dev.put(self.state.dev[half, i])) for i in range(self.rows)]
        for w in works:
            wait(w, "final gather")
        local = rows.cpu()[:, : flat.numel]
        if layout.trivial:
            full = local
        else:  # every (pp, tp) coordinate's data-parallel rank 0 sends its stage's rows to rank 0
            full = self._gather_stages(comm, rank, layout, local, wait)
        if rank != 0:
            return "", torch.empty(0)
        h = hashlib.sha256()
        for i in range(self.rows):
            h.update(full[i].numpy().tobytes())
        h.update(flat.buffer_bytes_now().numpy().tobytes())
        h.update(str(step).encode())
        return h.hexdigest(), full[0].clone()

    def _gather_stages(self, comm: Any, rank: int, layout: Layout, local: torch.Tensor, wait: Wait) -> torch.Tensor:
        from phoenixft.distributed.comm import alltoallv

        c = layout.coord(rank)
        segs = torch.tensor(self.segs, dtype=torch.int64).reshape(-1)
        sizes = torch.tensor([local.numel() if c.dp == 0 else 0, segs.numel() if c.dp == 0 else 0], dtype=torch.int64)
        all_sizes = torch.empty(2 * layout.world, dtype=torch.int64)
        wait(comm.train._allgather_base(all_sizes, sizes), "final gather sizes")
        n = all_sizes.view(layout.world, 2).tolist()
        w = layout.world
        senders = [r for r in range(w) if n[r][0]]
        send = {0: local.contiguous().reshape(-1)} if c.dp == 0 else {}
        work, _, got = alltoallv(comm.train, w, send, {r: n[r][0] for r in senders} if rank == 0 else {})
        wait(work, "final gather of the stages")
        work2, _, got_segs = alltoallv(comm.train, w, {0: segs} if c.dp == 0 else {},
                                       {r: n[r][1] for r in senders} if rank == 0 else {}, dtype=torch.int64)
        wait(work2, "final gather of the stage maps")
        if rank != 0:
            return local
        full = torch.zeros(self.rows, self.full_numel)
        for r in senders:
            sg = [tuple(x) for x in got_segs[r].view(-1, 3).tolist()]
            to_full(got[r].view(self.rows, -1), sg, full)
        return full

    def steps_held(self) -> list[int]:
        return [st for st in self.flat.buf_step if st != INVALID]
