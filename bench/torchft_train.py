"""The peer system: one torchft (PyPI 0.2.0) replica group training phoenixft's GPT.

Each replica group is one process here (group world size 1); N of them meet at a torchft
lighthouse (`torchft_lighthouse`) and average gradients with `manager.allreduce` (not
`torchft.DistributedDataParallel`: in 0.2.0 its comm hook asserts and crashes the survivors on
gloo when a peer dies inside an all-reduce). Same model (`GPT(PRESETS[m])` under
`torch.manual_seed(seed)`), same batches (`batch(step, replica_rank)` of phoenixft's workload),
same AdamW hyper-parameters as phoenixft. The quorum is synchronous (`use_async_quorum=False`)
so that a healing replica loads the peer's state before its forward pass.

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:PORT &
    python bench/torchft_train.py --replica-id 0 --lighthouse http://127.0.0.1:PORT \
        --model tiny --steps 30 --step-log /tmp/tf/r0.jsonl &
    python bench/torchft_train.py --replica-id 1 --lighthouse http://127.0.0.1:PORT \
        --model tiny --steps 30 --step-log /tmp/tf/r1.jsonl --kill-at-step 10 --marker /tmp/tf/killed.json

`--barrier-dir` makes first launches start training together; `--stop-file` ends every
replica at its next step boundary. With `--kill-at-step S` the process SIGKILLs itself once
(marker file) after the forward pass of step S; bench/torchft_peer.py restarts it as its
launcher would. Each process appends a `start` line and one line per step ({step, committed,
t_end, dt, loss, participants, replica_rank, quorum_id, healed}) to `--step-log`.
"""

from __future__ import annotations

import time

T_PROC_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="Manager timeout (torchft default 60)")
    ap.add_argument("--quorum-timeout-s", type=float, default=60.0, help="quorum timeout (torchft default 60)")
    ap.add_argument("--gloo-timeout-s", type=float, default=60.0, help="ProcessGroupGloo timeout (default 60)")
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--marker", default="")
    ap.add_argument("--step-log", required=True)
    ap.add_argument("--stop-file", default="", help="stop at the next step boundary once this file exists")
    ap.add_argument("--barrier-dir", default="", help="start training only when --replicas ready files exist")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--grad-sync",
        choices=("manager", "ddp"),
        default="manager",
        help="manager: manager.allreduce of one flat gradient (default); ddp: torchft.DistributedDataParallel",
    )
    a = ap.parse_args()

    import torch

    t_imported = time.time()
    torch.set_num_threads(a.threads)
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from phoenixft.data import _mix
    from phoenixft.train.gpt import GPT, PRESETS
    from phoenixft.train.gpt import workload as gpt_workload
    from phoenixft.workload import WorkloadContext

    logf = open(a.step_log, "a")  # noqa: SIM115

    def emit(rec: dict[str, Any]) -> None:
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    wl = gpt_workload(WorkloadContext(seed=a.seed, micro_batch=a.micro_batch, model=a.model))
    torch.manual_seed(a.seed)
    model = GPT(PRESETS[a.model])
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    healed = {"n": 0}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        healed["n"] += 1

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's store
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.gloo_timeout_s))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=False,
        replica_id=f"bench_{a.replica_id}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=a.timeout_s),
        quorum_timeout=timedelta(seconds=a.quorum_timeout_s),
        connect_timeout=timedelta(seconds=30),
        init_sync=False,
    )
    opt = Optimizer(manager, inner)
    fwd: Any = model
    if a.grad_sync == "ddp":
        from torchft import DistributedDataParallel

        fwd = DistributedDataParallel(manager, model)
    t_ready = time.time()
    if a.barrier_dir:  # a first launch starts together with its peers (a relaunch joins a running job)
        open(os.path.join(a.barrier_dir, f"ready-{a.replica_id}"), "w").close()
        deadline = time.monotonic() + 300
        while sum(1 for f in os.listdir(a.barrier_dir) if f.startswith("ready-")) < a.replicas:
            if time.monotonic() > deadline:
                raise SystemExit("start barrier timed out")
            time.sleep(0.01)
    emit(
        {
            "event": "start",
            "replica": a.replica_id,
            "pid": os.getpid(),
            "t_proc_start": T_PROC_START,
            "t_imported": t_imported,
            "t_ready": t_ready,
        }
    )
    while manager.current_step() < a.steps and not (a.stop_file and os.path.exists(a.stop_file)):
        t0 = time.perf_counter()
        opt.zero_grad()  # synchronous quorum (+ heal from a peer when behind)
        t_quorum = time.time()
        before = manager.current_step()
        s = before + 1
        rank = manager.participating_rank() or 0
        n = manager.num_participants()
        torch.manual_seed(_mix(a.seed, s, rank))
        loss = wl.loss(fwd, wl.batch(s, rank))
        if s == a.kill_at_step and a.marker and not os.path.exists(a.marker):
            with open(a.marker, "w") as f:
                f.write(json.dumps({"t": time.time(), "step": s, "replica": a.replica_id}))
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()  # with --grad-sync ddp the wrapper's comm hook all-reduces here
        if a.grad_sync == "manager":
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            off = 0
            for p in params:
                p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                off += p.numel()
        opt.step()  # should_commit: steps the optimizer only if every participant succeeded
        committed = manager.current_step() > before
        emit(
            {
                "step": s,
                "committed": committed,
                "t_quorum": t_quorum,
                "t_end": time.time(),
                "dt": time.perf_counter() - t0,
                "loss": float(loss.detach()),
                "participants": n,
                "replica_rank": rank,
                "quorum_id": manager._quorum_id,
                "healed": healed["n"],
            }
        )
    emit({"event": "done", "t": time.time(), "step": manager.current_step()})
    manager.shutdown(wait=False)
    logf.close()
    os._exit(0)  # the manager's threads and the lighthouse client must not delay the exit


if __name__ == "__main__":
    raise SystemExit(main())
