"""Stragglers: nodes whose own compute per step is slower than their peers', found, reported, evicted.

Synchronous data parallelism runs at the speed of its slowest node. Each step's record (rank 0's
`step/<s>`) carries every node's own compute time of the step before (`nodes_compute_s`: its slowest
worker's forward, backward and optimizer time, less the time it was blocked waiting for other ranks;
the workers add it to the step's loss all-reduce, so it costs neither a collective nor a store round
trip of its own, see train/trainer.py). The coordinator's main loop polls `StragglerMonitor`, which
reads the records as they come and feeds `StragglerDetector` (pure): a node whose time exceeds
`--straggler-factor` times the median of its peers' for `--straggler-window` consecutive measured
steps is flagged, once. The monitor says so (a `straggler` event: node, slot, ratio, first step; the
live line and the reports show it) and, with `--evict-stragglers`, protection (`--protect phoenix`:
the spare takes the node's state from its replicas) and a ready spare, hands the node to `evict`: at
most once per node, never while a recovery is pending, and only while it is still slow.
`nodes_compute` (what rank 0 writes into the step record) rescales each rank's time under --tp/--pp
by its stage's median, so that a stage with more work is no straggler.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import get_nowait, keys, sealed
from phoenixft.controlplane.values import parse_json
from phoenixft.coordinator.admission import Admission
from phoenixft.coordinator.detect import FailureDetector
from phoenixft.coordinator.shared import Job, Membership
from phoenixft.distributed.topology import Topology

__all__ = ["Flag", "StragglerDetector", "StragglerMonitor", "evict", "nodes_compute", "DRAIN_REQUEST"]

# the planned drain's request for a straggler (the value of `drain/<slot>`)
DRAIN_REQUEST = {"reason": "straggler", "source": "coordinator", "deadline": None}
MAX_RECORDS = 512  # step records read per poll at most (a restarted coordinator starts near the progress)


def kept_from(progress: int, kept: int) -> int:
    """The oldest step whose record a reader that saw `progress` looks up without racing its deletion (`kept`:
    --store-step-records; half of it is the margin for a progress read a moment before the look-up)."""
    return max(1, progress - kept // 2 + 1)


@dataclass(frozen=True)
class Flag:
    """A node flagged as a straggler."""

    node: str
    ratio: float  # its compute over its peers' median: the median of that ratio over the window
    first_step: int  # the first step of its run of slow steps
    step: int  # the step that filled the window


@dataclass
class _Run:
    first: int = 0  # the first step of the current run of slow steps
    ratios: deque[float] = field(default_factory=deque)  # the last `window` ratios of the run


class StragglerDetector:
    """Flags a node whose compute exceeds `factor` times its peers' median for `window` consecutive
    measured steps. Pure: `observe` one step's times at a time, in step order."""

    def __init__(self, factor: float, window: int) -> None:
        if not factor > 1 or window < 1:
            raise ValueError(f"factor must be > 1 and window >= 1, got {factor}, {window}")
        self.factor, self.window = factor, window
        self.flagged: dict[str, Flag] = {}
        self.last = -1  # the last step observed (a replayed step after a recovery is not counted twice)
        self._runs: dict[str, _Run] = {}  # node -> its current run of slow steps (absent: its last step was not)

    def slow_now(self, node: str) -> bool:
        """Whether `node`'s last measured step was slower than `factor` times its peers' median."""
        return node in self._runs

    def observe(self, step: int, times: Mapping[str, float]) -> list[Flag]:
        """One measured step: node -> its own compute time in seconds (a node without a positive, finite
        time was not measured: its run is broken). The nodes flagged at this step (each node once)."""
        if step <= self.last:
            return []
        self.last = step
        valid = {n: float(t) for n, t in times.items() if isinstance(t, (int, float)) and math.isfinite(t) and t > 0}
        for n in [n for n in self._runs if n not in valid]:
            del self._runs[n]
        out: list[Flag] = []
        if len(valid) < 2:  # no peer to compare with
            self._runs.clear()
            return out
        for n, t in valid.items():
            ratio = t / statistics.median(v for m, v in valid.items() if m != n)
            if not ratio > self.factor:
                self._runs.pop(n, None)
                continue
            run = self._runs.setdefault(n, _Run(first=step, ratios=deque(maxlen=self.window)))
            run.ratios.append(ratio)
            if len(run.ratios) >= self.window and n not in self.flagged:
                flag = Flag(node=n, ratio=statistics.median(run.ratios), first_step=run.first, step=step)
                self.flagged[n] = flag
                out.append(flag)
        return out


def nodes_compute(topo: Topology, s: int, ranks_own_s: list[float]) -> dict[str, Any]:
    """The step record's per-node compute: each node's own compute of step `s` - 1 (its slowest worker's;
    a worker that measured none yet, e.g. a spare just promoted, counts for nothing), what the
    coordinator's straggler detection reads. Under --tp/--pp the stages
    differ in work: each rank's time is rescaled by its stage's median (over its data-parallel peers)
    to the job's median, so that only a rank slower than the ranks doing the same work stands out."""
    lay = topo.layout
    measured = {r: t for r, t in enumerate(ranks_own_s) if t > 0.0}
    if not measured:
        return {}
    if not lay.trivial:
        job = statistics.median(measured.values())
        by_stage: dict[tuple[int, int], list[float]] = {}
        for r, t in measured.items():
            by_stage.setdefault(lay.coord(r).stage, []).append(t)
        medians = {st: statistics.median(ts) for st, ts in by_stage.items()}
        measured = {r: t * job / medians[lay.coord(r).stage] for r, t in measured.items()}
    per: dict[str, float] = {}
    for r, t in measured.items():
        n = topo.node_of_rank(r)
        per[n] = max(per.get(n, 0.0), t)
    return {"nodes_compute_s": {n: round(t, 6) for n, t in per.items()}, "nodes_compute_step": s - 1}


def evict(job: Job, detector: FailureDetector, slot: int, node: str) -> None:
    """Move straggler `node` (in `slot`) off the job through a planned drain (coordinator/drain.py): its
    request (`drain/<slot>`, naming the node so that a request outliving the slot's owner is stale) is read
    at the main loop's next look; every rank stops at an agreed step boundary, a ready spare takes the slot
    from the committed replicas and the node leaves with nothing lost."""
    sealed.put(job.store, keys.drain_key(slot), json.dumps({**DRAIN_REQUEST, "t": time.time(), "node_id": node}))


class StragglerMonitor:
    """The coordinator's straggler detection over the step records (`poll`, from its main loop)."""

    def __init__(self, job: Job, cfg: RunConfig, state: Membership, admission: Admission,
                 detector: FailureDetector) -> None:
        self.job, self.cfg, self.state, self.admission, self.detector = job, cfg, state, admission, detector
        self.on = cfg.straggler_factor > 0
        # (a job without protection has no replicas a spare could take the straggler's state from)
        self.evicts = cfg.evict_stragglers and cfg.protect == "phoenix"
        self.det = StragglerDetector(cfg.straggler_factor, cfg.straggler_window) if self.on else None
        self.seen: int | None = None  # the last step whose record was read
        self.evicted: set[str] = set()
        self._no_spare_said: set[str] = set()

    def poll(self) -> None:
        """Read the step records since the last poll, flag stragglers, evict one if it should be."""
        if self.det is None or self.state.topo is None:
            return
        progress = self.job.progress()
        if self.seen is None or progress < self.seen:  # (the first look, also of a restarted coordinator: every
            self.seen = 0 if self.seen is None else progress  # record so far, MAX_RECORDS at most; a replay)
        # (never older than the store keeps: the launcher deletes records past --store-step-records)
        first = max(self.seen + 1, progress - MAX_RECORDS + 1, kept_from(progress, self.cfg.store_step_records))
        self.seen = progress
        for rec in self._records(first, progress):
            times, step = rec.get("nodes_compute_s"), rec.get("nodes_compute_step")
            if isinstance(times, dict) and isinstance(step, int):
                for flag in self.det.observe(step, times):
                    self._flagged(flag)
        if self.evicts:
            for node in [n for n in self.det.flagged if n not in self.evicted]:
                self._evict(node)

    def _records(self, first: int, last: int) -> list[dict[str, object]]:
        if first > last:
            return []
        names = [keys.step(s) for s in range(first, last + 1)]
        raws = self.job.store.multi_get(names) if self.job.store.check(names) else [
            get_nowait(self.job.store, n) for n in names]
        recs = [parse_json(sealed.unseal(n, r), n) for n, r in zip(names, raws, strict=True)]
        return [r for r in recs if isinstance(r, dict)]

    def _flagged(self, flag: Flag) -> None:
        topo = self.state.topo
        assert topo is not None
        slot = topo.nodes.index(flag.node) if flag.node in topo.nodes else None
        action = "evict" if self.evicts else "report"
        self.job.event("straggler", node=flag.node, slot=slot, ratio=round(flag.ratio, 3), first_step=flag.first_step,
                       step=flag.step, factor=self.cfg.straggler_factor, window=self.cfg.straggler_window,
                       action=action)

    def _evict(self, node: str) -> None:
        """Evict `node` now if it is still in the job and still slow, no recovery is pending and a spare is
        ready (else look again at the next poll)."""
        topo, det = self.state.topo, self.det
        assert topo is not None and det is not None
        if node not in topo.nodes or node in self.state.dead:
            self.evicted.add(node)  # (gone meanwhile: nothing to evict, ever)
            return
        if not det.slow_now(node) or sealed.has(self.job.store, keys.failflag(topo.epoch)):
            return
        self.admission.refresh_pool()
        spares = self.admission.ready_spares()
        if not spares:
            if node not in self._no_spare_said:
                self._no_spare_said.add(node)
                self.job.event("straggler_kept", node=node, epoch=topo.epoch, why="no ready spare")
            return
        self.evicted.add(node)
        self.job.event("straggler_evicted", node=node, slot=topo.nodes.index(node), epoch=topo.epoch,
                       spare=spares[0], step=self.job.progress())
        evict(self.job, self.detector, topo.nodes.index(node), node)
