"""Silent-data-corruption checks on one rank: the parameter fingerprints, the spike guard, the audits
and the proof by replay (docs/sdc.md).

The worker calls `before_step` before a step's forward (parameter fingerprints compared across the
data-parallel group; an audit's recomputation) and `prove` when the trainer raised `SdcSuspect`; the
trainer calls `on_bucket` as each gradient bucket's reduction starts (the gradient's fingerprint,
before the reduction) and `before_update` once the loss and the gradient norm are known, before the
optimizer writes anything (the spike guard; an audit's comparison). A suspect step raises before its
state is committed, so rolling it back costs nothing: the committed state of the step before is what
every rank still holds. Every decision is taken from values every rank of the mesh has (all-reduced
or all-gathered), so every rank takes the same one.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from phoenixft.controlplane import keys, sealed
from phoenixft.controlplane.values import parse_json
from phoenixft.errors import PeerFailure, Unhealable
from phoenixft.sdc import record
from phoenixft.sdc.logic import (
    FP_WORDS,
    Computation,
    Fingerprint,
    SpikeGuard,
    Verdict,
    add_fp,
    diverged,
    fingerprint,
    judge,
)

if TYPE_CHECKING:
    from phoenixft.core.context import RankContext
    from phoenixft.faults.inject import FaultInjector

__all__ = ["SdcChecks", "SdcSuspect"]

_ZERO: Fingerprint = (0,) * FP_WORDS


class SdcSuspect(PeerFailure):
    """A step is suspect (a spike, a non-finite value, a failed audit); raised before it commits, on
    every rank alike. (A PeerFailure: a path that does not prove it recovers the step instead.)"""

    def __init__(self, step: int, reason: str, comps: list[Computation] | None = None) -> None:
        super().__init__(f"step {step} is suspect: {reason}")
        self.step, self.reason, self.comps = step, reason, comps or []


class SdcChecks:
    def __init__(self, ctx: RankContext, inject: FaultInjector) -> None:
        cfg = ctx.cfg
        self.ctx, self.inject = ctx, inject
        self.check_every = cfg.sdc_check_every
        self.guard = SpikeGuard(threshold=max(0.0, cfg.spike_threshold), window=cfg.spike_window)
        self.guarded = cfg.spike_threshold >= 0
        self.audit = cfg.sdc_audit
        self.audit_every = cfg.sdc_audit_every or (1 if cfg.sdc_audit == "full" else 10)
        self.wants_norm = self.guarded
        self.guards_loss = self.guarded
        self.grad_fp: Fingerprint = _ZERO
        self.audit_comp: Computation | None = None
        self.verified: int | None = None  # a step proven genuine: its values pass the guard
        self.cost: dict[str, float] = {}
        self._values: dict[str, float | None] = {}
        self._pending: tuple[int, Any, torch.Tensor] | None = None  # the parameter fingerprints' exchange

    # ------------------------------------------------------------------ lifecycle
    def joined(self, resume_step: int) -> None:
        """At a join, every member (a promoted spare too) takes the spike window of the steps up to the resume
        step from the run's step records (sealed by rank 0: the loss and the gradient norm are the same on
        every rank), not a window of its own: a survivor's would hold steps that are rolled back, a spare has
        none, and an empty window guards nothing for its first `min_history` steps."""
        self.guard.reset()
        if not self.guarded or resume_step < 1:
            return
        names = [keys.step(s) for s in range(max(1, resume_step - self.guard.window + 1), resume_step + 1)]
        for name, raw in zip(names, sealed.get_many(self.ctx.store, names), strict=True):
            rec = parse_json(raw, name) if raw is not None else None
            if rec is not None:
                self.guard.observe({k: v for k, v in rec.items() if k in ("loss", "grad_norm")
                                    and isinstance(v, (int, float)) and not isinstance(v, bool)})

    def committed(self) -> None:
        """The step committed: its values join the spike window."""
        self.guard.observe(self._values)
        self._values = {}

    def costs(self) -> dict[str, float]:
        return {f"sdc_{k}_s": round(v, 6) for k, v in self.cost.items()}

    def _timed(self, what: str, t0: float) -> None:
        self.cost[what] = self.cost.get(what, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------------ before the forward
    def before_step(self, s: int) -> None:
        self.cost, self.grad_fp, self.audit_comp, self._pending = {}, _ZERO, None, None
        if self.check_every and s % self.check_every == 0:
            self.check_params(s)
        if self.audit != "off" and s % self.audit_every == 0:
            t0 = time.perf_counter()
            self.audit_comp = self._audit_pass(s)
            self._timed("audit", t0)

    def check_params(self, s: int) -> None:
        """Fingerprint every data-parallel slice of this rank's full parameters and post their all-gather
        over the group; `_resolve_params` compares them once the step's gradients are reduced (the
        exchange then waits for nobody: no synchronisation point is added before the forward)."""
        ctx = self.ctx
        assert ctx.comm is not None
        flat = ctx.trainer.flat
        for f in self.inject.sdc_due(s, "param"):
            self.inject.sdc_flip(f, s, flat.flat[: flat.numel], nonzero=False)
        t0 = time.perf_counter()
        d = flat.shards
        dev = ctx.trainer.device.torch  # (NCCL's collectives take device tensors)
        mine = torch.tensor([x for j in range(d) for x in fingerprint(flat.flat[flat.shard_slice(j)])],
                            dtype=torch.int64, device=dev)
        out = torch.empty(d * d * FP_WORDS, dtype=torch.int64, device=dev)
        self._pending = (s, ctx.comm.dp._allgather_base(out, mine), out)
        self._timed("params", t0)

    def _resolve_params(self) -> None:
        """The parameter fingerprints posted before the forward: all agree, or each owner's committed
        master slice is the reference that names who diverged (fenced: PeerFailure)."""
        if self._pending is None:
            return
        ctx = self.ctx
        assert ctx.topo is not None
        (s, work, out), self._pending = self._pending, None
        t0 = time.perf_counter()
        ctx.wait(work, "sdc parameter fingerprints")
        d = ctx.trainer.flat.shards
        rows = out.view(d, d * FP_WORDS).tolist()
        copies = [[tuple(m[j * FP_WORDS:(j + 1) * FP_WORDS]) for j in range(d)] for m in rows]
        bad = diverged(copies)
        self._timed("params", t0)
        if bad == []:
            return
        ref = self._gather_dp(list(self._reference(s)), FP_WORDS)
        bad = diverged(copies, [tuple(r) for r in ref])
        lay = ctx.topo.layout
        group = lay.dp_group(ctx.rank)
        nodes = sorted({ctx.topo.node_of_rank(group[m]) for m in bad or []})
        c = lay.coord(ctx.rank)
        record.log_once(ctx.store, f"e{ctx.epoch}/s{s}/param/{c.pp}.{c.tp}", "sdc_detected", step=s,
                        check="fingerprint", target="param", nodes=nodes, wid=ctx.wid, epoch=ctx.epoch)
        if not nodes:
            raise Unhealable(f"the parameters of step {s - 1} differ across data-parallel peers and no member's "
                             "copy matches its owner's committed state")
        for n in nodes:
            self._convict(s, n, "param", "transient", "its parameters differ from the owners' committed state")
        raise PeerFailure(f"silent data corruption: the parameters of {', '.join(nodes)} diverged before step {s}")

    def _reference(self, s: int) -> Fingerprint:
        """The fingerprint of this rank's own slice as its committed master weights say it must be."""
        tr = self.ctx.trainer
        half = tr.state.half_with(s - 1)
        if half is None:
            return _ZERO
        master = tr.state.dev[half][0]
        return fingerprint(master if master.dtype == tr.flat.dtype else master.to(tr.flat.dtype))

    def _gather_dp(self, mine: list[int], n: int) -> list[list[int]]:
        ctx = self.ctx
        assert ctx.comm is not None
        d = ctx.trainer.flat.shards
        dev = ctx.trainer.device.torch
        out = torch.empty(d * n, dtype=torch.int64, device=dev)
        ctx.wait(ctx.comm.dp._allgather_base(out, torch.tensor(mine, dtype=torch.int64, device=dev)),
                 "sdc fingerprints")
        return out.view(d, n).tolist()

    def _gather_world(self, mine: list[int]) -> list[list[int]]:
        ctx = self.ctx
        assert ctx.comm is not None and ctx.topo is not None
        w, n = ctx.topo.world, len(mine)
        dev = ctx.trainer.device.torch
        out = torch.empty(w * n, dtype=torch.int64, device=dev)
        ctx.wait(ctx.comm.train._allgather_base(out, torch.tensor(mine, dtype=torch.int64, device=dev)),
                 "sdc fingerprints")
        return out.view(w, n).tolist()

    # ------------------------------------------------------------------ during the step (the trainer's hooks)
    def on_bucket(self, s: int, grad: torch.Tensor, lo: int, hi: int) -> None:
        """A gradient bucket is complete and its reduction about to start: the grad faults due land here
        (in the first bucket), then the bucket's fingerprint joins the step's."""
        if self.inject is not None and self.grad_fp == _ZERO:
            for f in self.inject.sdc_due(s, "grad"):
                self.inject.sdc_flip(f, s, grad[lo:hi], nonzero=True)
        if not (self.guarded or self.audit != "off"):
            return
        t0 = time.perf_counter()
        self.grad_fp = add_fp(self.grad_fp, fingerprint(grad[lo:hi]))
        self._timed("guard", t0)

    def before_update(self, s: int, loss: float, norm: float | None) -> None:
        """Before the optimizer writes anything: the parameter fingerprints, the spike guard, then an audit's
        comparison."""
        self._resolve_params()
        t0 = time.perf_counter()
        self._values = {"loss": loss, "grad_norm": norm}
        why = self.guard.suspect(self._values) if self.guarded and self.verified != s else None
        self._timed("guard", t0)
        if why is not None:
            record.log_once(self.ctx.store, f"e{self.ctx.epoch}/s{s}/guard", "sdc_detected", step=s,
                            check="spike guard", reason=why, epoch=self.ctx.epoch)
            raise SdcSuspect(s, why)
        if self.audit_comp is not None or (self.audit != "off" and s % self.audit_every == 0):
            t0 = time.perf_counter()
            comps = self._exchange([self._original(s)] + ([self.audit_comp] if self.audit_comp else []))
            self._timed("audit", t0)
            v = judge(comps)
            if v.equal and self.audit == "sample" and self.ctx.rank == 0:  # (the report's honest limits)
                audited = {c.slot for c in comps if c.kind == "audit"}
                record.log(self.ctx.store, "sdc_audit", event=False, step=s, slots=[list(x) for x in audited],
                           nodes=sorted({c.node for c in comps if c.slot in audited}))
            if not v.equal:
                record.log_once(self.ctx.store, f"e{self.ctx.epoch}/s{s}/audit", "sdc_detected", step=s,
                                check=f"audit ({self.audit})", slots=[list(x) for x in v.slots], epoch=self.ctx.epoch)
                raise SdcSuspect(s, f"the {self.audit} audit's recomputation differs", comps)

    # ------------------------------------------------------------------ recomputations
    def _slot(self, rot: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """The slot (pp, tp, dp) this rank computes when the data-parallel slots rotate by `rot`, and its
        microbatches."""
        ctx = self.ctx
        assert ctx.topo is not None
        lay = ctx.topo.layout
        c = lay.coord(ctx.rank)
        d = (c.dp + rot) % lay.dp
        total = ctx.cfg.total_microbatches
        return (c.pp, c.tp, d), (d * total // lay.dp, (d + 1) * total // lay.dp)

    def _original(self, s: int) -> Computation:
        slot, _ = self._slot(0)
        return Computation(slot=slot, fp=self.grad_fp, node=self.ctx.node_id, kind="original")

    def _recompute(self, s: int, rot: int, kind: str) -> Computation:
        """This rank's gradient of the microbatches of slot dp+rot, recomputed without any reduction (the
        parameters, buffers and seeds of step s are those of its original computation); fingerprinted
        bucket by bucket as the original was."""
        ctx = self.ctx
        assert ctx.comm is not None and ctx.topo is not None
        tr, lay = ctx.trainer, ctx.topo.layout
        slot, mbs = self._slot(rot)
        tr.flat.zero_grad()
        if tr.flat.buffers:
            tr.flat.select(tr.flat.step)  # the model's buffers as the step began (a forward may update them)
        tr.forward_backward_only(s, ctx.comm, ctx.rank, lay, mbs, ctx.wait)
        grad = tr.flat.grad32
        for f in self.inject.sdc_due(s, "grad", first=False):  # a persistent bad unit corrupts what it
            self.inject.sdc_flip(f, s, grad, nonzero=True)  # recomputes too
        fp = _ZERO
        for lo, hi in tr.buckets.ranges:
            fp = add_fp(fp, fingerprint(grad[lo:hi]))
        tr.flat.zero_grad()
        if tr.flat.buffers:
            tr.flat.select(tr.flat.step)
        return Computation(slot=slot, fp=fp, node=ctx.node_id, kind=kind)

    def _audit_pass(self, s: int) -> Computation | None:
        """sample: one data-parallel slot (rotating with the step) is recomputed by its neighbour; full:
        every slot by its neighbour. Only the ranks that audit compute (a pipeline column together)."""
        assert self.ctx.topo is not None
        lay = self.ctx.topo.layout
        if lay.dp < 2:
            return None
        if self.audit == "sample":
            target = (s // self.audit_every) % lay.dp
            if (lay.coord(self.ctx.rank).dp + 1) % lay.dp != target:
                return None
        return self._recompute(s, 1, "audit")

    _KINDS = ("original", "audit", "replay", "rerun")

    def _exchange(self, comps: list[Computation], room: int = 2) -> list[Computation]:
        """Every rank's computations (at most `room` each, the same on every rank), on every rank:
        (kind, slot, fingerprint) all-gathered over the mesh."""
        ctx = self.ctx
        assert ctx.topo is not None and len(comps) <= room
        per = 5 + FP_WORDS
        mine: list[int] = []
        for i in range(room):
            c = comps[i] if i < len(comps) else None
            mine += ([1, self._KINDS.index(c.kind), *c.slot, *c.fp] if c else [0] * per)
        out: list[Computation] = []
        for r, row in enumerate(self._gather_world(mine)):
            node = ctx.topo.node_of_rank(r)
            for i in range(room):
                x = row[i * per:(i + 1) * per]
                if x[0]:
                    out.append(Computation(slot=tuple(x[2:5]), fp=tuple(x[5:]), node=node, kind=self._KINDS[x[1]]))
        return out

    # ------------------------------------------------------------------ proof by replay
    def prove(self, s: int, e: SdcSuspect) -> None:
        """Replay suspect step s: every data-parallel slot's microbatches moved to the next slot's node
        (unless a full audit did that already); while no single node explains a disagreement, once more
        where they first ran, then on the nodes further along the ring. Returns when every computation
        agrees bit for bit (a genuine spike: the worker runs the step again and it commits); raises
        PeerFailure after naming the node that computed wrong (the coordinator fences it, class sdc),
        or Unhealable."""
        assert self.ctx.topo is not None
        t0 = time.perf_counter()
        comps = list(e.comps) or self._exchange([self._original(s)])
        crossed = self.audit == "full" and any(c.kind == "audit" for c in comps)
        rots = ([] if crossed else [1]) + [0] + list(range(2, self.ctx.topo.layout.dp))
        v = judge(comps)
        for rot in rots:
            if (v.equal and (crossed or rot != 1)) or v.culprit is not None:
                break
            comps += self._exchange([self._recompute(s, rot, "rerun" if rot == 0 else "replay")])
            v = judge(comps)
        self._timed("replay", t0)
        self._verdict(s, e, v, time.perf_counter() - t0)

    def _verdict(self, s: int, e: SdcSuspect, v: Verdict, took: float) -> None:
        ctx = self.ctx
        record.log_once(ctx.store, f"e{ctx.epoch}/s{s}/verdict", "sdc_verdict", step=s, verdict=v.label,
                        reason=e.reason, node=v.culprit, candidates=v.candidates, slots=[list(x) for x in v.slots],
                        rolled_back_to=s - 1, replay_s=round(took, 4), epoch=ctx.epoch)
        if v.equal:
            loss = self._values.get("loss")
            if loss is not None and not math.isfinite(loss):
                raise Unhealable(f"the loss of step {s} is {loss} (numerical error in the training itself: a "
                                 "replay on other nodes gave the same bits)")
            self.verified, self.grad_fp = s, _ZERO
            return
        if v.culprit is None:
            raise Unhealable(f"silent data corruption in step {s}: the computations of "
                             f"{', '.join(v.candidates)} disagree and no other node decides between them")
        self._convict(s, v.culprit, "grad", v.label, e.reason)
        raise PeerFailure(f"silent data corruption: node {v.culprit} computed step {s} wrong ({v.label})")

    def _convict(self, s: int, node: str, target: str, label: str, why: str) -> None:
        """Name `node` for the coordinator, which fences it (class sdc) and quarantines it for this job."""
        ctx = self.ctx
        rec: dict[str, Any] = {"step": s, "target": target, "verdict": label, "why": why, "by": ctx.wid}
        record.accuse(ctx.store, ctx.epoch, node, rec)
