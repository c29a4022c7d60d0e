"""How a CUDA worker's host and process are set up, checked on CPU through the device seam: the
placement of a host's workers over its GPUs, the device decided on the host where the workers run,
the NCCL settings a survivor needs whatever the environment held, deterministic kernels, snapshot
halves pinned only with protection, the /dev/shm check, and the GPU check's dry run."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tarfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from phoenixft.config import RunConfig
from phoenixft.distributed import cuda_env, device
from phoenixft.distributed.cuda_env import (
    apply_determinism,
    apply_nccl_env,
    determinism_settings,
    local_workers,
    nccl_env,
    nccl_overrides,
    override_line,
    placement_line,
    plan_gpus,
)
from phoenixft.distributed.device import Device, check_device_here, gpu_slot
from phoenixft.errors import UserError
from phoenixft.protect.snapshot import ShardState
from phoenixft.runtime import hostcheck

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- placement
def _layouts(total: int) -> list[tuple[int, int, int]]:
    """Every (nodes, spares, workers per node) with `total` workers."""
    return [(n, s, g) for g in range(1, total + 1) for n in range(1, total + 1) for s in range(0, total)
            if (n + s) * g == total]


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("total", range(2, 10))
def test_the_plan_never_puts_two_workers_on_one_gpu_of_one_host_identity(gpus: int, total: int) -> None:
    for nodes, spares, g in _layouts(total):
        workers = local_workers(nodes, spares, g)
        assert len(workers) == total
        plan = plan_gpus(gpus, workers)
        assert set(plan) == set(workers)
        assert all(0 <= slot.gpu < gpus for slot in plan.values())
        # NCCL's duplicate-GPU check: (host identity, GPU) must differ for any two workers
        ident = {(slot.gpu, w if slot.own_host else "host") for w, slot in plan.items()}
        assert len(ident) == total, (nodes, spares, g, plan)
        per_gpu = [sum(1 for s in plan.values() if s.gpu == i) for i in range(gpus)]
        assert max(per_gpu) - min(per_gpu) <= 1, per_gpu  # spread evenly
        if total <= gpus:  # a GPU each, every worker with the host's own identity (NVLink / shared memory)
            assert len({s.gpu for s in plan.values()}) == total and not any(s.own_host for s in plan.values())
        else:
            assert sum(s.own_host for s in plan.values()) == total - gpus
            assert placement_line(gpus, total) is not None
        shuffled = list(workers)
        random.Random(total * 31 + gpus).shuffle(shuffled)
        assert plan_gpus(gpus, shuffled) == plan  # deterministic: whatever order the workers are listed in
        for w, slot in plan.items():  # what each worker computes alone agrees with the plan
            assert gpu_slot(w[1], w[0], nodes, g, gpus, "spread") == slot


def test_the_plan_orders_active_nodes_first_and_agrees_on_late_spares() -> None:
    plan = plan_gpus(8, local_workers(2, 1, 2))
    assert [plan[w].gpu for w in [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1), ("s0", 0), ("s0", 1)]] == list(range(6))
    # a repaired spare s3 (beyond the configured ones) takes the slot after s0..s2, as the others see it
    assert gpu_slot(0, "s3", 2, 1, 8, "spread") == (5, False)
    assert gpu_slot(0, "s3", 2, 1, 4, "spread") == (1, True)
    with pytest.raises(ValueError, match="no GPU"):
        plan_gpus(0, [("n0", 0)])


def test_the_placement_line_is_one_line_naming_the_counts() -> None:
    assert placement_line(8, 3) is None and placement_line(2, 2) is None
    line = placement_line(1, 3)
    assert line is not None and "\n" not in line and line.startswith("3 workers on 1 GPU(s)") and "NCCL_HOSTID" in line


def test_a_local_run_spreads_its_workers_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig(device="cuda", nodes=2, spares=1)
    monkeypatch.setattr(device, "visible_gpus", lambda: 1)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    assert hostcheck.local_notes(cfg, {}) == [placement_line(1, 3)]
    notes = hostcheck.local_notes(cfg, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert len(notes) == 2 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 -> 0" in notes[1]
    assert hostcheck.local_notes(RunConfig(device="cpu"), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) == []


# ---------------------------------------------------------------------------------------------- NCCL settings
@pytest.mark.parametrize("preset", ["1", "2", "3"])
def test_nccl_values_that_kill_a_survivor_are_replaced_and_named(preset: str) -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": preset, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_NCCL_ENABLE_MONITORING": "1", "NCCL_ASYNC_ERROR_HANDLING": preset, "NCCL_DEBUG": "WARN"}
    over = nccl_overrides(env)
    assert over == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": (preset, "0"), "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", "0"),
                    "TORCH_NCCL_ENABLE_MONITORING": ("1", "0"), "NCCL_ASYNC_ERROR_HANDLING": (preset, "0")}
    line = override_line(over)
    assert line is not None and "\n" not in line and f"TORCH_NCCL_ASYNC_ERROR_HANDLING={preset} -> 0" in line
    apply_nccl_env(env, "n0", 0)
    assert {k: env[k] for k in nccl_env()} == nccl_env() and env["NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert env["NCCL_DEBUG"] == "WARN"  # not ours: left alone
    assert nccl_overrides(env) == {} and override_line({}) is None


def test_acceptable_user_values_are_kept() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert nccl_overrides(env) == {}
    apply_nccl_env(env, "n0", 0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_the_agent_sets_them_for_its_workers_and_says_so_once() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    line = hostcheck.prepare_nccl(env)
    assert line is not None and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 -> 0" in line
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and "NCCL_HOSTID" not in env
    assert hostcheck.prepare_nccl(env) is None  # nothing of the user's left to replace


# ---------------------------------------------------------------------------------------------- determinism
def test_determinism_settings_for_a_cuda_worker() -> None:
    d = determinism_settings({})
    assert d.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert d.deterministic_algorithms and d.warn_only is False  # only then does torch force deterministic kernels
    assert not d.cudnn_benchmark and d.cudnn_deterministic
    assert d.sdpa == {"enable_flash_sdp": False, "enable_mem_efficient_sdp": False, "enable_cudnn_sdp": False,
                      "enable_math_sdp": True}
    assert all(hasattr(torch.backends.cuda, name) for name in d.sdpa)  # the names torch has
    assert determinism_settings({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}).env == {}  # deterministic too: kept
    assert determinism_settings({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}).env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _recording_torch() -> tuple[Any, list[tuple[Any, ...]]]:
    calls: list[tuple[Any, ...]] = []
    cuda = SimpleNamespace(**{n: (lambda on, n=n: calls.append((n, on))) for n in determinism_settings({}).sdpa})
    fake = SimpleNamespace(use_deterministic_algorithms=lambda mode, warn_only: calls.append(("det", mode, warn_only)),
                           backends=SimpleNamespace(cudnn=SimpleNamespace(benchmark=True, deterministic=False),
                                                    cuda=cuda))
    return fake, calls


def test_apply_determinism_sets_the_environment_and_every_flag() -> None:
    fake, calls = _recording_torch()
    env: dict[str, str] = {}
    apply_determinism(determinism_settings(env), env, fake)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert ("det", True, False) in calls
    assert ("enable_flash_sdp", False) in calls and ("enable_mem_efficient_sdp", False) in calls
    assert ("enable_cudnn_sdp", False) in calls and ("enable_math_sdp", True) in calls
    assert fake.backends.cudnn.benchmark is False and fake.backends.cudnn.deterministic is True


def test_placing_a_cuda_worker_sets_up_its_process_before_cuda(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`place("cuda")` on a host with one GPU and three workers, through the seam: the environment
    (cuBLAS, NCCL, the worker's own host identity) is set before the first CUDA call; deterministic
    algorithms without warn_only; the GPU the plan gives it."""
    fake, calls = _recording_torch()
    monkeypatch.setattr(device, "apply_determinism", lambda d, env, _t: apply_determinism(d, env, fake))
    monkeypatch.setattr(device, "check_device_here", lambda kind, where: "cuda")
    seen: dict[str, Any] = {}

    def first_cuda_call() -> None:
        seen["env"] = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}

    monkeypatch.setattr(device, "cuda_unavailable", lambda: first_cuda_call())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("gpu", i))
    for k in (*nccl_env(), "CUBLAS_WORKSPACE_CONFIG", "NCCL_HOSTID", "LOCAL_RANK", cuda_env.HOSTID_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv(cuda_env.PLACEMENT_ENV, "spread")
    d = device.place("cuda", 0, "s0", 2, 1)  # the third worker of n0, n1, s0 on one GPU
    assert d.is_cuda and d.index == 0 and d.backend == "nccl" and seen["gpu"] == 0
    assert seen["env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and os.environ["NCCL_HOSTID"] == "phoenixft-s0.0"
    assert ("det", True, False) in calls and ("enable_flash_sdp", False) in calls
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 -> 0" in out
    monkeypatch.delenv("NCCL_HOSTID")
    assert device.place("cuda", 0, "n0", 2, 1).index == 0 and "NCCL_HOSTID" not in os.environ  # slot 0: the host's


# ------------------------------------------------------------------------------------- where the device is decided
def test_the_head_publishes_auto_and_does_not_refuse_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from phoenixft.runtime.launcher import check_mode

    monkeypatch.setattr(device, "visible_gpus", lambda: 0)
    cfg = RunConfig(device="auto", nodes=2)
    assert '"device": "auto"' in cfg.to_json()
    cuda = RunConfig(device="cuda", nodes=2)
    cuda.validate()  # a CPU-only head: the GPUs are on the agents' hosts
    check_mode(cuda, local=False)
    with pytest.raises(UserError, match=r"^--device=cuda is invalid on this host: .*use --device cpu"):
        check_mode(cuda, local=True)  # `phoenixft run`: every worker runs here


def test_the_agent_decides_the_device_for_its_host(monkeypatch: pytest.MonkeyPatch, auto_device: None) -> None:
    from phoenixft.runtime import agent

    cfg = RunConfig(device="cuda", nodes=2)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(device, "visible_gpus", lambda: 0)  # a CPU-only agent
    with pytest.raises(UserError) as e:
        agent._prepare_host(cfg, "n1")
    assert str(e.value).startswith("--device=cuda is invalid on this host (node n1): no CUDA device is visible")
    assert "\n" not in str(e.value)
    assert check_device_here("auto") == "cpu"
    for k in nccl_env():
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(device, "visible_gpus", lambda: 2)  # a GPU agent: auto is cuda there, NCCL set up
    assert check_device_here("auto") == "cuda"
    agent._prepare_host(RunConfig(device="auto", nodes=2, workers_per_node=1), "n1")
    assert {k: os.environ[k] for k in nccl_env()} == nccl_env()


def test_gpus_are_counted_without_cuda_here_and_without_a_child_where_no_gpu_can_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's count where it answers; where it does not (no driver library) and the host has no device file
    a GPU is reached through, none: PyPI's torch is a CUDA build, and on a CPU-only host a child importing
    torch to ask cost every launch, agent and worker seconds. With a device file, the child asks."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 4, raising=False)
    assert device.visible_gpus() == 4
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1, raising=False)
    asked: list[list[str]] = []

    def child(cmd: list[str], **kw: Any) -> Any:
        asked.append(cmd)
        return SimpleNamespace(returncode=0, stdout="2\n")

    monkeypatch.setattr(device.subprocess, "run", child)
    files: list[str] = []
    monkeypatch.setattr(device.glob, "glob", lambda pattern: [f for f in files if f.startswith(pattern[:-1])])
    monkeypatch.setattr(device.os.path, "exists", lambda path: path in files)
    assert device.visible_gpus() == 0 and asked == [], "a child asked where no GPU can be"
    for f in ("/dev/nvidiactl", "/dev/nvhost-ctrl-gpu", "/dev/dxg"):
        files[:] = [f]
        asked.clear()
        assert device.visible_gpus() == 2 and len(asked) == 1, f


# ---------------------------------------------------------------------------------------------- memory
class _PinRecorder(Device):
    """A CPU device that says it is CUDA for the snapshot's pinning decision and records what it pins."""

    def __init__(self) -> None:
        super().__init__("cpu", mirror=True)
        self.is_cuda = True
        self.pinned: list[int] = []

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        self.pinned.append(t.numel())
        return t


def test_halves_are_pinned_only_when_protection_keeps_them(tmp_path: Path) -> None:
    d = _PinRecorder()
    ShardState(16, None, rows=2, device=d)  # --protect none: nothing is copied out into these
    assert d.pinned == []
    ShardState(16, str(tmp_path / "s"), rows=2, device=d)  # protection's shared-memory halves
    assert d.pinned == [2 * 2 * 16]
    ShardState(16, str(tmp_path / "t"), rows=2, device=d, pin=False)
    assert len(d.pinned) == 1


def test_shm_check_refuses_in_one_line_naming_the_size_and_the_docker_flag() -> None:
    with pytest.raises(UserError) as e:
        hostcheck.check_shm(300 * 2**20, 64 * 2**20, "this host")
    msg = str(e.value)
    assert "\n" not in msg and "64.0 MiB free" in msg and "300.0 MiB" in msg and "--shm-size=1g" in msg
    with pytest.raises(UserError, match="--shm-size=13g"):
        hostcheck.check_shm(10 * 2**30, 2**30, "this host")
    hostcheck.check_shm(64 * 2**20, 64 * 2**20, "this host")  # fits exactly
    hostcheck.check_shm(10, None, "this host")  # no /dev/shm to ask: nothing to say


def test_shm_needed_follows_protection_and_the_device() -> None:
    cfg = RunConfig(device="cpu", nodes=2, model="small")
    cpu, cuda = hostcheck.shm_needed(cfg, 3, False), hostcheck.shm_needed(cfg, 3, True)
    assert cpu > cuda > 0  # on CUDA the parameters live on the GPU, not in /dev/shm
    assert hostcheck.shm_needed(cfg, 6, True) == 2 * cuda
    assert hostcheck.shm_needed(RunConfig(device="cpu", nodes=2, protect="none"), 3, False) == 0


def test_a_local_run_without_room_in_dev_shm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from phoenixft.runtime.launcher import check_mode

    monkeypatch.setattr(hostcheck, "shm_free", lambda path=hostcheck.SHM: 64 * 2**20)
    with pytest.raises(UserError, match=r"/dev/shm on this host has 64.0 MiB free.*--shm-size="):
        check_mode(RunConfig(device="cpu", nodes=2, model="medium"), local=True)
    monkeypatch.setattr(hostcheck, "shm_free", lambda path=hostcheck.SHM: 2**30)
    check_mode(RunConfig(device="cpu", nodes=2, model="tiny"), local=True)  # tens of MiB: fits


def test_the_initial_master_copy_is_host_memory_and_can_be_freed() -> None:
    from phoenixft.train.zero import FlatModel

    flat = FlatModel(torch.nn.Linear(4, 3), shards=1)
    assert flat.init_master.device.type == "cpu" and flat.init_master.numel() == 15
    flat.release_init_master()
    assert flat.init_master.numel() == 0


# ---------------------------------------------------------------------------------------------- the GPU check
def _bench(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module(name)


def test_gpu_check_dry_run_plans_every_step_in_the_simulated_gpu_machine() -> None:
    """`--dry-run` on CPU in the GPU machine's constraints (torch 2.11 where `make test-oldest-torch` built it, no
    zfec, no network): every step with its budget and exact commands (their flags checked), the erasure-code step
    left out saying why, the whole plan within the default deadline, no machine path, nothing run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    sim = next(line for line in out.splitlines() if line.startswith("simulated GPU machine: "))
    assert "zfec" in sim and "cryptography" in sim and "no network but loopback" in sim
    if (ROOT / ".venv-torch-2.11.0" / "bin" / "python").exists():
        assert "torch 2.11.0" in sim, sim
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    names = [line.split()[2].rstrip(":") for line in steps]
    order = list(dict.fromkeys(names))
    assert order == ["hotswap-dp2", "probe", "hotswap-tp2", "hotswap-pp2", "hotswap-dp4", "bf16-256", "cuda-tests",
                     "overhead", "erasure-code"], order
    assert all(": budget " in s or ": would run: " in s or ": left out: " in s for s in steps), steps
    assert [s for s in steps if ": left out: " in s] == [
        "step 9 erasure-code: left out: zfec is missing (Reed-Solomon parity of --redundancy ec:D+H with H >= 2)"]
    text = " ".join(steps)
    for flag in ("--tp 2", "--pp 2", "--precision bf16", "--model medium", "--protect phoenix", "-m pytest",
                 "tests/test_cuda.py", "kill:node=1@step=6,phase=backward", "kill:node=2@step=6,phase=backward"):
        assert flag in text, flag
    assert "phase=optimizer" not in text
    kills = [s for s in steps if "--inject kill:" in s]
    assert len(kills) == 5 and all("--device cuda" in s for s in kills)  # every hot-swap on NCCL
    assert str(ROOT) not in out and sys.executable not in out  # no machine path
    assert re.search(r"planned, \d+ s of budget \+ 20 s reserve against a deadline of 480 s \(fits", out), out
    assert "nothing was run" in out


def test_gpu_check_names_a_missing_dependency_and_leaves_its_step_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    gpu_deps = _bench("gpu_deps", monkeypatch)
    gpu_check = _bench("gpu_check", monkeypatch)
    real = importlib.util.find_spec

    def blocked(*names: str) -> Any:
        def find(m: str) -> Any:
            if m in names:
                raise ModuleNotFoundError(m)  # (what the simulated machine's import hook does)
            return real(m)
        return find

    deps = gpu_deps.check(find=blocked("zfec", "pytest"))
    assert deps.missing == ["pytest", "zfec"] and deps.fatal == []
    lines = deps.lines()
    assert lines[0].startswith("dependencies: python ") and "torch " in lines[0]
    assert lines[1:] == ["missing: pytest (the CUDA tests)",
                         "missing: zfec (Reed-Solomon parity of --redundancy ec:D+H with H >= 2)"]
    why = {s.name: w for s, w in gpu_check.plan(gpu_check.parse([]), deps)}
    assert why["cuda-tests"] == "pytest is missing (the CUDA tests)"
    assert why["erasure-code"].startswith("zfec is missing")
    assert all(not w for n, w in why.items() if n not in ("cuda-tests", "erasure-code"))
    only = {s.name: w for s, w in gpu_check.plan(gpu_check.parse(["--only", "hotswap-dp2"]), deps)}
    assert only["hotswap-dp2"] == "" and only["overhead"] == "not asked for (--only)"
    assert gpu_deps.install_command("py", "/w", "zfec") == ["py", "-m", "pip", "install", "--no-index", "--no-deps",
                                                            "--find-links", "/w", "zfec"]
    assert gpu_deps.install_command("py", "/w", "torch") is None  # never over the machine's own
    for fatal in ("torch", "xxhash", "numpy"):
        d = gpu_deps.check(find=blocked(fatal))
        assert d.fatal == [fatal], d.missing
    assert "torch: missing" in gpu_deps.check(find=blocked("torch")).lines()[0]
    with pytest.raises(SystemExit):
        gpu_check.parse(["--only", "hotswap,overhead"])  # (a step name that does not exist: refused)


def test_the_package_imports_and_plans_with_only_torch_numpy_and_pytest() -> None:
    """What the GPU machine may lack is imported lazily: with every optional module hidden (zfec, cryptography,
    xxhash, safetensors, matplotlib, ...) `import phoenixft`, its command line and the launcher still import; a
    run then says in one line which module it needs (xxhash: snapshot checksums)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "gpu_sim_site"), str(ROOT / "src")]),
           "PHOENIXFT_SIM_MISSING": "zfec,cryptography,xxhash,safetensors,matplotlib,tensorboard,prometheus_client",
           "PHOENIXFT_SIM_OFFLINE": "1"}
    code = ("import phoenixft, phoenixft.cli.main, phoenixft.runtime.launcher, phoenixft.distributed.device\n"
            "try:\n    import xxhash\nexcept ModuleNotFoundError as e:\n    print('hidden:', e.name)\n"
            "import socket\ns = socket.socket()\ntry:\n    s.connect(('192.0.2.1', 80))\n"
            "except OSError as e:\n    print('offline:', e.errno)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "hidden: xxhash" in p.stdout and "offline: 101" in p.stdout, p.stdout


def test_gpu_check_saves_after_every_step_and_leaves_out_what_no_longer_fits(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The run loop, its steps replaced by stand-ins: the JSON is on disk with the step marked `running` while it
    runs, and with its result after it (the archive too); a step's harness error fails that step only; a step
    that no longer fits before the deadline is left out, saying so; the exit code says whether all that ran passed."""
    gpu_check = _bench("gpu_check", monkeypatch)
    gpu_steps = _bench("gpu_steps", monkeypatch)
    out = tmp_path / "out"
    seen: list[tuple[str, str, float]] = []
    clock = {"t": 1000.0}
    monkeypatch.setattr(gpu_check.time, "time", lambda: clock["t"])

    def fake(s: Any, c: Any, cap_s: float) -> tuple[bool, str, dict[str, Any]]:
        saved = json.loads((out / "gpu_check.json").read_text())
        seen.append((s.name, saved["steps"][-1]["status"], cap_s))
        (c.work / s.name).mkdir(parents=True, exist_ok=True)
        (c.work / s.name / "log.txt").write_text(s.name)
        clock["t"] += s.est_s
        if s.name == "hotswap-tp2":
            raise RuntimeError("boom")
        return True, f"{s.name} ok", {"n": 1}

    monkeypatch.setattr(gpu_steps, "run_step", fake)
    rc = gpu_check.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"), "--t0", "1000",
                         "--deadline", "170", "--step-cap", "60"])
    assert rc == 1
    res = json.loads((out / "gpu_check.json").read_text())
    status = {e["name"]: (e["status"], e.get("detail", "")) for e in res["steps"]}
    assert [x[:2] for x in seen] == [("hotswap-dp2", "running"), ("hotswap-tp2", "running"), ("hotswap-pp2", "running")]
    assert [e["name"] for e in res["steps"]][:2] == ["hotswap-dp2", "probe"]  # the most informative first
    assert all(cap <= 60 for _, _, cap in seen)
    assert status["probe"][0] == "left out" and "CUDA" in status["probe"][1]
    assert status["hotswap-dp2"] == ("rehearsed", "hotswap-dp2 ok")
    assert status["hotswap-tp2"][0] == "fail" and "harness error: RuntimeError: boom" in status["hotswap-tp2"][1]
    assert status["hotswap-dp4"][0] == "left out" and status["hotswap-dp4"][1].startswith("out of time: ")
    assert res["complete"] is True and res["pass"] is False and "_t0" not in res
    names = tarfile.open(out / "runs.tar.gz").getnames()
    assert "work/hotswap-pp2/log.txt" in names and res["archive"]["files"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "runs.tar.gz"]


def test_gpu_check_without_cuda_writes_its_verdict_into_out(tmp_path: Path) -> None:
    """The GPU check on a machine whose torch sees no GPU: exit 1, one FAIL line, and the verdict in DIR, which
    is what comes back from a device machine."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env={**env, "PYTHON": sys.executable})
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "FAIL: environment: no CUDA device visible to this torch: this is not a GPU run" in out, out
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["pass"] is False and res["environment_error"] == "no CUDA device visible to this torch"
    assert res["kind"] == "GPU check" and res["steps"] == []


_NCCL_LOG = """\
gpu1:4242:4242 [0] NCCL INFO Bootstrap: Using lo:127.0.0.1<0>
gpu1:4242:4242 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
gpu1:4242:4260 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
gpu1:4242:4260 [0] NCCL INFO Using network Socket
gpu1:4242:4260 [0] NCCL INFO comm 0x55d5c0 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
gpu1:4242:4260 [0] NCCL INFO Channel 00/02 : 0 1
gpu1:4242:4260 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
gpu1:4242:4260 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
gpu1:4242:4260 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/Socket/1
"""


def test_the_nccl_transport_is_read_from_nccls_own_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _bench("gpu_evidence", monkeypatch)
    assert ev.nccl_env(tmp_path)["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl.%h.%p.log")
    assert ev.nccl_summary(tmp_path)["verdict"].startswith("no NCCL log was written")
    (tmp_path / "kill").mkdir()
    (tmp_path / "kill" / "nccl.gpu1.4242.log").write_text(_NCCL_LOG)
    s = ev.nccl_summary(tmp_path)
    assert s["versions"] == ["2.28.9+cuda13.0"] and s["networks"] == ["Socket"] and s["log_files"] == 1
    assert s["connections"] == {"NET/Socket": 3}
    assert s["communicators"] == {"2 ranks on 2 node(s), 1 per node": 1}
    assert s["verdict"].startswith("connections via NET/Socket; not exercised: P2P, SHM, NVLS")
    (tmp_path / "kill" / "nccl.gpu1.4243.log").write_text(
        "x [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "x [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n")
    s = ev.nccl_summary(tmp_path)
    assert s["connections"] == {"NET/Socket": 3, "P2P/CUMEM": 1, "SHM": 1}
    assert s["verdict"] == "connections via NET/Socket, P2P/CUMEM, SHM; not exercised: NVLS (NVLink/P2P need ranks " \
                           "on distinct GPUs of one host identity)"


def test_the_timed_copies_are_summarised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _bench("gpu_evidence", monkeypatch)
    path = tmp_path / "timing.jsonl"
    assert ev.timing_summary(path)["copies"] == 0
    recs = [{"copy": i, "bytes": 4 << 20, "pinned": i != 4, "copy_ms": 0.2 + i / 100, "step_ms": 5.0,
             "overlapped": i != 5, "gb_per_s": 20.0, "end_ms": 0.3} for i in range(3, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = ev.timing_summary(path)
    assert s["copies"] == 3 and s["pinned"] == 2 and s["overlapped"] == 2 and s["copy_ms_median"] == 0.24
    assert s["verdict"] == ("2/3 copies into pinned host memory; 2/3 ended inside the next step of the compute stream "
                            "(copy 0.240 ms, step 5.000 ms)")


def test_the_archive_leaves_out_models_and_secrets_and_stays_under_its_limit(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ev = _bench("gpu_evidence", monkeypatch)
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "step" / "run" / "final").mkdir(parents=True)
    (work / "step" / "run" / "logs").mkdir()
    out.mkdir()
    (work / "step" / "run" / "final" / "model.safetensors").write_bytes(os.urandom(1000))
    (work / "step" / "run" / "token").write_text("secret")
    (work / "step" / "run" / "logs" / "n0.log").write_text("hello\n" * 10)
    (work / "step" / "big.bin").write_bytes(os.urandom(200_000))
    (work / "step" / "mid.bin").write_bytes(os.urandom(50_000))
    got = ev.pack(work, out, limit=120_000)
    assert got["left_out"] == ["work/step/big.bin"] and got["files"] == 2 and got["bytes"] <= 120_000
    names = tarfile.open(out / "runs.tar.gz").getnames()
    assert sorted(names) == ["work/step/mid.bin", "work/step/run/logs/n0.log"]
    ev.write_json(out / "r.json", {"a": 1})
    assert json.loads((out / "r.json").read_text()) == {"a": 1} and sorted(p.name for p in out.iterdir()) == [
        "r.json", "runs.tar.gz"]


def test_gpu_check_rehearsal_runs_the_harness_end_to_end_on_cpu(tmp_path: Path) -> None:
    """`--rehearse`: the GPU check's own logic (runs side by side, reports, hash comparison, the NCCL and timing
    summaries, the overhead ratio, packing) on CPU in the simulated GPU machine; NOT a GPU result."""
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--rehearse", "--out", str(out), "--work",
                        str(tmp_path / "work"), "--only", "hotswap-dp2,cuda-tests,overhead", "--deadline", "600"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gpu_check rehearsal on CPU (NOT a GPU result): PASS" in p.stdout
    res = json.loads((out / "gpu_check.json").read_text())
    steps = {e["name"]: e for e in res["steps"]}
    assert res["pass"] and res["kind"].startswith("CPU rehearsal")
    dp2 = steps["hotswap-dp2"]
    assert dp2["status"] == "rehearsed" and dp2["final_sha"] == dp2["reference_sha"]
    assert [r["action"] for r in dp2["recoveries"]] == ["hotswap"] and dp2["faults_not_fired"] == []
    assert steps["overhead"]["ratio"] > 0 and len(set(steps["overhead"]["final_sha"].values())) == 1
    assert steps["cuda-tests"]["status"] == "rehearsed" and "skipped" in steps["cuda-tests"]["summary"]
    names = tarfile.open(out / "runs.tar.gz").getnames()
    assert "work/hotswap-dp2/kill/report.json" in names and "work/hotswap-dp2/kill/logs/n1.log" in names
    assert not any("/final/" in n or n.endswith("/token") for n in names)


def test_a_refused_registration_leaves_the_halves_pageable_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A sandbox may refuse `cudaHostRegister` of shared memory: the run goes on with pageable halves (their copy
    synchronous), saying so in one line per process, instead of failing every worker."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(
        cudaHostRegister=lambda ptr, n, flags: calls.append((ptr, n)) or 801))
    monkeypatch.setattr(Device, "_pin_failed", False)
    d = Device("cpu", wid="n1.0")
    d.is_cuda = True  # (the pinning decision of a CUDA device, on a CPU)
    a = device.alloc(4096, torch.float32, str(tmp_path / "a"))
    b = device.alloc(4096, torch.float32, str(tmp_path / "b"))
    assert d.pin(a) is a and d.pin(b) is b and not a.is_pinned() and len(calls) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("phoenixft n1.0: cudaHostRegister of 16384 bytes") and \
        "cudaError 801" in out and "pageable" in out


def test_the_torch_apis_the_cuda_path_calls_exist_in_this_torch() -> None:
    """Every torch attribute the CUDA path and the GPU check call, present in this torch (where it is a CUDA
    build: PyPI's torch 2.11.0+cu130 in `make test-oldest-torch`, the GPU image's version): a renamed or
    missing one fails here, on CPU, not in the one GPU run."""
    import torch.distributed as dist

    if not torch.backends.cuda.is_built():
        pytest.skip(f"this torch ({torch.__version__}) is built without CUDA")
    need = {
        torch.cuda: ["Stream", "Event", "stream", "current_stream", "set_device", "cudart", "_device_count_nvml",
                     "get_device_properties", "device_count", "is_available", "synchronize", "default_generators"],
        torch.cuda.nccl: ["version"],
        torch._C._cudart: ["cudaHostRegister", "cudaHostUnregister"],
        dist: ["ProcessGroupNCCL", "ProcessGroupGloo", "PrefixStore", "HashStore", "TCPStore", "Work"],
        dist.ProcessGroupNCCL: ["Options", "allreduce", "reduce", "broadcast", "_allgather_base", "abort",
                                "eager_connect_single_device", "_set_sequence_number_for_group",
                                "get_runtime_nccl_version", "size", "rank"],
        dist.Work: ["is_completed", "block_current_stream", "get_future", "wait"],
        torch.backends.cuda: ["enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp"],
    }
    missing = [f"{getattr(mod, '__name__', mod)}.{name}" for mod, names in need.items() for name in names
               if not hasattr(mod, name)]
    assert missing == [], missing
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=5)  # (settable: the epoch groups' op timeout)
    import inspect

    assert "priority" in inspect.signature(torch.cuda.Stream.__new__).parameters
    assert "enable_timing" in inspect.signature(torch.cuda.Event.__new__).parameters
