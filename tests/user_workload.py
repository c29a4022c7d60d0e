"""A user workload that is not the GPT: a small MLP regressing a fixed random linear map.

Used by the tests through `--workload user_workload:workload` (with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch

from phoenixft import Workload, WorkloadContext


def workload(ctx: WorkloadContext) -> Workload:
    teacher = torch.Generator().manual_seed(99)
    w_true = torch.randn(16, 1, generator=teacher)

    def build_model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 1009 + index)
        x = torch.randn(ctx.micro_batch, 16, generator=g)
        return x, x @ w_true

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return torch.nn.functional.mse_loss(model(x), y)

    return Workload(build_model=build_model, loss=loss, batch=batch)


def paced_workload(ctx: WorkloadContext) -> Workload:
    """`workload`, each microbatch's loss taking PHOENIXFT_TEST_PACE_S seconds more (default 0.25), asleep: a run
    that must last (outlast a stop, leave time to notice a loss) without training for its time on the CPU. The
    arithmetic is `workload`'s: the same final state as a run of `workload`."""
    wl = workload(ctx)
    pace = float(os.environ.get("PHOENIXFT_TEST_PACE_S", "0.25"))

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled():
            time.sleep(pace)
        return wl.loss(model, b)

    return Workload(build_model=wl.build_model, loss=loss, batch=wl.batch)


def channel_mismatch_workload(ctx: WorkloadContext) -> Workload:
    """A small CNN whose first convolution expects 1 input channel while its batches have 3: torch raises inside
    its own convolution, called from this file's forward."""

    class Cnn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3)
            self.head = torch.nn.Linear(4 * 14 * 14, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv(x)  # the user's line the error is at
            return self.head(h.flatten(1))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 1009 + index)
        return torch.randn(ctx.micro_batch, 3, 16, 16, generator=g), torch.randn(ctx.micro_batch, 1, generator=g)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(b[0]), b[1])

    return Workload(build_model=Cnn, loss=loss, batch=batch)


def lemon_workload(ctx: WorkloadContext) -> Workload:
    """`workload` on a bad host: a node of the host named by PHOENIXFT_TEST_LEMON_HOST (a PHOENIXFT_HOST_ID, as a
    local run names its simulated hosts) dies as real bad hardware does - its agent and itself SIGKILLed, no
    `--inject` involved - as soon as it computes a batch of step PHOENIXFT_TEST_LEMON_STEP (default 3) or
    later. Every other node computes `workload`'s batches."""
    wl = workload(ctx)
    lemon = os.environ.get("PHOENIXFT_HOST_ID", "") == os.environ.get("PHOENIXFT_TEST_LEMON_HOST", "-")
    first = int(os.environ.get("PHOENIXFT_TEST_LEMON_STEP", "3"))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if lemon and step >= first:
            import signal

            os.kill(os.getppid(), signal.SIGKILL)  # its node's agent
            os.kill(os.getpid(), signal.SIGKILL)
        return wl.batch(step, index)

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=batch)


def broken_workload(ctx: WorkloadContext) -> Workload:
    """The same workload with a bug that fires at step 4 (a software error: not ours to heal)."""
    wl = workload(ctx)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if b[0].shape[0] and torch.is_grad_enabled() and _step[0] >= 4:
            raise ValueError("shapes do not line up (deliberate bug)")
        return wl.loss(model, b)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _step[0] = step
        return wl.batch(step, index)

    return Workload(build_model=wl.build_model, loss=loss, batch=batch)


_step = [0]


def bn_workload(ctx: WorkloadContext) -> Workload:
    """A model with buffers that change every step: BatchNorm running statistics and its counter."""
    teacher = torch.Generator().manual_seed(98)
    w_true = torch.randn(16, 1, generator=teacher)

    def build_model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 1))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 1009 + index)
        x = torch.randn(ctx.micro_batch, 16, generator=g) * (1 + index)  # ranks see different statistics
        return x, x @ w_true

    def eval_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(-1, index)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)

    return Workload(build_model=build_model, loss=loss, batch=batch, eval_batch=eval_batch)


def nonelementwise_workload(ctx: WorkloadContext) -> Workload:
    from phoenixft.optim import ElementwiseOptimizer

    class Normalised(ElementwiseOptimizer):
        name = "normalised-sgd"
        state_names = ()

        def update(self, p_in, s_in, grad, step, lr, p_out, s_out, hook=None):  # type: ignore[no-untyped-def]
            torch.add(p_in, grad / (grad.norm() + 1e-12), alpha=-lr, out=p_out)

    wl = workload(ctx)
    return Workload(build_model=wl.build_model, loss=wl.loss, batch=wl.batch, optimizer=Normalised())


def unreduced_loss_workload(ctx: WorkloadContext) -> Workload:
    """A loss left unreduced: one value per sample, not the microbatch's scalar."""
    wl = workload(ctx)

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return (model(x) - y) ** 2

    return Workload(build_model=wl.build_model, loss=loss, batch=wl.batch)


def dict_loss_workload(ctx: WorkloadContext) -> Workload:
    """A loss returned in a dict (as some libraries' models return their outputs)."""
    wl = workload(ctx)
    return Workload(build_model=wl.build_model, loss=lambda m, b: {"loss": wl.loss(m, b)},  # type: ignore[arg-type,return-value]
                    batch=wl.batch)


def bad_batch_workload(ctx: WorkloadContext) -> Workload:
    """A batch function with a bug that fires at step 3."""
    wl = workload(ctx)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step >= 3:
            raise KeyError("no sample there (deliberate bug)")
        return wl.batch(step, index)

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=batch)


def bad_model_workload(ctx: WorkloadContext) -> Workload:
    """A build_model that raises (on every node, the spares included)."""
    wl = workload(ctx)

    def build_model() -> torch.nn.Module:
        raise RuntimeError("layer sizes do not match (deliberate bug)")

    return Workload(build_model=build_model, loss=wl.loss, batch=wl.batch)


def bad_factory(ctx: WorkloadContext) -> Workload:
    """A workload factory that raises."""
    raise FileNotFoundError("no such dataset (deliberate bug)")


def float64_workload(ctx: WorkloadContext) -> Workload:
    """The MLP built (and fed) in float64."""
    wl = workload(ctx)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = wl.batch(step, index)
        return x.double(), y.double()

    return Workload(build_model=lambda: wl.build_model().double(), loss=wl.loss, batch=batch)


def frozen_workload(ctx: WorkloadContext) -> Workload:
    """Every parameter frozen (requires_grad=False)."""
    wl = workload(ctx)

    def build_model() -> torch.nn.Module:
        return wl.build_model().requires_grad_(False)

    return Workload(build_model=build_model, loss=wl.loss, batch=wl.batch)


def noncontiguous_buffer_workload(ctx: WorkloadContext) -> Workload:
    """A buffer registered as a transposed (non-contiguous) tensor, changed every step."""
    wl = workload(ctx)

    class WithCounter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = wl.build_model()
            self.register_buffer("seen", torch.zeros(4, 3).t())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                with torch.no_grad():
                    self.seen.add_(1)
            return self.net(x)

    return Workload(build_model=WithCounter, loss=wl.loss, batch=wl.batch)


def nonpersistent_buffer_workload(ctx: WorkloadContext) -> Workload:
    """A non-persistent buffer (not in state_dict) that the forward changes every step and computes with."""
    wl = workload(ctx)

    class Counted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = wl.build_model()
            self.register_buffer("calls", torch.zeros(()), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.calls += 1
            return self.net(x) * (1 + 1e-2 * self.calls)

    return Workload(build_model=Counted, loss=wl.loss, batch=wl.batch)


def frozen_layer_workload(ctx: WorkloadContext) -> Workload:
    """The MLP with its first layer frozen (requires_grad=False), its input cast to the parameters' dtype."""
    wl = workload(ctx)

    def build_model() -> torch.nn.Module:
        model = wl.build_model()
        model[0].requires_grad_(False)
        return model

    def loss(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return torch.nn.functional.mse_loss(model(x.to(model[2].weight.dtype)).float(), y)

    return Workload(build_model=build_model, loss=loss, batch=wl.batch)


def bad_prepare_workload(ctx: WorkloadContext) -> Workload:
    """A workload whose one-off prepare() (run by the launcher) raises."""
    wl = workload(ctx)

    def prepare() -> None:
        raise PermissionError("the cache directory is read-only (deliberate)")

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=wl.batch, prepare=prepare)


def extra_state_workload(ctx: WorkloadContext) -> Workload:
    """A submodule with extra state (get_extra_state: a state_dict entry that is not a tensor)."""
    wl = workload(ctx)

    class Counting(torch.nn.Linear):
        def get_extra_state(self) -> dict[str, int]:
            return {"calls": 0}

        def set_extra_state(self, state: dict[str, int]) -> None:
            pass

    def build_model() -> torch.nn.Module:
        return torch.nn.Sequential(Counting(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    return Workload(build_model=build_model, loss=wl.loss, batch=wl.batch)


def head_only_workload(ctx: WorkloadContext) -> Workload:
    """A factory that works where the run was launched only (its data is on that host): every worker,
    the spares' included, fails the same way before the first step. The head is the process whose pid
    is $PHOENIXFT_TEST_HEAD_PID."""
    if os.getpid() != int(os.environ.get("PHOENIXFT_TEST_HEAD_PID", "0")):
        raise FileNotFoundError("/data/corpus.bin is not on this host (deliberate)")
    return workload(ctx)


def fails_once_workload(ctx: WorkloadContext) -> Workload:
    """A factory that fails once, in the first worker to call it (a transient failure on one host before
    the first step): the file $PHOENIXFT_TEST_MARK, created then, marks it done."""
    if os.getpid() != int(os.environ.get("PHOENIXFT_TEST_HEAD_PID", "0")):
        try:
            os.close(os.open(os.environ["PHOENIXFT_TEST_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            raise OSError("the data mount is not there yet (deliberate, once)")
    return workload(ctx)


def fails_on_nodes_workload(ctx: WorkloadContext) -> Workload:
    """A factory that fails on the nodes named in $PHOENIXFT_TEST_FAIL_NODES (comma-separated: their
    hosts lack the data), naming its node; the k-th named after k x 1.5 s (a slower host)."""
    argv = sys.argv
    node = argv[argv.index("--node") + 1] if "--node" in argv else ""
    failing = os.environ.get("PHOENIXFT_TEST_FAIL_NODES", "").split(",")
    if node and node in failing:
        time.sleep(1.5 * failing.index(node))
        raise FileNotFoundError(f"/data/corpus.bin is not on host {node} (deliberate)")
    return workload(ctx)


def bad_split_workload(ctx: WorkloadContext) -> Workload:
    """A workload whose split (for --tp/--pp) raises on every rank."""
    wl = workload(ctx)

    def split(full: torch.nn.Module, spec: object) -> object:
        raise RuntimeError("no tensor-parallel layout for this layer (deliberate bug)")

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=wl.batch, split=split)


def spare_worker_dies_workload(ctx: WorkloadContext) -> Workload:
    """The spare's worker process dies once while the spare waits, after the start (as an OOM kill would;
    its agent lives): at step 3 of the active nodes. Step 10 waits (up to 60 s) until the spare's next
    worker has set up. Files under the directory $PHOENIXFT_TEST_MARK say what happened."""
    marks = Path(os.environ["PHOENIXFT_TEST_MARK"])
    argv = sys.argv
    node = argv[argv.index("--node") + 1] if "--node" in argv else ""
    if node.startswith("s"):
        if not (marks / "spare-died").exists():
            (marks / "spare-died").touch()

            def die() -> None:
                while not (marks / "step3").exists():
                    time.sleep(0.01)
                os._exit(1)

            threading.Thread(target=die, daemon=True).start()
        else:
            (marks / "spare-back").touch()
    wl = workload(ctx)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 3:
            (marks / "step3").touch()
        deadline = time.monotonic() + 60.0
        while step == 10 and not (marks / "spare-back").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return wl.batch(step, index)

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=batch)


def unmounted_checkpoint_workload(ctx: WorkloadContext) -> Workload:
    """Where the workers run (not in the process whose pid is $PHOENIXFT_TEST_HEAD_PID), no persistent
    checkpoint can be read: a --resume/--persist-dir directory on the head only, not on the workers' hosts."""
    if os.getpid() != int(os.environ.get("PHOENIXFT_TEST_HEAD_PID", "0")):
        from phoenixft.recovery import restore

        def load_full(man: dict[str, object]) -> object:
            raise FileNotFoundError(f"{man['path']}: not mounted on this host (deliberate)")

        restore.load_full = load_full  # type: ignore[assignment]
    return workload(ctx)


def _plain_sgd(fail_at: int = 0) -> object:
    from phoenixft.optim import ElementwiseOptimizer

    class PlainSGD(ElementwiseOptimizer):
        name = "plain-sgd"
        state_names = ()  # no state: the payload protected for fp32 parameters has no row

        def update(self, p_in, s_in, grad, step, lr, p_out, s_out, hook=None):  # type: ignore[no-untyped-def]
            if hook is not None:
                hook()
            if fail_at and step >= fail_at:
                raise RuntimeError(f"update bug at step {step} (deliberate)")
            torch.add(p_in, grad, alpha=-lr, out=p_out)

    return PlainSGD()


def stateless_optimizer_workload(ctx: WorkloadContext) -> Workload:
    """The MLP trained by the workload's own optimizer, one that keeps no state (plain SGD)."""
    wl = workload(ctx)
    return Workload(build_model=wl.build_model, loss=wl.loss, batch=wl.batch, optimizer=_plain_sgd())


def bad_optimizer_workload(ctx: WorkloadContext) -> Workload:
    """The workload's own optimizer raising from step 5 on (its elementwise check, steps 1-3, passes)."""
    wl = workload(ctx)
    return Workload(build_model=wl.build_model, loss=wl.loss, batch=wl.batch, optimizer=_plain_sgd(fail_at=5))


def spike_workload(ctx: WorkloadContext) -> Workload:
    """The MLP whose data make a genuine loss and gradient spike at step 12 (its targets 1,000 times
    larger in that step only): the data's, not a fault's."""
    wl = workload(ctx)

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = wl.batch(step, index)
        return (x, y * 1000.0) if step == 12 else (x, y)

    return Workload(build_model=wl.build_model, loss=wl.loss, batch=batch)
