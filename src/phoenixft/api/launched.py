"""`phoenixft.init()` in a worker of a job: join it and hand the script its `Job`.

The agent that forked the worker put the job's coordinates in its environment (`launch_env`). Joining:

1. connect, verify the job's config, place the device (`ScriptMember`);
2. seed torch's generators, so that every rank builds the model alike (rank 0's is broadcast anyway);
3. learn this rank's epoch: epoch 0 for an active node; a spare waits here, warm (torch imported, the
   store connected), until the coordinator promotes it; a worker restarted in place reports what it
   kept in shared memory at once and waits for the epoch that takes it back;
4. `torch.distributed.init_process_group(backend="phoenixft")`: the job's `ResilientGroup` becomes the
   default group (bound to real groups when the epoch is joined, at the first `job.steps` iteration,
   once the script has built and wrapped what it trains), and the torchrun variables are set.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from phoenixft.api.group import ResilientGroup, created, register_backend
from phoenixft.api.job import Job
from phoenixft.api.member import ScriptMember
from phoenixft.controlplane import auth, keys, sealed
from phoenixft.controlplane.values import parse_int
from phoenixft.errors import Drained, RunAborted

__all__ = ["join_job", "launch_env", "ENV", "current", "finished"]

ENV = {"store": "PHOENIXFT_SCRIPT_STORE", "node": "PHOENIXFT_SCRIPT_NODE", "local_rank": "PHOENIXFT_SCRIPT_LOCAL_RANK",
       "run_id": "PHOENIXFT_SCRIPT_RUN_ID", "threads": "PHOENIXFT_SCRIPT_THREADS",
       "incarnation": "PHOENIXFT_SCRIPT_INCARNATION"}


def launch_env(store: str, node: str, local_rank: int, run_id: str, threads: int, incarnation: int) -> dict[str, str]:
    """The variables a script's worker is started with (read back by `join_job`)."""
    vals = {"store": store, "node": node, "local_rank": str(local_rank), "run_id": run_id, "threads": str(threads),
            "incarnation": str(incarnation)}
    return {ENV[k]: v for k, v in vals.items()} | {"LOCAL_RANK": str(local_rank)}


_JOB: Job | None = None
_RELEASED = False  # the job let this process go before it joined (a spare the run did not need, a drained node)


def current() -> Job | None:
    """The job this process joined (None: `phoenixft.init()` was not called)."""
    return _JOB


def finished() -> bool:
    """The joined job's loop completed (its final state published), or the job let this rank go."""
    return _RELEASED or (_JOB is not None and _JOB.finished)


def join_job(seed: int | None) -> Job:
    """The process's job (joined once; a second `init()` returns the same one)."""
    global _JOB, _RELEASED
    if _JOB is not None:
        return _JOB
    env = {k: os.environ[v] for k, v in ENV.items()}
    try:
        m = ScriptMember(env["store"], env["node"], int(env["local_rank"]), env["run_id"], int(env["threads"]),
                         int(env["incarnation"]))
    except RunAborted as e:
        print(f"phoenixft worker {env['node']}.{env['local_rank']}: {e}", flush=True)
        raise SystemExit(3) from None
    seed = m.cfg.seed if seed is None else seed
    torch.manual_seed(seed)
    job = Job(m, seed)
    m.announce()
    try:
        if m.incarnation > 0:  # restarted in place: report what it kept; the next epoch takes it back
            e0 = parse_int(sealed.get(m.ctx.store, keys.EPOCH), keys.EPOCH, 0)
            m.ctx.topo = auth.verified_topology(m.ctx.store, e0, m.ctx.store.get(keys.topo(e0)))
            m.ctx.epoch, m.ctx.rank = e0, m.ctx.topo.rank_of(m.node_id, m.local_rank)
            topo = m.report(f"restarted in place (incarnation {m.incarnation})")
        else:
            topo = m.await_membership()  # (a spare: until it is promoted, or the run ends)
    except Drained as e:
        print(f"phoenixft worker {m.wid}: {e}; leaving", flush=True)
        m.close()
        _RELEASED = True
        raise SystemExit(0) from None
    except RunAborted as e:
        m.close()
        if "done" in str(e):  # (a spare never promoted: the run is over)
            _RELEASED = True
            raise SystemExit(0) from None
        print(f"phoenixft worker {m.wid}: {e}", flush=True)
        raise SystemExit(3) from None
    job._pending = topo
    rank, world = topo.rank_of(m.node_id, m.local_rank), topo.world
    _default_group(m, rank, world)
    host, _, port = env["store"].rpartition(":")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": env["local_rank"],
                       "LOCAL_WORLD_SIZE": str(m.cfg.workers_per_node), "MASTER_ADDR": host or "127.0.0.1",
                       "MASTER_PORT": port or "0"})
    _JOB = job
    return job


def _default_group(m: ScriptMember, rank: int, world: int) -> None:
    """The job's `ResilientGroup` as torch.distributed's default group (once per process)."""
    register_backend()
    if dist.is_initialized():
        g = dist.distributed_c10d._get_default_group()
        if not isinstance(g, ResilientGroup):
            print("phoenixft: torch.distributed was initialised before phoenixft.init(): call phoenixft.init() "
                  "instead of init_process_group()", file=sys.stderr, flush=True)
            raise SystemExit(2)
    else:
        dist.init_process_group(backend="phoenixft", store=dist.HashStore(), rank=rank, world_size=world)
    groups = created()
    m.group = groups[0]
    m.group.bind(None, rank, world)
