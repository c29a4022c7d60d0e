"""The device seam on CPU: `--device`, placement, the copy + deferred commit of the snapshot, and the
GPU path's ordering (a separate working copy, commit after the copy, H2D after a restore) run on CPU
through the mirror device, in process and in a real hot-swap."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run

from phoenixft.config import RunConfig
from phoenixft.distributed.comm import EpochComm, wait_work
from phoenixft.distributed.device import (
    DONE,
    Device,
    Pending,
    apply_nccl_env,
    cuda_unavailable,
    gpu_slot,
    nccl_env,
    place,
    resolve_device,
)
from phoenixft.errors import UserError
from phoenixft.parallel.layout import Layout
from phoenixft.parallel.stage import WholeModel
from phoenixft.protect.snapshot import INVALID, ShardState
from phoenixft.train.trainer import Trainer
from phoenixft.workload import WorkloadContext, load_workload

no_cuda = pytest.mark.skipif(cuda_unavailable() is None,
                             reason="CUDA is available here: the no-CUDA errors cannot be seen")


# ---------------------------------------------------------------------------------------------- --device
@no_cuda
def test_device_cuda_without_cuda_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.cli.main import main

    assert main(["run", "--nodes", "2", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--device=cuda is invalid" in lines[0] and "--device cpu" in lines[0], err
    assert "Traceback" not in err


@no_cuda
def test_device_cuda_without_cuda_from_the_shell_exits_2() -> None:
    p = subprocess.run([sys.executable, "-m", "phoenixft", "run", "--device", "cuda"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--device=cuda is invalid" in p.stderr and "Traceback" not in p.stderr


def test_bad_device_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.cli.main import main

    assert main(["run", "--nodes", "2", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "phoenixft run: error: --device='tpu' is invalid: one of auto, cpu, cuda", err


@no_cuda
def test_auto_stays_auto_in_the_config_and_is_cpu_here(auto_device: None) -> None:
    cfg = RunConfig()
    assert cfg.device == "auto" and cfg.workers_per_node == 1
    assert RunConfig.from_json(cfg.to_json()).device == "auto"  # published as given: each host resolves it
    assert resolve_device("auto") == "cpu" and resolve_device("cuda") == "cuda"
    with pytest.raises(UserError, match="--device=cuda is invalid on this host"):
        place("cuda", 0, "n0", 2, 1)
    assert place("auto", 0, "n0", 2, 1).describe() == "cpu"


def test_help_lists_the_device_flag() -> None:
    from phoenixft.cli.main import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    text = " ".join(text.split())  # (formatting every help line also checks none breaks argparse's % expansion)
    assert "--device DEVICE" in text and "cuda when a CUDA device is available" in text


# ---------------------------------------------------------------------------------------------- placement
def test_gpu_slot_local_rank_and_spread() -> None:
    # one host per node: LOCAL_RANK, a host identity of its own only beyond the host's GPUs
    assert [gpu_slot(lr, "n3", 4, 2, 8, "local-rank") for lr in (0, 1)] == [(0, False), (1, False)]
    assert gpu_slot(9, "n0", 4, 10, 8, "local-rank") == (1, True)
    # every node of a local run on this host: node ordinal x workers + local rank, spares after the nodes
    assert [gpu_slot(lr, n, 2, 2, 8, "spread").gpu for n in ("n0", "n1", "s0") for lr in (0, 1)] == [0, 1, 2, 3, 4, 5]
    assert gpu_slot(0, "s1", 3, 1, 2, "spread") == (0, True)  # slot 3 + 1 on 2 GPUs
    assert gpu_slot(0, "n1", 3, 1, 2, "spread") == (1, False)
    assert gpu_slot(0, "n5", 8, 1, 1, "spread") == (0, True)  # one GPU: everybody on it, all but n0 apart
    with pytest.raises(UserError, match="PHOENIXFT_GPU_PLACEMENT='rr' is invalid"):
        gpu_slot(0, "n0", 2, 1, 2, "rr")


def test_nccl_environment_keeps_acceptable_user_values_and_replaces_fatal_ones() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    set_now = apply_nccl_env(env, "n1", 0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in set_now
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert "NCCL_HOSTID" not in env
    assert nccl_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # only phoenixft aborts, after the descriptor
    for preset in ("1", "2", "3"):  # teardown (1, 3); a watchdog abort before the descriptor (2)
        env2 = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": preset}
        apply_nccl_env(env2, "s0", 1, own_host=True)
        assert env2["NCCL_HOSTID"] == "phoenixft-s0.1" and env2["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


# ---------------------------------------------------------------------------------------------- the seam on CPU
def test_seeding_a_device_draws_what_torch_manual_seed_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Device.seed` (each microbatch's dropout seed) leaves the CPU generator where `torch.manual_seed` leaves
    it, so a run's randomness is unchanged, and queues no deferred seeding of other device kinds (torch's
    own call captures a Python stack for each, every microbatch)."""
    import torch.xpu.random

    queued: list[object] = []
    monkeypatch.setattr(torch.xpu.random, "_lazy_call", lambda *a, **k: queued.append(a))
    cpu = Device("cpu")
    for seed in (0, 1, 1234, 2**62 + 7, 0xFFFF_FFFF_FFFF_FFFF):
        torch.manual_seed(seed)
        want = torch.get_rng_state()
        torch.manual_seed(seed ^ 1)  # (somewhere else first)
        queued.clear()
        cpu.seed(seed)
        assert torch.equal(torch.get_rng_state(), want), seed
        assert queued == [], seed


def test_cpu_device_writes_the_host_half_itself(tmp_path: Path) -> None:
    d = Device("cpu")
    assert d.backend == "gloo" and not d.mirror and not d.is_cuda and d.describe() == "cpu"
    host = d.host(6, torch.float32, str(tmp_path / "h"))
    assert (tmp_path / "h").stat().st_size == 24 and not host.is_pinned()
    assert d.working_copy(host) is host
    assert d.d2h(host, host) is DONE and DONE.done() and DONE.wait(0)
    batch = (torch.ones(2), [torch.zeros(1)], {"x": torch.ones(1)})
    assert d.move(batch) is batch and d.put(host).data_ptr() == host.data_ptr()
    d.h2d(host, host)  # same memory: nothing to do


def test_nccl_group_needs_cuda() -> None:
    store = dist.HashStore()
    with pytest.raises(RuntimeError, match="NCCL groups need a CUDA device"):
        EpochComm(store, 0, 0, 1, 30.0, backend="nccl", device=Device("cpu"))
    with pytest.raises(NotImplementedError, match="backend 'mpi'"):
        EpochComm(store, 0, 0, 1, 30.0, backend="mpi")


def test_mirror_copy_is_deferred_until_waited() -> None:
    d = Device("cpu", mirror=True)
    host = torch.zeros(2, 3)
    work = d.working_copy(host)
    assert work is not host and work.shape == host.shape and d.describe() == "cpu (mirrored shard)"
    work[1] = 7.0
    p = d.d2h(host[1], work[1])
    assert not p.done() and host[1].sum() == 0  # nothing copied yet
    assert p.wait(0.0) and p.done() and torch.equal(host[1], torch.full((3,), 7.0))
    work[0] = 5.0
    d.h2d(host[0], work[0])
    assert torch.equal(host[0], work[0])


def _raw_valid(st: ShardState, half: int) -> int:
    return int(st.header[half, 2])  # the header as stored, without settling


def test_commit_waits_for_the_copy_and_any_read_settles_it(tmp_path: Path) -> None:
    st = ShardState(4, str(tmp_path / "s"), rows=3, device=Device("cpu", mirror=True))
    st.dev[0].fill_(1.0)
    st.data[0].copy_(st.dev[0])
    st.commit(0, 0, 0, (0, 2))
    st.begin_write(1)
    st.dev[1].fill_(2.0)  # the optimizer's output, in the working copy
    copy = st.copy_out(1)
    st.commit_when(1, 1, (0, 2), copy)
    assert _raw_valid(st, 1) == 0 and st.data[1].sum() == 0  # neither copied nor committed yet
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(st.half_with(1)))  # the replication thread asks for step 1
    t.start()
    t.join(10)
    assert got == [1] and _raw_valid(st, 1) == 1 and torch.equal(st.data[1], torch.full((3, 4), 2.0))
    assert st.steps() == [1, 0] and st.shard_of(1) == (0, 2)
    # the next step settles the previous copy before it registers its own
    st.begin_write(0)
    st.dev[0].fill_(3.0)
    c2 = st.copy_out(0)
    st.commit_when(0, 2, (0, 2), c2)
    assert st.steps() == [2, 1] and torch.equal(st.data[0], torch.full((3, 4), 3.0))
    # H2D after a restore wrote the host half
    st.data[0].fill_(9.0)
    assert st.load_device(2) and torch.equal(st.dev[0], st.data[0])
    assert not st.load_device(7)


def test_an_abandoned_copy_finishes_and_commits_nothing(tmp_path: Path) -> None:
    st = ShardState(4, None, rows=2, device=Device("cpu", mirror=True))
    st.commit(0, 3, 0, (1, 2))
    st.begin_write(1)
    st.dev[1].fill_(4.0)
    copy = st.copy_out(1)
    st.abandon(copy)
    assert copy.done() and torch.equal(st.data[1], torch.full((2, 4), 4.0))
    assert st.steps() == [3] and st.step_of(1) == INVALID


class _Never(Pending):
    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> bool:
        time.sleep(min(timeout_s, 0.05))
        return False


def test_a_copy_that_never_completes_leaves_the_half_uncommitted(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ShardState, "SETTLE_TIMEOUT_S", 0.05)
    st = ShardState(4, None, rows=2, device=Device("cpu", mirror=True))
    st.commit(0, 3, 0, (0, 1))
    st.begin_write(1)
    st.commit_when(1, 4, (0, 1), _Never())
    assert st.steps() == [3] and st.half_with(4) is None
    assert "snapshot copy of step 4 did not complete" in capsys.readouterr().err


def test_cpu_commit_is_immediate(tmp_path: Path) -> None:
    st = ShardState(4, str(tmp_path / "s"), rows=3)
    assert st.dev is st.data
    st.begin_write(1)
    copy = st.copy_out(1)
    assert copy is DONE
    st.commit_when(1, 5, (1, 2), copy)
    assert _raw_valid(st, 1) == 1 and st.steps() == [5] and st._pending is None


# ---------------------------------------------------------------------------------------------- the step, in process
def _train(device: Device, steps: int = 4, optimizer: str = "adamw", precision: str = "fp32",
           clip: float = 0.0, protect: str = "phoenix") -> tuple[str, list[float]]:
    """`steps` steps of the tiny GPT on one rank (groups on a HashStore), through Trainer.step; with
    protection the shard is copied out into its host halves every step."""
    cfg = RunConfig(nodes=1, steps=steps, protect=protect, spares=0, optimizer=optimizer, precision=precision,
                    clip_grad_norm=clip, device="cpu")
    wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
    torch.manual_seed(cfg.seed)
    tr = Trainer(cfg, wl, WholeModel(wl.build_model(), wl.loss), device=device)
    tr.partition(1, None)
    comm = EpochComm(dist.HashStore(), 0, 0, 1, 60.0, backend=device.backend, device=device)
    tr.init_shard(0, 0, 1)
    tr.resume(0)

    def wait(w: Any, what: str) -> None:
        wait_work(w, what, lambda: None, 60.0)

    losses = []
    for s in range(1, steps + 1):
        res = tr.step(s, comm, 0, Layout(1), (0, cfg.total_microbatches), wait, before_reduce=lambda: 0.0,
                      fault=lambda phase: None)
        losses.append(res.loss)
    sha, _ = tr.final_state(comm, 0, Layout(1), steps, wait)
    comm.retire()
    if protect != "none":  # both committed halves were copied out whole
        for step in (steps - 1, steps):
            half = tr.state.half_with(step)
            assert half is not None and torch.equal(tr.state.data[half], tr.state.dev[half].cpu()), step
    return sha, losses


@pytest.mark.parametrize("optimizer,precision,clip", [("adamw", "fp32", 0.0), ("sgd", "bf16", 0.5)])
def test_mirrored_shard_trains_bitwise_like_the_host_shard(optimizer: str, precision: str, clip: float) -> None:
    """The GPU path's shard handling (working copy apart from the host halves, copy, deferred
    commit, H2D at resume) on CPU: the same bits as the optimizer writing the host halves."""
    plain = _train(Device("cpu"), optimizer=optimizer, precision=precision, clip=clip)
    mirrored = _train(Device("cpu", mirror=True), optimizer=optimizer, precision=precision, clip=clip)
    assert mirrored == plain
    # unprotected: the working copy is never copied out, and the final state is read from it
    assert _train(Device("cpu", mirror=True), optimizer=optimizer, precision=precision, clip=clip,
                  protect="none") == plain


def test_wait_work_raises_a_failed_work_as_peer_failure() -> None:
    from phoenixft.errors import PeerFailure

    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self, timeout: timedelta | None = None) -> bool:
            raise RuntimeError("NCCL error: remote process exited\nmore")

    with pytest.raises(PeerFailure, match="gradient reduction: NCCL error: remote process exited$"):
        wait_work(Failed(), "gradient reduction", lambda: None, 5.0)


# ---------------------------------------------------------------------------------------------- a real hot-swap
def test_mirrored_shard_hotswap_is_bitwise_invisible(tmp_path: Path, reference: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGKILLed node in its optimizer step, the spare promoted, every worker on the mirror device:
    the restored shard reaches the working copy only through the H2D at resume (a missing one
    changes the hash), and every commit waits for its copy."""
    ref = reference(nodes=3, steps=12)  # (the configuration of test_hotswap's runs: one reference run for all)
    monkeypatch.setenv("PHOENIXFT_DEVICE_MIRROR", "1")
    rep = run(tmp_path, nodes=3, spares=1, steps=12, inject=["kill:node=1@step=6,phase=optimizer"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and all(rec["invariants"].values())


class _Recorder(Device):
    """A device that records the groups an epoch asks for instead of building them."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.made: list[tuple[str, str, int, int]] = []

    def new_group(self, backend: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        self.made.append((backend, str(store), rank, size))
        return object()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_epoch_groups_by_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """With nccl, every group that carries device tensors is NCCL and `train`/`repl` stay gloo, on the
    same prefixes and in the same global order as with gloo."""
    import phoenixft.distributed.comm as comm_mod

    monkeypatch.setattr(comm_mod.dist, "PrefixStore", lambda prefix, store: prefix)
    dev = _Recorder()
    c = EpochComm(dist.HashStore(), 3, 5, 8, 30.0, backend=backend, layout=Layout(8, tp=2, pp=2), device=dev)
    assert [(b, p) for b, p, _, _ in dev.made] == [
        ("gloo", "e3/train"), ("gloo", "e3/repl"), (backend, "e3/dp/pp1.tp1"), (backend, "e3/tp/pp1.dp0"),
        (backend, "e3/fwd0/dp0.tp1"), (backend, "e3/bwd0/dp0.tp1"), (backend, "e3/emb/dp0.tp1")]
    assert c.dp is not c.train
    trivial = _Recorder()
    c1 = EpochComm(dist.HashStore(), 0, 1, 2, 30.0, backend=backend, device=trivial)
    if backend == "gloo":  # data-parallel only on gloo: dp is train, as it always was
        assert c1.dp is c1.train and len(trivial.made) == 2
    else:
        assert c1.dp is not c1.train and trivial.made[2][:2] == ("nccl", "e0/dp/pp0.tp0")
