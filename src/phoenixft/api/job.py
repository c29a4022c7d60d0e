"""The job a user's own training loop runs in: what `phoenixft.init()` returns.

    job = phoenixft.init()                       # joins the job (a spare waits here until promoted)
    model = job.wrap_model(MyModel())            # DDP over a group that survives every recovery
    opt = job.wrap_optimizer(torch.optim.AdamW(model.parameters()), scheduler=sched)
    loader = job.wrap_loader(loader)             # the data by step: resumes at the failed step's samples
    for step in job.steps(10_000):               # after a recovery, goes on from the resume step
        with job.step(step):                     # a failure inside is recovered here
            loss = model(next(loader)).loss
            loss.backward(); opt.step(); sched.step(); opt.zero_grad()
            job.log(loss=loss.item())

Every `with job.step(s)` that completes is a committed step: the model, every wrapped optimizer and
scheduler, the data cursor and whatever was registered (`job.register_state`) are snapshotted into
host shared memory (api/state.py) and protected by the job's redundancy scheme off the training path.
A failure (a peer killed or stopped, a node lost, a collective cut off) unwinds the step to its `with`,
which runs the recovery inside the process: a new epoch, the state of the resume step restored from
this rank's own halves or its peers', the live objects loaded from it; `job.steps` then yields the step
after the resume step. An exception of the script's own (a bug) stops the run with its traceback.

Determinism: at every step's start the job seeds torch's generators (CPU and this rank's GPU),
Python's `random` and NumPy's global generator from (seed, step, data-parallel rank), so a recovered
step draws what the failure-free run drew. A script that is deterministic given its state and the step
ends bitwise equal to its failure-free run (docs/script.md says what breaks that).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from phoenixft.api.ddp import ResilientDDP
from phoenixft.api.group import NotMember
from phoenixft.api.loader import StatefulLoader, StepLoader, is_map_style, seed_step
from phoenixft.api.member import ScriptMember
from phoenixft.api.state import Outgrown
from phoenixft.api.tracked import is_sharded
from phoenixft.controlplane import keys, sealed
from phoenixft.errors import Drained, PeerFailure, RunAborted, user_traceback
from phoenixft.faults.kinds import COPY_PHASE

__all__ = ["Job", "TOTAL_STEPS_KEY"]

TOTAL_STEPS_KEY = keys.SCRIPT_TOTAL_STEPS  # the steps the script's loop asked for (rank 0 writes it; sealed)
_DIST_ERRORS = ("gloo", "nccl", "connection", "connect", "socket", "timed out", "timeout", "peer", "broken pipe",
                "aborted", "closed")


class Job:
    """One rank's handle on the protected job (see the module docstring)."""

    def __init__(self, member: ScriptMember, seed: int) -> None:
        self.m = member
        self.seed = seed
        self.state = member.script
        self.tracked = self.state.tracked
        self.loaders: list[StepLoader] = []
        self.models: list[ResilientDDP] = []
        self.sharded: list[torch.nn.Module] = []  # modules the script sharded itself (FSDP2)
        self.optimizers: list[Any] = []
        self.total: int | None = None
        self.protect = member.cfg.protect == "phoenix"
        self.finished = False  # the loop completed and the final state is published (or the job let this rank go)
        self.trained = False  # a step committed here (an error after it is a crash to restart, not a bad script)
        self._pending: Any = None  # the topology of the epoch to join before the first step
        self._expect: int | None = None  # the step `job.steps` yielded last
        self._done: int | None = None  # the step the last `with job.step` committed
        self._resume: int | None = None  # after a recovery: the step `job.steps` goes on from
        self._current: int | None = None  # the step inside `with job.step`, if any
        self._fired: set[str] = set()  # the fault phases already fired in the current step
        self._waited: tuple[int, int] | None = None  # the (epoch, step) that waited for its predecessor's protection
        self._metrics: dict[str, Any] = {}
        self._t0 = 0.0
        self.tracked.cursor = self._cursor
        self.tracked.set_cursor = self._set_cursor
        member.on_joined.append(self._after_join)

    # ---------------------------------------------------------------- who this rank is
    @property
    def rank(self) -> int:
        """This rank in the current epoch (before the first join: the rank the job assigned it)."""
        r = self.m.ctx.rank
        return r if r >= 0 or self.m.group is None else self.m.group.rank()

    @property
    def world_size(self) -> int:
        topo = self.m.ctx.topo
        if topo is not None:
            return topo.world
        return self.m.group.size() if self.m.group is not None else self.m.cfg.world

    @property
    def local_rank(self) -> int:
        return self.m.local_rank

    @property
    def node(self) -> str:
        return self.m.node_id

    @property
    def device(self) -> torch.device:
        return self.m.device.torch

    def _dp(self) -> tuple[int, int]:
        return self.rank, self.world_size

    # ---------------------------------------------------------------- what the job protects
    def wrap_model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """`module`, trained data-parallel over the job's group (DDP's keyword arguments are DDP's); a module
        the script sharded itself with FSDP2's `fully_shard` comes back as it is. Its parameters and buffers
        are protected every step."""
        self.tracked.add("models", f"model{len(self.tracked.models)}", module)
        self._hook_phases(module)
        if any(is_sharded(p) for p in module.parameters()):  # (its ranks cannot change: no shrink, no grow)
            if self.rank == 0:
                self.m.keeper.put(keys.SCRIPT_FIXED_SIZE, "1")  # (kept: the coordinator reads it at every plan)
            self.sharded.append(module)
            return module
        wrapped = ResilientDDP(module, self.m.group, self._share, self._protected_before, self.m.ctx.wait,
                               **ddp_kwargs)
        self.models.append(wrapped)
        return wrapped

    def wrap_optimizer(self, optimizer: Any, scheduler: Any = None) -> Any:
        """`optimizer` (any `torch.optim.Optimizer`), its state and hyperparameters protected every step, its
        `step()` made to wait until the previous step is protected; `scheduler` (an LR scheduler) protected
        too. Returns the same optimizer."""
        self.tracked.add("optimizers", f"optimizer{len(self.tracked.optimizers)}", optimizer)
        if scheduler is not None:
            self.tracked.add("schedulers", f"scheduler{len(self.tracked.schedulers)}", scheduler)
        inner = optimizer.step

        @functools.wraps(inner)  # (an LR scheduler built before marks the step it wraps: the mark stays)
        def step(*args: Any, **kwargs: Any) -> Any:
            self._before_update()
            return inner(*args, **kwargs)

        optimizer.step = step
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """An LR scheduler (or anything with `state_dict`) protected every step; returns it."""
        self.tracked.add("schedulers", f"scheduler{len(self.tracked.schedulers)}", scheduler)
        return scheduler

    def wrap_loader(self, loader: Any) -> Any:
        """A `DataLoader` over a map-style dataset becomes a `StepLoader` (api/loader.py): each `next()` is this
        rank's share of one global microbatch, and the position is part of every snapshot. A loader of an
        iterable dataset with `state_dict()` (a `StatefulDataLoader`) is protected as this rank's own state; the
        loader returned is its own iterator (`next(loader)`), which resumes where a recovery puts it."""
        if is_map_style(loader):
            sl = StepLoader(loader, self.seed, self.m.cfg.world, self._dp)
            self.loaders.append(sl)
            return sl
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            wrapped = StatefulLoader(loader)
            self.tracked.add("loaders", f"loader{len(self.tracked.loaders)}", wrapped, per_rank=True)
            return wrapped
        raise TypeError(f"phoenixft cannot protect the position of a {type(loader).__name__}: give a DataLoader over "
                        "a map-style dataset (len() and indexing), or a loader with state_dict()/load_state_dict() "
                        "such as torchdata's StatefulDataLoader")

    def register_state(self, name: str, obj: Any, per_rank: bool = False) -> Any:
        """Protect `obj` every step: a module, anything with `state_dict()`/`load_state_dict()`, a tensor, or a
        dict or list of them. `per_rank`: this rank's own (replicated to peers of other nodes), else the same on
        every data-parallel rank. Returns `obj`."""
        self.tracked.add("extra", name, obj, per_rank=per_rank)
        return obj

    def log(self, **metrics: Any) -> None:
        """Numbers of the current step for the run's live display, records and report (e.g. `loss=`)."""
        for k, v in metrics.items():
            self._metrics[k] = float(v.item() if isinstance(v, torch.Tensor) else v)

    def _cursor(self) -> Any:
        return [sl.state_dict() for sl in self.loaders]

    def _set_cursor(self, c: Any) -> None:
        for sl, sd in zip(self.loaders, c or [], strict=False):
            sl.load_state_dict(sd)

    def _share(self) -> tuple[int, int]:
        mine = total = 0
        for sl in self.loaders:
            a, b = sl.share()
            mine, total = mine + a, total + b
        return mine, total

    # ---------------------------------------------------------------- the loop
    def steps(self, n: int) -> Iterator[int]:
        """Steps 1..n, from the step after the resume step of the run's last recovery."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"phoenixft: job.steps({n!r}): the number of steps must be an int >= 1")
        self.total = n
        if self.rank == 0:
            self.m.keeper.put(TOTAL_STEPS_KEY, str(n))
        try:
            s = self._first_join() + 1
            while s <= n:
                try:
                    self.m._stop_for_drain(s - 1)
                    self.m._stop_if_ended()
                except PeerFailure as e:
                    s = self._recover(str(e)) + 1
                    continue
                self._expect, self._resume = s, None
                yield s
                if self._resume is not None:
                    s = self._resume
                    continue
                if self._done != s:
                    raise RuntimeError(f"phoenixft: step {s} was not run inside `with job.step({s}):`; every step's "
                                       "body must be, so that it can be protected and recovered")
                s += 1
            self._finish(n)
            self.finished = True
        except Drained as e:
            print(f"phoenixft worker {self.m.wid}: {e}; leaving", flush=True)
            self._leave(0)
        except RunAborted as e:
            if "done" in str(e):
                self.finished = True
                return
            print(f"phoenixft worker {self.m.wid}: {e}", flush=True)
            self._leave(3)

    def step(self, s: int) -> _Step:
        """The body of step `s`: `with job.step(s): ...`."""
        return _Step(self, s)

    def _leave(self, code: int) -> None:
        self.finished = code == 0
        self.m.close()
        raise SystemExit(code)

    def _first_join(self) -> int:
        topo, self._pending = self._pending, None
        if topo is None:
            return self.m.ctx.topo.resume_step if self.m.ctx.topo is not None else 0
        try:
            return self.m.join(topo)
        except PeerFailure as e:
            return self._recover(str(e))

    def _recover(self, err: str) -> int:
        return self.m._recover_until_joined(err)

    def _after_join(self) -> None:
        for w in self.models:
            w.rebuild()
        for mod in self.sharded:  # a step cut off mid-forward or mid-backward: FSDP's per-iteration state reset
            get_state: Any = getattr(mod, "_get_fsdp_state", None)
            state = get_state() if get_state is not None else None
            if state is None or getattr(state, "_is_root", None) is None:  # (it has not run a forward yet)
                continue
            reset = getattr(mod, "reset_iter_state", None) or getattr(mod, "reshard", None)
            if reset is not None:
                reset()
        for e in self.tracked.models:
            for p in e.obj.parameters():
                p.grad = None

    def _finish(self, n: int) -> None:
        while True:
            try:
                self.m.final(n)
                return
            except PeerFailure as e:  # (a failure during the final gather: recovered, the last steps again)
                r = self._recover(str(e))
                if r < n:
                    raise RuntimeError(f"phoenixft: the run recovered to step {r} while finishing step {n}") from None

    # ---------------------------------------------------------------- inside a step
    def _begin(self, s: int) -> None:
        if self._expect != s:
            raise RuntimeError(f"phoenixft: `with job.step({s})` inside `for step in job.steps(...)`, with the step "
                               f"it yielded ({self._expect})")
        self._current, self._fired, self._metrics = s, set(), {}
        self._t0 = time.perf_counter()
        seed_step(self.seed, s, self.rank, self.m.device.index if self.m.device.is_cuda else None)
        for sl in self.loaders:
            sl.begin_step()
        self.m.inject.hold(s)

    def _phase(self, phase: str) -> None:
        """A fault phase of the current step is reached (once per step), and a failure seen meanwhile raises."""
        self.m.watcher.check()
        s = self._current
        if s is None or phase in self._fired:
            return
        self._fired.add(phase)
        self.m.inject.at(s, phase)

    def _protected_before(self) -> None:
        """The previous step's protection complete (waited once a step): before the step's first gradient
        reduction (a failure there then loses at most the step itself) and before its update."""
        s, e = self._current, self.m.ctx.epoch
        if s is not None and (e, s) != self._waited and self.m.ctx.scheme is not None:
            self.m.ctx.scheme.wait(s - 1)
            self._waited = (e, s)  # (a step replayed after a recovery waits again: the epoch is another)

    def _before_update(self) -> None:
        self._protected_before()
        self.state.settle()  # (the last snapshot's copy of the parameters and optimizer state is complete)
        self._phase("optimizer")

    def _hook_phases(self, module: torch.nn.Module) -> None:
        for mod in module.modules():
            mod.register_forward_pre_hook(lambda _m, _i: self._phase("forward"))
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p: self._phase("backward"))

    def _commit(self, s: int) -> None:
        ctx = self.m.ctx
        self._protected_before()
        assert ctx.topo is not None
        if not self.protect:  # (--protect none: nothing to recover from; the final state is packed at the end)
            self._done = s
            if ctx.rank == 0:
                self._record(s)
            return
        try:
            self.state.snapshot(s, ctx.rank, ctx.topo.world, before_copy=lambda: self.m.inject.at(s, COPY_PHASE))
        except Outgrown as e:  # every rank's own side must fit one capacity: a larger one, in a recovery
            self.m.raise_private(e.needed)
            self._resume = self._recover(f"{e}: the ranks agree on a larger capacity") + 1
            return
        if ctx.scheme is not None:
            ctx.scheme.protect(s)
        self._done = s
        self.trained = True
        if ctx.rank == 0:
            self._record(s)

    def _record(self, s: int) -> None:
        ctx = self.m.ctx
        assert ctx.topo is not None
        now = time.time()
        lr = next((float(g["lr"]) for o in self.optimizers for g in o.param_groups if "lr" in g), math.nan)
        rec: dict[str, Any] = {"step": s, "loss": self._metrics.get("loss", math.nan), "lr": lr,
                               "dt": time.perf_counter() - self._t0, "t_end": now, "epoch": ctx.epoch,
                               "world": ctx.topo.world, **{k: v for k, v in self._metrics.items() if k != "loss"}}
        names, values = [keys.step(s), keys.PROGRESS], [json.dumps(rec), str(s)]
        if self.m._first_after_join is not None:
            names.append(keys.first_step(self.m._first_after_join))
            values.append(json.dumps({"t": now, "step": s}))
            self.m._first_after_join = None
        self.m._check_fence()
        sealed.put_many(ctx.store, names, values)

    def _end(self, s: int, exc: BaseException | None) -> bool:
        """The end of `with job.step(s)`: commit, recover, or stop the run for a bug; True: the exception is
        handled (the step is recovered)."""
        if exc is None:
            try:
                self._commit(s)
            finally:
                self._current = None
            return False
        self._current = None
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            return False
        if isinstance(exc, (Drained, RunAborted)):
            return False
        if self._is_failure(exc):
            self._resume = self._recover(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                                         ) + 1
            return True
        self._user_error(exc, s)
        return False

    def _is_failure(self, exc: BaseException) -> bool:
        """Whether `exc` comes of a failure of the job (a peer, a collective, the control plane) rather than of
        the script's own code."""
        if isinstance(exc, (PeerFailure, NotMember)):
            return True
        ctx = self.m.ctx
        if self.m.watcher.flagged(ctx.epoch) or (ctx.comm is not None and ctx.comm.retired):
            return True
        chain: list[BaseException] = []
        e: BaseException | None = exc
        while e is not None and len(chain) < 8:
            chain.append(e)
            e = e.__cause__ or e.__context__
        for x in chain:
            name = type(x).__name__
            if name.startswith("Dist") or name in ("ProcessGroupError",):
                return True
            if isinstance(x, RuntimeError) and any(w in str(x).lower() for w in _DIST_ERRORS):
                return True
        with contextlib.suppress(Exception):
            return sealed.has(ctx.store, keys.failflag(ctx.epoch))
        return False

    def _user_error(self, exc: BaseException, s: int) -> None:
        """A bug in the script: not ours to heal. The run stops with its traceback (the script's frames first)."""
        self.stop_for(exc, f"at step {s}")
        raise SystemExit(4) from exc

    def stop_for(self, exc: BaseException, when: str) -> None:
        """Stop the whole run for the script's own error `exc` (raised `when`, e.g. "at step 7"): its traceback,
        the script's frames first, in this node's log and with the run's end."""
        trace = user_traceback(exc)
        why = f"exception in the training script {when} on rank {self.rank}: {type(exc).__name__}: {exc}"
        if trace is not None:
            print(trace[1], flush=True)
        self.m._stop_run(why, trace=trace)
        print(f"phoenixft worker {self.m.wid}: {why}", flush=True)
        self.m.close()


class _Step:
    """`with job.step(s):` (see `Job.step`)."""

    def __init__(self, job: Job, s: int) -> None:
        self.job, self.s = job, s

    def __enter__(self) -> int:
        self.job._begin(self.s)
        return self.s

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        return self.job._end(self.s, exc)
