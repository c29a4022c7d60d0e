"""The CUDA path itself: pinned shared-memory snapshots, the copy stream and the deferred commit,
NCCL groups on an epoch's store prefix waited through their marks (never torch's `wait()`), a peer's
death surfacing as PeerFailure in a survivor that retires the epoch within its bound and builds the
next epoch's NCCL group, the training step on a GPU, and the checks' GPU paths (the SDC fingerprints of
device tensors and their NCCL exchange; a spare's health check on its GPU). Skipped without CUDA;
bench/gpu_check.sh runs them on a GPU machine (and fails if they skip there).

Everything here but the GPU is as on the CPU suite's machines: each process's NCCL settings come from
`place()` (the worker's own set-up), stores are torch's own, every wait is bounded, and every child
process is joined or killed before a test returns. Each test whose logic does not need the GPU also
runs on CPU (`[cpu]`: the mirror device, NCCL's failure behaviour emulated on gloo groups,
distributed/nccl_emulation.py), so that it cannot fail on the GPU for a reason a CPU would have shown."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: before its first use

from phoenixft.distributed import retire  # noqa: E402
from phoenixft.distributed.comm import EpochComm, connect_store, wait_work  # noqa: E402
from phoenixft.distributed.device import MIRROR_ENV, Device, nccl_env, place  # noqa: E402
from phoenixft.distributed.nccl import NcclGroup, NcclWork  # noqa: E402
from phoenixft.errors import PeerFailure  # noqa: E402
from phoenixft.protect.snapshot import ShardState  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KINDS = [pytest.param("cuda", marks=cuda), "cpu"]  # the GPU, and the same logic on CPU (see the docstring)


def _gpu() -> Device:
    return place("cuda", 0, "n0", 1, 1)


def _device(kind: str, monkeypatch: pytest.MonkeyPatch) -> Device:
    """The GPU, or a CPU worker's device with NCCL emulated on gloo and NCCL's settings, as `place()` gives it."""
    if kind == "cuda":
        return _gpu()
    monkeypatch.setenv(MIRROR_ENV, "nccl")
    for k, v in nccl_env().items():
        monkeypatch.setenv(k, v)
    return place("cpu", 0, "n0", 1, 1)


@cuda
def test_snapshot_halves_are_pinned_shared_memory(tmp_path: Path) -> None:
    d = _gpu()
    path = Path("/dev/shm") / f"phoenixft-test-{os.getpid()}"
    try:
        st = ShardState(1 << 16, str(path), rows=3, device=d)
        assert st.data.is_pinned(), "cudaHostRegister of shared memory was refused here (see the line printed)"
        assert not st.data.is_cuda and st.dev.is_cuda and st.dev.shape == st.data.shape
        assert Path(str(path) + ".data").stat().st_size == 2 * 3 * (1 << 16) * 4
        host = d.host(1024, torch.float32, None)
        assert host.is_pinned()
    finally:
        for f in Path("/dev/shm").glob(path.name + "*"):
            f.unlink()


@pytest.mark.parametrize("kind", KINDS)
def test_copy_stream_orders_after_the_compute_and_commits_after_the_copy(kind: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    d = _device(kind, monkeypatch)
    st = ShardState(1 << 20, None, rows=3, device=d)
    st.dev[0].fill_(1.0)
    st.data[0].copy_(st.dev[0].cpu())
    st.commit(0, 0, 0, (0, 1))
    st.begin_write(1)
    x = torch.randn(2048, 2048, device=d.torch)
    for _ in range(20):  # keep the compute stream busy: the copy must wait for the optimizer's last write
        x = torch.tanh(x @ x)
    st.dev[1].copy_(x.reshape(-1)[: st.dev[1].numel()].reshape(st.dev[1].shape) + 2.0)
    copy = st.copy_out(1)
    st.commit_when(1, 1, (0, 1), copy)
    assert st.half_with(1) == 1  # settles: waits for the copy's event
    assert copy.done() and torch.equal(st.data[1], st.dev[1].cpu())
    # restore: the host half back into the working copy
    st.data[1].fill_(5.0)
    assert st.load_device(1) and torch.equal(st.dev[1].cpu(), st.data[1])


@pytest.mark.parametrize("kind", KINDS)
def test_nccl_group_on_a_prefix_store_waits_polled_and_aborts(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _device(kind, monkeypatch)
    assert d.backend == "nccl"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # (set by place(): only phoenixft aborts)
    comm = EpochComm(dist.HashStore(), 0, 0, 1, 30.0, backend="nccl", device=d)
    assert comm.dp is not comm.train and isinstance(comm.dp, NcclGroup)  # data-parallel on NCCL, host transfers on gloo
    t = torch.arange(8.0, device=d.torch)
    work = comm.dp.allreduce([t])
    assert isinstance(work, NcclWork)
    wait_work(work, "allreduce", lambda: None, 30.0)
    assert not work.failed  # done through its mark: the kernel finished
    out = torch.empty(8, device=d.torch)
    wait_work(comm.dp._allgather_base(out, t), "all-gather", lambda: None, 30.0)
    assert torch.equal(out.cpu(), torch.arange(8.0))
    assert comm.retire(10.0)  # abort() of every group returns, within the bound


@cuda
def test_training_on_the_gpu_is_deterministic_and_close_to_the_cpu() -> None:
    from test_device import _train

    d = _gpu()
    a = _train(d)
    b = _train(d)
    assert a == b  # bitwise: what a recovered run is compared with
    cpu = _train(Device("cpu"))
    for x, y in zip(a[1], cpu[1], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (a[1], cpu[1])


# ------------------------------------------------------------------------------------ the checks on a GPU
@cuda
def test_fingerprints_of_gpu_tensors_equal_those_of_the_same_bytes_on_the_cpu() -> None:
    """The SDC fingerprints (sdc.logic.fingerprint) of device tensors, as a worker on a GPU takes them of its
    parameters and gradient buckets: aligned and unaligned slices, each dtype; and the int64 exchange of
    them over NCCL that the parameter check posts, gathered back equal."""
    from phoenixft.sdc.logic import fingerprint

    g = torch.Generator().manual_seed(5)
    base = torch.randn(10_007, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host = base.to(dtype)
        dev = host.to(_gpu().torch)
        for lo, hi in ((0, 10_007), (1, 9_999), (3, 4), (5, 5), (2_048, 8_192), (7, 10_000)):
            assert fingerprint(dev[lo:hi]) == fingerprint(host[lo:hi]), (dtype, lo, hi)
        bad = dev.clone()
        bad.view(torch.int16 if dtype != torch.float32 else torch.int32)[77] ^= 1  # one flipped bit
        assert fingerprint(bad) != fingerprint(dev)
    d = _gpu()
    store = dist.HashStore()
    pg = d.new_group("nccl", store, 0, 1, timedelta(seconds=30))
    mine = torch.tensor([x for j in range(2) for x in fingerprint(base[j::2].contiguous())], dtype=torch.int64,
                        device=d.torch)
    out = torch.empty_like(mine)
    pg._allgather_base(out, mine).wait()
    assert out.tolist() == mine.tolist()


@cuda
def test_the_spares_health_check_passes_on_the_gpu_and_a_wrong_product_fails_it() -> None:
    """The built-in check on a CUDA device (health.check): the float32 product's checksum equals the
    exact int64 reference (TF32 or not), the loopback all-reduce runs over NCCL, and a perturbed
    operand (the sick: fault) is caught."""
    from phoenixft.health.check import builtin_checks, reference_checksum

    d = _gpu()
    path = f"/dev/shm/phoenixft-test-health-{os.getpid()}"
    ref = reference_checksum()
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ok = builtin_checks(d, path, 1 << 20, ref)
        assert ok.ok and set(ok.times) == {"matmul", "shm", "collective"}, (tf32, ok)
    torch.backends.cuda.matmul.allow_tf32 = False
    bad = builtin_checks(d, path, 1 << 20, ref, perturb=True)
    assert not bad.ok and bad.reason.startswith("matrix product: checksum"), bad
    assert not os.path.exists(path)


# ------------------------------------------------------------------------------------ a peer dies
def _member(addr: str, node: str, rank: int, epoch: int, q: Any, kind: str) -> None:
    """One process of the peer-death test: builds the epoch's NCCL group and sums its rank + 1."""
    try:
        os.environ.setdefault("PHOENIXFT_NCCL_HOSTID", "worker")  # several ranks may share one GPU
        os.environ.setdefault("PHOENIXFT_GPU_PLACEMENT", "spread")
        if kind == "cpu":
            os.environ[MIRROR_ENV] = "nccl"
        d = place(kind, 0, node, 2, 1)
        store = connect_store(addr)
        comm = EpochComm(store.c10d, epoch, rank, 2, 30.0, backend="nccl", device=d)
        t = torch.tensor([float(rank + 1)], device=d.torch)
        wait_work(comm.dp.allreduce([t]), "allreduce", lambda: None, 30.0)
        q.put((node, epoch, "sum", float(t.item())))
        if node == "s0":  # the spare: joined epoch 1, done
            comm.retire()
            return
        if node == "n1":  # the victim: SIGKILL while the survivor waits in its next collective
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        t2 = torch.ones(1 << 20, device=d.torch)
        try:
            def abort() -> str | None:
                return "recovery requested" if store.check([f"dead/{epoch}"]) else None

            wait_work(comm.dp.allreduce([t2]), "allreduce", abort, 60.0)
            q.put((node, epoch, "second", "completed"))
        except PeerFailure as e:
            q.put((node, epoch, "second", f"PeerFailure: {e}"))
            t0 = time.monotonic()
            returned = comm.retire()  # the abort on its own thread, waited for at most retire.ABORT_WAIT_S
            q.put((node, epoch, "retired", "ok" if returned else "abandoned", round(time.monotonic() - t0, 2)))
            comm2 = EpochComm(store.c10d, epoch + 1, rank, 2, 30.0, backend="nccl", device=d)  # the next epoch
            t3 = torch.tensor([float(rank + 1)], device=d.torch)
            wait_work(comm2.dp.allreduce([t3]), "allreduce", lambda: None, 30.0)
            q.put((node, epoch + 1, "sum", float(t3.item())))
            comm2.retire()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((node, epoch, "error", f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_peer_raises_in_the_survivor_which_builds_the_next_epoch(kind: str) -> None:
    """Epoch 0: n0 and n1 on NCCL; n1 is SIGKILLed while n0 waits in an all-reduce; the control
    plane's flag (set here once n1 is gone) or NCCL's own error ends n0's wait as PeerFailure, not
    as the death of n0; n0 aborts its groups and forms epoch 1 with a spare s0 on NCCL."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    addr = f"127.0.0.1:{server.port}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n0 = ctx.Process(target=_member, args=(addr, "n0", 0, 0, q, kind))
    n1 = ctx.Process(target=_member, args=(addr, "n1", 1, 0, q, kind))
    procs = [n0, n1]
    try:
        n0.start()
        n1.start()
        n1.join(90)
        assert n1.exitcode == -signal.SIGKILL, n1.exitcode
        server.set("dead/0", "1")  # what the coordinator does when the agent reports the exit
        s0 = ctx.Process(target=_member, args=(addr, "s0", 1, 1, q, kind))
        procs.append(s0)
        s0.start()
        n0.join(120)
        s0.join(30)
        got = []
        while True:
            try:
                got.append(q.get(timeout=2))
            except Exception:  # noqa: BLE001 - queue.Empty: everything was read
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = [g for g in got if g[2] == "error"]
    assert not errors, got
    assert ("n0", 0, "sum", 3.0) in got and ("n1", 0, "sum", 3.0) in got, got
    second = [g for g in got if g[0] == "n0" and g[2] == "second"]
    assert second and str(second[0][3]).startswith("PeerFailure"), got
    retired = [g for g in got if g[0] == "n0" and g[2] == "retired"]
    assert retired and retired[0][3] == "ok" and retired[0][4] <= retire.ABORT_WAIT_S + 1.0, got  # bounded, returned
    assert ("n0", 1, "sum", 3.0) in got and ("s0", 1, "sum", 3.0) in got, got
    assert n0.exitcode == 0, got


@cuda
def test_seeding_the_gpu_draws_what_torch_manual_seed_draws() -> None:
    d = _gpu()
    torch.manual_seed(99)
    want = torch.rand(4, device=d.torch).cpu(), torch.rand(4).tolist()
    torch.manual_seed(98)
    d.seed(99)
    assert torch.equal(torch.rand(4, device=d.torch).cpu(), want[0]) and torch.rand(4).tolist() == want[1]
