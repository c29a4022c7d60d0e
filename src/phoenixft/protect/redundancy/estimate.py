"""What a protection scheme costs, before launching: host memory per node and bytes per rank and step.

`estimate(...)` is pure arithmetic over the sizes phoenixft allocates (the same formulas as
`zero.FlatModel`, `snapshot.ShardState`, `snapshot.Holding`, `redundancy.parity.ParityHolding`;
tests/test_redundancy.py checks them against the real objects); `estimate_config(cfg)` gets the
model's size from the workload built on torch's meta device (no memory, no init); and
`format_estimate` is what `phoenixft run --dry-run` prints.

Host memory per worker, all of it shared memory that outlives the worker process (retained state):
- parameters: two flat buffers (ping-pong) of the padded parameters plus the model's buffers,
  in the parameter dtype;
- optimizer shard: two halves of rows x shard float32 (fp32 master weights + optimizer state);
- protection: `replicas:K`: K holdings of two halves of the protected rows; `ec:D+H`: for each
  parity block the rank keeps, two halves of one block (about one payload: d stripes);
plus, outside shared memory, the gradient buffer (and its fp32 accumulator with bf16).
Bytes sent per rank and step: `replicas:K`: K x the protected payload; `ec:D+H`: (d - 1 + h)
stripes of payload / d (the shuffle to the group, then the parity stripes to their holders).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from phoenixft.errors import UserError
from phoenixft.parallel.layout import shard_numel_of
from phoenixft.protect.redundancy.placement import Group, RingRank, place_groups
from phoenixft.protect.redundancy.scheme import Redundancy

if TYPE_CHECKING:
    from phoenixft.config import RunConfig

__all__ = ["NodeCost", "Estimate", "estimate", "estimate_config", "format_estimate"]

_ALIGN = 64
_HDR = 2 * 5 * 8  # a ping-pong header: 2 halves x 5 int64


def _stripe(payload_bytes: int, d: int) -> int:
    return max(_ALIGN, math.ceil(payload_bytes / d / _ALIGN) * _ALIGN)


@dataclass
class NodeCost:
    slot: int
    params: int = 0  # parameter ping-pong buffers (+ model buffers, step tags)
    state: int = 0  # optimizer shard halves
    protection: int = 0  # replicas or parity halves
    grads: int = 0  # gradient buffers (not shared memory)
    parity_blocks: int = 0
    sends: int = 0  # bytes its ranks send per step, together

    @property
    def retained(self) -> int:
        return self.params + self.state + self.protection

    @property
    def total(self) -> int:
        return self.retained + self.grads


@dataclass
class Estimate:
    scheme: Redundancy | None  # what the ring can hold (None: a single node, nothing to protect on)
    numel: int
    shard_numel: int
    payload_bytes: int  # protected bytes per rank (the rows that are replicated or encoded)
    nodes: list[NodeCost] = field(default_factory=list)
    send_per_rank: list[int] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)  # ec: every group, gid order


def estimate(*, nodes: int, workers_per_node: int, racks: int, scheme: Redundancy | None, numel: int,
             buffer_bytes: int, rows: int, payload_rows: int, param_bytes: int = 4) -> Estimate:
    """Costs of one configuration (sizes in bytes; `param_bytes` 4 for fp32, 2 for bf16)."""
    g, world = workers_per_node, nodes * workers_per_node
    shard = shard_numel_of(numel, world)
    padded = shard * world
    total = padded + math.ceil(buffer_bytes / param_bytes)
    payload = payload_rows * shard * 4
    eff = scheme.for_ring(nodes) if scheme is not None else None
    est = Estimate(scheme=eff, numel=numel, shard_numel=shard, payload_bytes=payload)
    est.send_per_rank = [0] * world
    prot = [0] * world
    blocks = [0] * world
    if eff is not None and eff.is_ec:
        for lr in range(g):
            ring = [RingRank(rank=s * g + lr, node=s, rack=s * racks // nodes) for s in range(nodes)]
            groups = place_groups(ring, eff.d, eff.h)
            dmax = max(grp.d for grp in groups)
            est.groups.extend(groups)
            for grp in groups:
                sl = _stripe(payload, grp.d)
                for r in grp.members:
                    est.send_per_rank[r] = (grp.d - 1 + grp.h) * sl
                for r in grp.parity:
                    prot[r] += 2 * grp.d * sl + _HDR + 2 * (4 + 2 * dmax) * 8
                    blocks[r] += 1
    elif eff is not None:
        for r in range(world):
            est.send_per_rank[r] = eff.k * payload
            prot[r] = eff.k * (2 * payload + _HDR)
    for s in range(nodes):
        c = NodeCost(slot=s)
        for r in range(s * g, (s + 1) * g):
            c.params += 2 * total * param_bytes + 3 * 8
            c.state += 2 * rows * shard * 4 + _HDR
            c.protection += prot[r]
            c.parity_blocks += blocks[r]
            c.grads += padded * param_bytes + (padded * 4 if param_bytes != 4 else 0)
            c.sends += est.send_per_rank[r]
        est.nodes.append(c)
    return est


def estimate_config(cfg: RunConfig) -> Estimate:
    """The estimate for a validated configuration (the model is built on the meta device)."""
    import torch

    from phoenixft.optim import make_optimizer
    from phoenixft.workload import WorkloadContext, build_on_meta, load_workload

    wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
    try:
        model = build_on_meta(wl.build_model)
    except Exception as e:  # noqa: BLE001 - user code: one line, not a traceback
        raise UserError(f"--workload={cfg.workload!r}: its build_model failed on torch's meta device (where --dry-run "
                        f"builds it, allocating nothing): {type(e).__name__}: {e}") from None
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    pids = {id(p) for p in model.parameters()}
    esize = 2 if cfg.precision == "bf16" else 4
    buffer_bytes = 0
    seen: set[int] = set()  # the state_dict's buffers, then the non-persistent ones (FlatModel keeps both)
    for t in [*model.state_dict(keep_vars=True).values(), *model.buffers()]:
        if isinstance(t, torch.Tensor) and id(t) not in pids and id(t) not in seen:
            seen.add(id(t))
            buffer_bytes += t.numel() * (esize if t.is_floating_point() and esize == 2 else t.element_size())
    opt = make_optimizer(cfg.optimizer, weight_decay=cfg.weight_decay, beta1=cfg.beta1, beta2=cfg.beta2,
                         eps=cfg.eps, momentum=cfg.momentum, nesterov=cfg.nesterov, custom=wl.optimizer)
    rows = 1 + len(opt.state_names)
    payload_rows = rows if cfg.precision == "bf16" else rows - 1
    scheme = cfg.scheme if cfg.protect == "phoenix" else None
    return estimate(nodes=cfg.nodes, workers_per_node=cfg.workers_per_node, racks=cfg.racks, scheme=scheme,
                    numel=numel, buffer_bytes=buffer_bytes, rows=rows, payload_rows=payload_rows, param_bytes=esize)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


SHOWN_GROUPS = 16  # --dry-run lists this many parity groups (a large job has thousands of the same form)


def format_estimate(est: Estimate, cfg: RunConfig) -> str:
    """The `phoenixft run --dry-run` report."""
    g = cfg.workers_per_node
    what = "none (--protect none)" if cfg.protect != "phoenix" else str(est.scheme or "none (a single node)")
    lines = ["phoenixft run --dry-run: nothing is started.",
             f"  model {cfg.model if cfg.workload == 'phoenixft.gpt:workload' else cfg.workload}: "
             f"{est.numel:,} parameters ({cfg.precision}, {cfg.optimizer}); {cfg.nodes} node(s) x {g} worker(s), "
             f"{cfg.spares} spare(s), {cfg.racks} rack(s); redundancy {what}",
             f"  per rank: optimizer shard {est.shard_numel:,} elements; protected payload "
             f"{_mib(est.payload_bytes)} MiB per step"]
    if est.groups:
        names = [f"n{s}" for s in range(cfg.nodes)]
        lines.append(f"  groups ({len(est.groups)}; members -> parity holders):")
        for gid, grp in enumerate(est.groups[:SHOWN_GROUPS]):
            mem = " ".join(f"{names[r // g]}.{r % g}" for r in grp.members)
            par = " ".join(f"{names[r // g]}.{r % g}" for r in grp.parity)
            lines.append(f"    g{gid}: [{mem}] ec:{grp.d}+{grp.h} -> parity on [{par}]")
        if len(est.groups) > SHOWN_GROUPS:
            lines.append(f"    ... and {len(est.groups) - SHOWN_GROUPS} more groups of the same form")
    lines.append("  host memory per node (MiB):   params x2   shard x2   protection    grads    total   "
                 "sends/step (MiB)")
    rows: list[tuple[int, int, str]] = []  # (first slot, last slot, columns): equal neighbours share a row
    for c in est.nodes:
        extra = f"  ({c.parity_blocks} parity block{'s' if c.parity_blocks != 1 else ''})" if est.groups else ""
        cols = (f"{_mib(c.params):>10s} {_mib(c.state):>10s} {_mib(c.protection):>12s} "
                f"{_mib(c.grads):>8s} {_mib(c.total):>8s} {_mib(c.sends):>10s}{extra}")
        if rows and rows[-1][2] == cols and rows[-1][1] == c.slot - 1:
            rows[-1] = (rows[-1][0], c.slot, cols)
        else:
            rows.append((c.slot, c.slot, cols))
    for first, last, cols in rows:
        name = f"n{first}" if first == last else f"n{first}-n{last}"
        lines.append(f"    {name:<28s}{cols}")
    worst = max(est.nodes, key=lambda c: c.total)
    lines.append(f"  a spare node needs as much as the node it replaces (up to {_mib(worst.total)} MiB); every "
                 f"process also needs the Python/torch runtime (about 0.3-0.5 GiB), not counted here.")
    if est.send_per_rank:
        lo, hi = min(est.send_per_rank), max(est.send_per_rank)
        span = _mib(hi) if lo == hi else f"{_mib(lo)}-{_mib(hi)}"
        lines.append(f"  bytes each rank sends per step for protection: {span} MiB "
                     f"({hi / max(1, est.payload_bytes):.2f}x its protected payload), off the critical path")
    return "\n".join(lines)
