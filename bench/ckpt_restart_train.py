"""The alternative a user has today: DDP + torch.optim.AdamW + torch.distributed.checkpoint (DCP).

The same GPT as phoenixft (`phoenixft.train.gpt.GPT(PRESETS[m])` built under `torch.manual_seed(seed)`),
the same batches (`batch(step, rank)` of phoenixft's workload: rank r trains microbatch r of each
step, exactly what phoenixft's ranks do with one microbatch per worker), the same AdamW
hyper-parameters (betas 0.9/0.95, eps 1e-8), gloo, plain `DistributedDataParallel`, and, like
phoenixft's step, one all-reduce of the loss for logging. Launched by torchrun:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 1 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT bench/ckpt_restart_train.py \
        --model tiny --steps 30 --ckpt-dir /tmp/ck --ckpt-every 10 --kill-at-step 17 \
        --marker /tmp/ck/killed.json --step-log /tmp/ck/steps.jsonl

Two uses:
- checkpoint-restart (bench/recovery.py): a synchronous `dcp.save` every `--ckpt-every` K steps
  (after steps offset, offset+K, ...; `latest` names the newest complete one), `dcp.load` of the
  latest on start; at `--kill-at-step S` rank `--kill-rank` SIGKILLs itself once (a marker file
  makes it fire once), after the forward pass of step S, like phoenixft's `phase=backward`;
  torchrun --max-restarts then tears every process down and relaunches the job, which loads the
  last checkpoint and replays the lost steps.
- per-step cost (bench/overhead.py): `--schedule plain:8,sync:8,async:8` cycles segments of
  steps without a save, with `dcp.save` every step, and with `dcp.async_save` every step (the
  previous async save is waited for before the next starts), all in one run, interleaved.
  Saves go to local disk (`--ckpt-dir`), on a dedicated gloo group.

Rank 0 appends one JSON line per step to `--step-log` ({step, t_end, dt, compute_s, save_s, loss,
mode, attempt}) and one `start` line per launch (process start, after import torch, after the
process group, after the model, after dcp.load), which is what the harness measures from.
"""

from __future__ import annotations

import time

T_PROC_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def parse_schedule(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        mode, n = part.split(":")
        if mode not in ("plain", "sync", "async"):
            raise SystemExit(f"--schedule: unknown mode {mode!r} (plain, sync, async)")
        out.append((mode, int(n)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20, help="total steps (ignored with --schedule)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0, help="0 = cores / world, at least 1 (as phoenixft)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="torch.optim.AdamW(fused=True) instead of the default (the single-tensor path on CPU; "
                         "phoenixft's AdamW runs the fused kernel)")
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--ckpt-every", type=int, default=0, help="K: persistent checkpoint every K steps (0 = never)")
    ap.add_argument("--ckpt-offset", type=int, default=1, help="first checkpoint after this step")
    ap.add_argument("--schedule", default="", help="e.g. plain:8,sync:8,async:8 (per-step cost mode)")
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--marker", default="")
    ap.add_argument("--step-log", required=True)
    a = ap.parse_args()

    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*existing checkpoint.*")

    t_imported = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ckpt_pg = dist.new_group(backend="gloo")  # saves never share a group with the training collectives
    t_pg = time.time()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phoenixft.data import _mix
    from phoenixft.train.gpt import GPT, PRESETS
    from phoenixft.train.gpt import workload as gpt_workload
    from phoenixft.workload import WorkloadContext

    wl = gpt_workload(WorkloadContext(seed=a.seed, micro_batch=a.micro_batch, model=a.model))
    torch.manual_seed(a.seed)
    model = GPT(PRESETS[a.model])
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay,
                            fused=True if a.fused_adamw else None)
    t_model = time.time()

    ckpt_dir = Path(a.ckpt_dir) if a.ckpt_dir else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    logf = open(a.step_log, "a") if rank == 0 else None  # noqa: SIM115

    def emit(rec: dict[str, Any]) -> None:
        if logf is not None:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    start = 0
    load_s = 0.0
    if ckpt_dir is not None and a.ckpt_every and (ckpt_dir / "latest").exists():
        start = int((ckpt_dir / "latest").read_text())
        t0 = time.time()
        sd = state()
        dcp.load(sd, checkpoint_id=str(ckpt_dir / f"step-{start:06d}"), process_group=ckpt_pg)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        load_s = time.time() - t0
    t_loaded = time.time()
    emit(
        {
            "event": "start",
            "attempt": attempt,
            "world": world,
            "resume_from": start,
            "t_proc_start": T_PROC_START,
            "t_imported": t_imported,
            "t_pg": t_pg,
            "t_model": t_model,
            "t_loaded": t_loaded,
            "load_s": load_s,
        }
    )

    if a.schedule:
        plan = [m for mode, n in parse_schedule(a.schedule) for m in [mode] * n]
    else:
        plan = ["plain"] * a.steps
    pending: Any = None
    for s in range(start + 1, len(plan) + 1):
        mode = plan[s - 1]
        t0 = time.perf_counter()
        ddp.train()
        opt.zero_grad()
        torch.manual_seed(_mix(a.seed, s, rank))
        loss = wl.loss(ddp, wl.batch(s, rank))
        if s == a.kill_at_step and rank == a.kill_rank and a.marker and not os.path.exists(a.marker):
            with open(a.marker, "w") as f:
                f.write(json.dumps({"t": time.time(), "step": s, "rank": rank, "attempt": attempt}))
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        t_bwd = time.perf_counter()
        lt = loss.detach().reshape(1).double()
        w = dist.all_reduce(lt, async_op=True)
        opt.step()
        w.wait()
        t_c = time.perf_counter()
        if mode == "sync":
            dcp.save(state(), checkpoint_id=str(ckpt_dir / "every-step"), process_group=ckpt_pg)  # type: ignore[operator]
        elif mode == "async":
            if pending is not None:
                pending.result()
            pending = dcp.async_save(
                state(),
                checkpoint_id=str(ckpt_dir / "every-step"),  # type: ignore[operator]
                process_group=ckpt_pg,
            )
        elif ckpt_dir is not None and a.ckpt_every and s >= a.ckpt_offset and (s - a.ckpt_offset) % a.ckpt_every == 0:
            dcp.save(state(), checkpoint_id=str(ckpt_dir / f"step-{s:06d}"), process_group=ckpt_pg)
            if rank == 0:
                tmp = ckpt_dir / "latest.tmp"
                tmp.write_text(str(s))
                os.replace(tmp, ckpt_dir / "latest")
                for old in sorted(ckpt_dir.glob("step-*"))[:-2]:
                    shutil.rmtree(old, ignore_errors=True)
        nxt = plan[s] if s < len(plan) else None
        if pending is not None and nxt != "async":  # an async segment pays for its last save
            pending.result()
            pending = None
        t_end = time.perf_counter()
        emit(
            {
                "step": s,
                "t_end": time.time(),
                "dt": t_end - t0,
                "compute_s": t_c - t0,
                "fwd_bwd_s": t_bwd - t0,  # DDP's all-reduces overlap backward and finish inside it
                "optimizer_s": t_c - t_bwd,
                "save_s": t_end - t_c,
                "loss": float(lt) / world,
                "mode": mode,
                "attempt": attempt,
            }
        )
    if pending is not None:
        pending.result()
    dist.barrier()
    dist.destroy_process_group()
    if logf is not None:
        logf.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
