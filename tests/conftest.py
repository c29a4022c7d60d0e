"""Shared helpers: run a real phoenixft job (real processes, real signals) and check cleanup."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

# `--device auto` means cpu in the suite, whatever GPUs the machine has (a test that wants CUDA asks for it:
# `--device cuda`, `place("cuda", ...)`, or the `auto_device` fixture); set before phoenixft resolves anything
os.environ.setdefault("PHOENIXFT_AUTO_DEVICE", "cpu")

TESTS_DIR = str(Path(__file__).resolve().parent)


def on_pythonpath(path: str, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """`path` on $PYTHONPATH (first), for the processes a run starts, unless it is there already: an unchanged
    environment keeps this process's warm zygote (`phoenixft.runtime.zygote` serves the environment it started
    in; a changed `PYTHONPATH` costs a new one, an `import torch`)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.path.realpath(path) in map(os.path.realpath, parts):
        return
    value = os.pathsep.join([path, *parts])
    if monkeypatch is None:
        os.environ["PYTHONPATH"] = value
    else:
        monkeypatch.setenv("PYTHONPATH", value)


# the user workloads in tests/ (user_workload.py, ...) importable by every run of the suite, from its start
on_pythonpath(TESTS_DIR)

from phoenixft.config import RunConfig  # noqa: E402
from phoenixft.observe.display import Display  # noqa: E402
from phoenixft.runtime.launcher import run_job  # noqa: E402


def processes_with(tag: str) -> list[int]:
    """PIDs whose command line mentions `tag` (a run id), excluding this test process."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmd:
            found.append(int(d.name))
    return found


# What the suite's runs default to where the product's default would only cost time: the `nano` GPT (tiny's
# shape: 4 layers, 4 heads, every parallelism and protection path; 60k parameters instead of 834k) and a
# micro-batch of 2 sequences instead of 8. `run()` and `reference()` apply them, so a run and its failure-free
# reference share them; a test that starts `phoenixft` itself and compares with a `reference()` passes them
# too (`SUITE_FLAGS`), or names the model and micro-batch on both sides. A test whose claim needs more than
# one gradient bucket or replication chunk sets `bucket_mb`/`chunk_mb` to fit the model it runs.
SUITE_DEFAULTS: dict[str, Any] = {"micro_batch": 2, "model": "nano"}
SUITE_FLAGS = ["--micro-batch", "2", "--model", "nano"]


def suite_config(kw: dict[str, Any]) -> dict[str, Any]:
    """`kw` with `SUITE_DEFAULTS` filled in where the test did not say."""
    return {**SUITE_DEFAULTS, **kw}


def run(tmp: Path, **kw: Any) -> dict[str, Any]:
    """Run a job to completion; assert that no process and no shared memory outlives it.

    Two checks: the launcher's teardown record must be empty (it had to kill nothing and remove no
    segment that the run's own processes should have cleaned up: see `phoenixft.runtime.launcher`), and,
    independently of the launcher, /proc holds no process naming the run id and /dev/shm no file
    of the run."""
    kw = suite_config(kw)
    kw.setdefault("timeout", 240.0)
    if kw.get("spares", 1) and kw.get("protect", "phoenix") == "phoenix" and kw.get("inject"):
        # a node fault at a step waits (bounded) until the job is whole, i.e. its spares are warm:
        # the tests assert a hot-swap, not a race between the fault and a spare's start-up
        kw["inject"] = [f"{x},wait=60" if x.startswith(("kill:node", "kill:rack", "hang:")) and "@step=" in x
                        and "phase=recovery" not in x and "wait=" not in x else x for x in kw["inject"]]
    cfg = RunConfig(**kw, run_dir=str(tmp), quiet=True)
    cfg.validate()
    report = run_job(cfg, Display(quiet=True, steps=cfg.steps))
    assert report.get("teardown") == {"killed": [], "removed_segments": []}, \
        f"teardown had to clean up after the run: {report.get('teardown')}"
    run_id = report.get("run_id") or ""
    assert run_id, report
    assert processes_with(run_id) == [], "processes outlived the run"
    assert sorted(Path("/dev/shm").glob(f"phoenixft-{run_id}[-.]*")) == [], "shared memory outlived the run"
    return report


def assert_one_hotswap(rep: dict[str, Any], dead: list[str], step: int) -> dict[str, Any]:
    """The run's one injected kill (at `step`, before that step committed) fired and bit: nothing in
    `faults_not_fired`, exactly one recovery, a permanent failure of `dead` answered by a hot-swap onto
    the spare, resuming from the step before the kill or the one before that (lost steps 0 or 1), with
    I1..I4 all true. Returns that recovery. (A fault that never fired leaves a clean run, which a
    comparison with a clean run alone cannot tell apart.)"""
    assert rep["faults_not_fired"] == [], rep["faults_not_fired"]
    assert len(rep["faults"]) == 1, rep["faults"]
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    (rec,) = rep["recoveries"]
    assert rec["class"] == "permanent" and rec["dead"] == dead and rec["promoted"] == ["s0"], rec
    assert rec["faults"] == [rep["faults"][0]["spec"]] and rec["fault_step"] == step, rec
    assert rec["resumed_step"] in (step - 2, step - 1) and rec["lost_steps"] in (0, 1), rec
    assert rec["resumed_step"] + rec["lost_steps"] == step - 1, rec  # every step before the kill committed
    assert all(rec["invariants"].get(k) is True for k in ("I1", "I2", "I3", "I4")), rec["invariants"]
    return rec


_refs: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Failure-free, unprotected reference runs, cached for the session per configuration: the key is the
    whole configuration with its defaults filled in, so `model="tiny"` and no model share one run. Under
    pytest-xdist the workers of one session share the cache: the first worker to need a configuration runs
    it (the others wait on its lock file) and leaves its report in the session's common temporary folder."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent / "references" if worker else None

    def get(**kw: Any) -> dict[str, Any]:
        kw = suite_config(kw)
        key = RunConfig(**kw).to_json()
        if key in _refs:
            return _refs[key]
        if shared is None:
            _refs[key] = _reference_run(tmp_path_factory, kw)
            return _refs[key]
        import fcntl
        import hashlib
        import json

        shared.mkdir(exist_ok=True)
        name = hashlib.sha256(key.encode()).hexdigest()[:24]
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes, also if this test fails)
            done = shared / f"{name}.json"
            if done.exists():
                _refs[key] = json.loads(done.read_text())
            else:
                _refs[key] = _reference_run(tmp_path_factory, kw)
                tmp = done.with_suffix(f".{worker}.tmp")
                tmp.write_text(json.dumps(_refs[key]))
                tmp.rename(done)
        return _refs[key]

    return get


def _reference_run(tmp_path_factory: pytest.TempPathFactory, kw: dict[str, Any]) -> dict[str, Any]:
    rep = run(tmp_path_factory.mktemp("ref"), protect="none", spares=0, **kw)
    assert rep["state"] == "done", rep
    return rep


@pytest.fixture
def auto_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device auto` resolved by what this host has, as outside the suite."""
    monkeypatch.delenv("PHOENIXFT_AUTO_DEVICE", raising=False)


class FakeGroup:
    """A process group's `size()` and `rank()` only: for argument checks made before any collective."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Any, world: int, timeout_s: float = 120.0) -> dict[int, Any]:
    """Run `target(rank, world, port, queue)` in `world` fresh processes (a TCPStore port free on
    127.0.0.1 for them); each puts (rank, result) on the queue. Returns {rank: result}; every
    process is joined, or killed, before it returns. The processes are forked from a server process that
    imported torch once for the session (multiprocessing's forkserver, as the runtime's zygote does),
    not each spawned to import it again (about 2 s of CPU each)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # (before its first start; later: no effect)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout_s) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class TwoPassGather:
    """The train group's all-gather for ranks called one after another (unit tests of the invariant
    check): the first pass records each rank's row, in rank order, the second hands every rank the
    rows of all."""

    def __init__(self) -> None:
        import torch

        self.rows: list[torch.Tensor] = []
        self.full: torch.Tensor | None = None

    def _allgather_base(self, out: Any, mine: Any) -> None:
        if self.full is None:
            self.rows.append(mine.clone())
            out.zero_()
        else:
            out.copy_(self.full)


def wait_while_running(what: str, fn: Any, proc: subprocess.Popen[bytes], timeout_s: float) -> Any:
    """Poll `fn` until it returns something true (that value), failing if the run `proc` exits first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        assert proc.poll() is None, f"the run exited (code {proc.returncode}) while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


# the longest files first (their sums in a serial run, longest first): two xdist workers that take a file
# at a time end together when the short files come last, instead of one worker running a long file alone
_LONGEST_FIRST = ["test_hosts", "test_etcd", "test_failures", "test_hotswap", "test_mesh", "test_leaks",
                  "test_early_loss", "test_drain", "test_persistent", "test_recipe", "test_chaos",
                  "test_hostile_store", "test_health", "test_html_report", "test_control_plane", "test_tls",
                  "test_ec", "test_elastic", "test_stragglers", "test_integrity"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the files of `_LONGEST_FIRST` first, in its order; the order within a file kept."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).stem, len(rank)))  # (stable: ties keep their order)
@pytest.fixture(autouse=True)
def _no_run_key_left() -> Any:
    """Each test starts with no run key bound in this process (controlplane.sealed: a run in-process binds
    its own; a key left by an earlier test would make this one's unsealed values look forged)."""
    from phoenixft.controlplane import sealed

    sealed.unbind()
    yield
    sealed.unbind()
