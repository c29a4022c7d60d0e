"""Monte Carlo event simulator of whole training runs under failures, vectorised over trajectories.

Each loop iteration advances every unfinished trajectory by exactly one event (a failure, or the
end of the run); all trajectories advance together as numpy arrays, so the Python loop runs once
per failure, never per GPU or per step. Between two events a trajectory is either recovering or
training, and the progress made while training is computed in closed form from the step time,
the checkpoint interval ``K`` and the checkpoint cost.

Model (times in seconds; see :class:`~phoenixft.sim.scenario.Scenario`):

* Failures: node failures arrive as the superposition of per-node processes; exponential per-node
  lifetimes give a Poisson process of rate ``active_nodes / node_mttf``. ``weibull`` makes the
  system-level inter-arrival times Weibull(shape) with the same mean (a renewal process, the
  usual fit of bursty failure traces; shape < 1 means bursts). It is applied at system level on
  purpose: a superposition of thousands of independent per-node renewal processes converges to
  a Poisson process (Palm-Khintchine), so per-node Weibull lifetimes alone would not produce
  the bursts seen in real traces. Correlated domain events
  (rack / switch) form an independent Poisson process of rate ``domains / domain_mttf`` and
  take ``domain_size`` nodes down at once. A node failure is transient with probability
  ``transient_frac`` (the node survives, its host memory is intact) and permanent otherwise;
  domain events are permanent.
* A failure during a recovery aborts it (the elapsed part is charged to ``interrupted``) and a new
  recovery starts at once; the new one is at least as heavy as the aborted one.
* Spare pool: ``spares`` warm nodes; a spare taken at time t is replaced at ``t + provision_s``.
  Policies that need a node and find the pool empty wait for the next one (``spare_wait``);
  with ``spares = 0`` every lost node waits ``provision_s``.
* Shard loss (in-memory policies): the optimizer shard of a node has ``replicas`` copies on other
  nodes (in other domains with ``placement = aware``). While failed nodes are not yet recovered,
  a further permanent failure loses a shard with the increment of the union bound of Eq. (6)
  evaluated on the failed set; a loss falls back to the last persistent checkpoint (restart +
  replay, charged to ``fallback``).

Policies: ``checkpoint-restart`` (restart the job, replay since the last of the checkpoints taken
every ``K`` steps), ``phoenix`` (per-step in-memory protection; in-place restart for transient
faults, hot-swap of a spare for permanent ones, shrink (or wait, ``no_spare``) when the pool is
empty, persistent fallback), ``inplace`` (in-place restart for transient faults,
checkpoint-restart for permanent ones) and ``shrink`` (in-place for transient, continue on the
survivors for permanent; step time grows as ``nodes / active_nodes`` at a constant global batch).
A shrink drops the lost node's whole data-parallel replica, ``replica_nodes`` nodes (1 when data-parallel
only; PP for a TP x PP mesh whose nodes each hold a tensor-parallel group): its healthy nodes leave too.
Nodes removed by a shrink are repaired in ``provision_s`` and rejoin at the next recovery.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .scenario import Scenario, canonical_policy
from .stats import Estimate, mean_ci, ratio_ci

__all__ = [
    "CAUSES",
    "FAILURE_CAUSES",
    "OVERHEAD_CAUSES",
    "MCResult",
    "simulate",
]

FAILURE_CAUSES: tuple[str, ...] = (
    "restart",
    "replay",
    "hotswap",
    "inplace",
    "shrink",
    "spare_wait",
    "partial_step",
    "fallback",
    "interrupted",
)
OVERHEAD_CAUSES: tuple[str, ...] = ("checkpoint", "protection", "degraded")
CAUSES: tuple[str, ...] = FAILURE_CAUSES + OVERHEAD_CAUSES
_C = {c: i for i, c in enumerate(CAUSES)}

# Recovery kinds, ordered by weight: a recovery interrupted by a failure never gets lighter.
_NONE, _INPLACE, _SHRINK, _HOTSWAP, _RESTART = 0, 1, 2, 3, 4
_KIND_CAUSE = np.array([_C["restart"], _C["inplace"], _C["shrink"], _C["hotswap"], _C["restart"]])


@dataclass
class MCResult:
    """Per-trajectory outcomes of one policy on one scenario."""

    policy: str
    scenario: Scenario
    ckpt_every: int
    trajectories: int
    seed: int
    wall_s: np.ndarray
    useful_s: np.ndarray
    failures: np.ndarray
    transient: np.ndarray
    domain_events: np.ndarray
    shard_losses: np.ndarray
    interrupted: np.ndarray
    lost: dict[str, np.ndarray]
    episodes: np.ndarray
    episode_sum_s: np.ndarray
    unfinished: int
    iterations: int
    runtime_s: float
    episode_samples: np.ndarray | None = field(default=None, repr=False)

    @property
    def ettr(self) -> np.ndarray:
        """Effective training time ratio per trajectory: failure-free time / wall time."""
        return self.useful_s / self.wall_s

    def ettr_ci(self) -> Estimate:
        """Mean ETTR over trajectories (the ETTR of one run) with its 95% CI."""
        return mean_ci(self.ettr)

    def ettr_pooled(self) -> Estimate:
        """Long-run ETTR ``sum(useful) / sum(wall)`` (the renewal-reward ratio the analytic
        model predicts), with a delta-method 95% CI. The per-run mean exceeds it slightly
        (Jensen) when the wall time of a run varies a lot."""
        return ratio_ci(self.useful_s, self.wall_s)

    def per_failure(self, cause: str) -> Estimate:
        """Seconds lost to ``cause`` per failure event (ratio of means, delta-method CI)."""
        return ratio_ci(self.lost[cause], self.failures)

    def time_to_resume(self) -> Estimate:
        """Seconds from a failure to regaining the pre-failure progress, per recovery episode."""
        return ratio_ci(self.episode_sum_s, self.episodes)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary: ETTR, per-failure losses by cause, overhead fractions, counts."""
        wall = self.wall_s
        return {
            "policy": self.policy,
            "ckpt_every": self.ckpt_every,
            "trajectories": self.trajectories,
            "seed": self.seed,
            "ettr": self.ettr_ci().as_dict(),
            "ettr_pooled": self.ettr_pooled().as_dict(),
            "ettr_p05_p50_p95": [float(v) for v in np.percentile(self.ettr, [5, 50, 95])],
            "wall_days": mean_ci(wall / 86400.0).as_dict(),
            "failures_per_run": mean_ci(self.failures).as_dict(),
            "lost_per_failure_s": {c: self.per_failure(c).as_dict() for c in FAILURE_CAUSES},
            "lost_per_failure_total_s": ratio_ci(
                np.sum([self.lost[c] for c in FAILURE_CAUSES], axis=0), self.failures
            ).as_dict(),
            "overhead_fraction_of_wall": {c: mean_ci(self.lost[c] / wall).as_dict() for c in OVERHEAD_CAUSES},
            "time_to_resume_s": self.time_to_resume().as_dict(),
            "counts_per_run": {
                "transient": float(self.transient.mean()),
                "domain_events": float(self.domain_events.mean()),
                "shard_losses": float(self.shard_losses.mean()),
                "interrupted_recoveries": float(self.interrupted.mean()),
            },
            "unfinished": self.unfinished,
            "runtime_s": self.runtime_s,
        }


def _falling(x: np.ndarray, r: int) -> np.ndarray:
    out = np.ones_like(x, dtype=np.float64)
    for i in range(r):
        out = out * np.maximum(x - i, 0.0)
    return out


def _expected_dead_chains(m: np.ndarray, d: np.ndarray, sc: Scenario) -> np.ndarray:
    """Union bound: expected number of shards whose owner and all replicas are failed.

    ``m`` independently failed nodes and ``d`` failed domains. A shard's ``k+1`` holders sit in
    distinct domains (aware placement) or on consecutive ring nodes (unaware placement, where a
    domain event of ``domain_size >= k+1`` nodes loses a shard for certain).
    """
    n, g, nd, r = float(sc.nodes), sc.domain_size, float(sc.domains), sc.replicas + 1
    m = m.astype(np.float64)
    d = d.astype(np.float64)
    if n < r:
        return np.zeros_like(m)
    if sc.placement == "unaware" or nd < r:
        e = n * _falling(m + d * g, r) / _falling(np.array(n), r)
        if g >= r:
            e = np.where(d > 0, np.inf, e)
        return e
    total = np.zeros_like(m)
    denom = _falling(np.array(nd), r)
    for j in range(r + 1):
        hyp = math.comb(r, j) * _falling(d, j) * _falling(nd - d, r - j) / denom
        rest = np.maximum(n - d * g, 1.0)
        total += hyp * _falling(m, r - j) / np.maximum(_falling(rest, r - j), 1e-300)
    return n * total


class _LossTable:
    """:func:`_expected_dead_chains` tabulated over small ``(m, d)``, grown on demand."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.table = self._build(32, 8)

    def _build(self, mm: int, dd: int) -> np.ndarray:
        m, d = np.meshgrid(np.arange(mm + 1), np.arange(dd + 1), indexing="ij")
        return _expected_dead_chains(m.ravel(), d.ravel(), self.sc).reshape(mm + 1, dd + 1)

    CAP = (512, 64)

    def __call__(self, m: np.ndarray, d: np.ndarray) -> np.ndarray:
        rows, cols = self.table.shape
        mm, dd = int(m.max(initial=0)), int(d.max(initial=0))
        if (mm >= rows and rows <= self.CAP[0]) or (dd >= cols and cols <= self.CAP[1]):
            rows = min(max(2 * mm, rows), self.CAP[0] + 1)
            cols = min(max(2 * dd, cols), self.CAP[1] + 1)
            self.table = self._build(rows - 1, cols - 1)
        out = self.table[np.minimum(m, rows - 1), np.minimum(d, cols - 1)]
        big = (m >= rows) | (d >= cols)
        if big.any():
            out[big] = _expected_dead_chains(m[big], d[big], self.sc)
        return out


class _Pool:
    """Spare pool per trajectory: sorted times at which each spare slot is (again) ready."""

    def __init__(self, trajectories: int, spares: int, provision_s: float) -> None:
        self.ready = np.zeros((trajectories, spares))
        self.provision_s = provision_s

    def available(self, t: np.ndarray) -> np.ndarray:
        return (self.ready <= t[:, None]).sum(axis=1)

    def take_ready(self, want: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Take up to ``want`` spares that are ready at ``t``; return how many were taken."""
        if self.ready.shape[1] == 0:
            return np.zeros_like(want)
        take = np.minimum(want, self.available(t))
        cols = np.arange(self.ready.shape[1])[None, :] < take[:, None]
        self.ready = np.where(cols, (t + self.provision_s)[:, None], self.ready)
        self.ready.sort(axis=1)
        return take

    def take_wait(self, want: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Take ``want`` spares, waiting for refills; return the time all of them are present."""
        ready_at = np.full(t.shape, -np.inf)
        if self.ready.shape[1] == 0:
            return np.where(want > 0, t + self.provision_s, ready_at)
        for j in range(int(want.max(initial=0))):
            rows = want > j
            r = np.maximum(self.ready[:, 0], t)
            self.ready[:, 0] = np.where(rows, r + self.provision_s, self.ready[:, 0])
            self.ready.sort(axis=1)
            ready_at = np.where(rows, np.maximum(ready_at, r), ready_at)
        return ready_at


class _RepairQueue:
    """Nodes removed by a shrink, with the times they come back (``inf`` = free slot)."""

    def __init__(self, trajectories: int) -> None:
        self.back = np.full((trajectories, 8), np.inf)

    def push(self, count: np.ndarray, when: np.ndarray) -> None:
        for j in range(int(count.max(initial=0))):
            rows = count > j
            free = np.isinf(self.back)
            if not free[rows].any(axis=1).all():
                self.back = np.concatenate([self.back, np.full_like(self.back, np.inf)], axis=1)
                free = np.isinf(self.back)
            col = np.argmax(free, axis=1)
            idx = np.flatnonzero(rows)
            self.back[idx, col[idx]] = when[idx]

    def pop_returned(self, rows: np.ndarray, t: np.ndarray) -> np.ndarray:
        back = (self.back <= t[:, None]) & rows[:, None]
        self.back[back] = np.inf
        return back.sum(axis=1)


def _checkpoint_plan(sc: Scenario, policy: str, ckpt_every: int | None, trajectories: int) -> tuple[int, float]:
    """Validate the arguments; the checkpoint interval ``K`` (steps) and the cost of one write (s)."""
    if trajectories < 1:
        raise ValueError("trajectories must be >= 1")
    if ckpt_every is not None and ckpt_every < 1:
        raise ValueError("ckpt_every must be >= 1")
    if policy == "checkpoint-restart" and ckpt_every is None:
        raise ValueError("checkpoint-restart needs ckpt_every")
    if ckpt_every is not None and policy in ("checkpoint-restart", "inplace"):
        return int(ckpt_every), sc.ckpt_s
    k_int = sc.persist_every if sc.persist_every > 0 else sc.steps + 1
    return k_int, (sc.persist_s if sc.persist_every > 0 else 0.0)


class _Runs:
    """The state of every trajectory of one simulation, and one event's advance of all of them."""

    def __init__(self, sc: Scenario, policy: str, k_int: int, delta: float, trajectories: int, seed: int,
                 record_episodes: bool) -> None:
        self.sc, self.policy, self.k_int, self.delta = sc, policy, k_int, delta
        self.cr = policy == "checkpoint-restart"
        self.over = 1.0 if self.cr else sc.overhead_ratio
        self.T = T = trajectories
        self.record_episodes = record_episodes
        self.costs = np.array([0.0, sc.inplace_s, sc.shrink_s, sc.hotswap_s, sc.restart_s])
        ss = np.random.SeedSequence(seed)
        self.rng_node, self.rng_dom, self.rng_cls, self.rng_loss = (np.random.default_rng(s) for s in ss.spawn(4))
        self.weib_scale = 1.0 / math.gamma(1.0 + 1.0 / sc.weibull_shape)
        self.dom_mean = sc.domain_mttf_s / sc.domains

        self.n_active = np.full(T, sc.nodes, dtype=np.int64)
        self.t_node = self.node_mean(self.n_active) * self.node_unit()
        self.t_dom = self.dom_gap() if math.isfinite(self.dom_mean) else np.full(T, np.inf)
        self.active = np.ones(T, dtype=bool)
        self.unfinished = np.zeros(T, dtype=bool)
        self.end_time = np.zeros(T)
        self.prog = np.zeros(T, dtype=np.int64)  # committed steps (in memory or persistent)
        self.persist = np.zeros(T, dtype=np.int64)  # last persistent checkpoint (steps)
        self.rec_end = np.zeros(T)  # time the job resumes / resumed training
        self.rec_start = np.zeros(T)
        self.rec_kind = np.zeros(T, dtype=np.int64)
        self.rec_fb = np.zeros(T, dtype=bool)
        self.rec_wait = np.zeros(T)
        self.spare_at = np.full(T, -np.inf)
        self.deficit = np.zeros(T, dtype=np.int64)
        self.win_m = np.zeros(T, dtype=np.int64)
        self.win_d = np.zeros(T, dtype=np.int64)
        self.lost = np.zeros((T, len(CAUSES)))
        self.useful = np.zeros(T)
        self.cnt = {k: np.zeros(T, dtype=np.int64) for k in ("fail", "tr", "dom", "loss", "intr", "ep")}
        self.ep_start = np.zeros(T)
        self.ep_lost = np.zeros(T)
        self.ep_sum = np.zeros(T)
        self.samples: list[np.ndarray] = []
        self.pool = _Pool(T, sc.spares, sc.provision_s)
        self.repair = _RepairQueue(T)
        self.loss_table = _LossTable(sc)
        self.iterations = 0

    # ------------------------------------------------------------------ arrivals
    def node_unit(self) -> np.ndarray:
        """Unit-mean inter-arrival draws of the node process (one per trajectory)."""
        if self.sc.arrival == "weibull":
            return self.weib_scale * self.rng_node.weibull(self.sc.weibull_shape, self.T)
        return self.rng_node.standard_exponential(self.T)

    def node_mean(self, active_nodes: np.ndarray) -> np.ndarray:
        return self.sc.node_mttf_s / np.maximum(active_nodes, 1)

    def dom_gap(self) -> np.ndarray:
        return self.dom_mean * self.rng_dom.standard_exponential(self.T)

    # ------------------------------------------------------------------ bookkeeping
    def commit(self, mask: np.ndarray, steps: np.ndarray, ckpts: np.ndarray, slow: np.ndarray) -> None:
        """Count ``steps`` trained (and ``ckpts`` checkpoints written) where ``mask``."""
        st = np.where(mask, steps, 0) * self.sc.step_s
        self.useful[:] += st
        self.lost[:, _C["protection"]] += st * (self.over - 1.0)
        self.lost[:, _C["degraded"]] += st * self.over * (slow - 1.0)
        self.lost[:, _C["checkpoint"]] += np.where(mask, ckpts, 0) * self.delta

    def rollback(self, mask: np.ndarray, cause: str) -> None:
        """Fall back to the last persistent checkpoint where ``mask``, charging the lost steps to ``cause``."""
        back = np.where(mask, self.prog - self.persist, 0) * self.sc.step_s
        self.useful[:] -= back
        self.lost[:, _C[cause]] += back
        self.ep_lost[:] += back
        self.prog[:] = np.where(mask, self.persist, self.prog)

    def shrink_by(self, count: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drop the data-parallel replicas of ``count`` lost nodes (``replica_nodes`` nodes each: a mesh drops its
        whole column, one node per pipeline stage) but keep at least one replica; the rest are waited for
        (repaired). A dropped replica's healthy nodes wait for its repaired one and rejoin with it."""
        r = self.sc.replica_nodes
        replicas = np.minimum(count, np.maximum(self.n_active // r - 1, 0))
        removed = replicas * r
        self.n_active[:] -= removed
        self.repair.push(removed, t + self.sc.provision_s)
        return removed, np.where(count > replicas, t + self.sc.provision_s, -np.inf)

    # ------------------------------------------------------------------ one event
    def advance(self, horizon: float) -> None:
        """Advance every unfinished trajectory to its next event: a failure, or the end of the run."""
        self.iterations += 1
        t_e = np.minimum(self.t_node, self.t_dom)
        is_dom = self.t_dom < self.t_node
        in_rec = self.active & (t_e < self.rec_end)
        run = self.active & ~in_rec
        self.close_recoveries(run & (self.rec_kind > 0))
        fail_run = self.train_until(t_e, run, in_rec)
        if fail_run is None:
            return
        ev = in_rec | fail_run
        self.fail(t_e, is_dom, in_rec, ev)
        stuck = self.active & (t_e > horizon)
        if stuck.any():
            self.unfinished |= stuck
            self.end_time[stuck] = t_e[stuck]
            self.active[stuck] = False

    def close_recoveries(self, done: np.ndarray) -> None:
        """A recovery that ended before this event completed: charge it and close its episode."""
        if not done.any():
            return
        idx = np.flatnonzero(done)
        cause = np.where(self.rec_fb[idx], _C["fallback"], _KIND_CAUSE[self.rec_kind[idx]])
        self.lost[idx, cause] += self.costs[self.rec_kind[idx]]
        self.lost[idx, _C["spare_wait"]] += self.rec_wait[idx]
        episode = self.rec_end[idx] - self.ep_start[idx] + self.ep_lost[idx]
        self.ep_sum[idx] += episode
        self.cnt["ep"][idx] += 1
        if self.record_episodes:
            self.samples.append(episode)
        self.rec_kind[idx] = _NONE
        self.rec_fb[idx] = False
        self.rec_wait[idx] = 0.0
        self.spare_at[idx] = -np.inf
        self.win_m[idx] = 0
        self.win_d[idx] = 0

    def train_until(self, t_e: np.ndarray, run: np.ndarray, in_rec: np.ndarray) -> np.ndarray | None:
        """Training from ``rec_end`` until the event or the end of the run: finish the runs that end
        first, commit the progress of the others up to their failure and return them (None when no
        trajectory has a failure to handle)."""
        sc, k_int, delta, N, prog = self.sc, self.k_int, self.delta, self.sc.steps, self.prog
        slow = sc.nodes / np.maximum(self.n_active, 1)
        s = sc.step_s * self.over * slow
        cyc = k_int * s + delta
        j0 = prog // k_int
        dt = t_e - self.rec_end
        t_fin = (N - prog) * s + (N // k_int - j0) * delta
        fin = run & (dt >= t_fin)
        if fin.any():
            self.commit(fin, N - prog, N // k_int - j0, slow)
            self.end_time[fin] = self.rec_end[fin] + t_fin[fin]
            prog[fin] = N
            self.active[fin] = False
        fail_run = run & ~fin
        if not (in_rec | fail_run).any():
            return None
        x = (prog - j0 * k_int) * s + dt
        jr = np.floor(x / cyc)
        rem = x - jr * cyc
        m = np.minimum(np.floor(rem / s), k_int)
        if self.cr:
            new_prog = (j0 + jr) * k_int
            done_at = jr * cyc
        else:
            new_prog = (j0 + jr) * k_int + m
            done_at = jr * cyc + m * s
        new_prog = np.maximum(new_prog.astype(np.int64), prog)
        seg_lost = np.where(fail_run, np.maximum(x - np.maximum(done_at, x - dt), 0.0), 0.0)
        self.commit(fail_run, new_prog - prog, (j0 + jr).astype(np.int64) - j0, slow)
        self.lost[:, _C["replay" if self.cr else "partial_step"]] += seg_lost
        prog[:] = np.where(fail_run, new_prog, prog)
        self.persist[:] = np.where(fail_run, np.maximum((j0 + jr).astype(np.int64) * k_int, self.persist), self.persist)
        self.persist[:] = np.minimum(self.persist, prog)
        self.ep_start[:] = np.where(fail_run, t_e, self.ep_start)
        self.ep_lost[:] = np.where(fail_run, seg_lost, self.ep_lost)
        return fail_run

    def fail(self, t_e: np.ndarray, is_dom: np.ndarray, in_rec: np.ndarray, ev: np.ndarray) -> None:
        """The failure event where ``ev``: classify it, apply the policy, start (or extend) the recovery,
        draw the next arrivals."""
        sc, T = self.sc, self.T
        self.lost[:, _C["interrupted"]] += np.where(in_rec, t_e - self.rec_start, 0.0)
        self.cnt["intr"] += in_rec
        u_cls = self.rng_cls.random(T)
        u_loss = self.rng_loss.random(T)
        node_draw = self.node_unit()
        dom_draw = self.dom_gap() if math.isfinite(self.dom_mean) else None
        dom = ev & is_dom
        trans = ev & ~is_dom & (u_cls < sc.transient_frac)
        perm = ev & ~trans
        g = np.where(dom, min(sc.domain_size, sc.nodes), np.where(perm, 1, 0)).astype(np.int64)
        self.cnt["fail"] += ev
        self.cnt["tr"] += trans
        self.cnt["dom"] += dom

        loss = np.zeros(T, dtype=bool)
        if self.policy in ("phoenix", "shrink"):
            loss = self.shard_loss(perm, dom, u_loss)
        if self.cr:
            kind = np.zeros(T, dtype=np.int64)
            kind[ev] = _RESTART
            ready = self.pool.take_wait(g, t_e)
        elif self.policy == "inplace":
            kind, ready = self.respond_inplace(t_e, trans, perm, g)
        elif self.policy == "phoenix":
            kind, ready = self.respond_phoenix(t_e, ev, trans, perm, g, loss)
        else:
            kind, ready = self.respond_shrink(t_e, ev, trans, perm, g, loss)
        self.start_recovery(t_e, ev, in_rec, kind, ready, loss)

        # Next arrivals (exponential node process is memoryless: redraw after any event).
        redraw_node = ev if sc.arrival == "exponential" else ev & ~is_dom
        self.t_node = np.where(redraw_node, t_e + self.node_mean(self.n_active) * node_draw, self.t_node)
        if dom_draw is not None:
            self.t_dom = np.where(dom, t_e + dom_draw, self.t_dom)

    def shard_loss(self, perm: np.ndarray, dom: np.ndarray, u_loss: np.ndarray) -> np.ndarray:
        """In-memory policies: whether this permanent failure lost a shard (owner and all replicas);
        a loss falls back to the last persistent checkpoint."""
        before = self.loss_table(self.win_m, self.win_d)
        self.win_m += np.where(perm & ~dom & ~self.rec_fb, 1, 0)
        self.win_d += np.where(dom & ~self.rec_fb, 1, 0)
        after = self.loss_table(self.win_m, self.win_d)
        p_loss = np.clip(np.nan_to_num(after - before, nan=1.0, posinf=1.0), 0.0, 1.0)
        loss = perm & ~self.rec_fb & (u_loss < p_loss)
        self.cnt["loss"] += loss
        self.rollback(loss, "fallback")
        return loss

    def respond_inplace(self, t_e: np.ndarray, trans: np.ndarray, perm: np.ndarray,
                        g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """In-place restart for transient failures, checkpoint-restart for permanent ones."""
        kind = np.where(trans, _INPLACE, np.where(perm, _RESTART, _NONE))
        self.rollback(perm, "replay")
        return kind, self.pool.take_wait(g, t_e)

    def respond_phoenix(self, t_e: np.ndarray, ev: np.ndarray, trans: np.ndarray, perm: np.ndarray, g: np.ndarray,
                        loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Refill the nodes a shrink removed, then in-place for transient failures, hot-swap of a spare for
        permanent ones, shrink (or wait) when the pool is empty, restart after a shard loss."""
        back = np.minimum(self.repair.pop_returned(ev, t_e), self.deficit)
        self.n_active += back
        self.deficit -= back
        fill = self.pool.take_ready(np.where(ev, self.deficit, 0), t_e)
        self.deficit -= fill
        self.n_active += fill
        kind = np.where(trans, _INPLACE, _NONE)
        if self.sc.no_spare == "wait":
            ready = self.pool.take_wait(g, t_e)
            kind = np.where(perm, _HOTSWAP, kind)
        else:
            got = self.pool.take_ready(g, t_e)
            kind = np.where(perm & (got > 0), _HOTSWAP, np.where(perm, _SHRINK, kind))
            removed, ready = self.shrink_by(g - got, t_e)
            self.deficit += removed
        return np.where(loss, _RESTART, kind), ready

    def respond_shrink(self, t_e: np.ndarray, ev: np.ndarray, trans: np.ndarray, perm: np.ndarray, g: np.ndarray,
                       loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """In-place for transient failures, continue on the survivors for permanent ones."""
        self.n_active += self.repair.pop_returned(ev, t_e)
        kind = np.where(trans, _INPLACE, np.where(perm, _SHRINK, _NONE))
        kind = np.where(loss, _RESTART, kind)
        _, ready = self.shrink_by(g, t_e)
        return kind, ready

    def start_recovery(self, t_e: np.ndarray, ev: np.ndarray, in_rec: np.ndarray, kind: np.ndarray,
                       ready: np.ndarray, loss: np.ndarray) -> None:
        """Start the recovery of ``kind`` where ``ev``; an interrupted one never gets lighter."""
        kind = np.where(in_rec, np.maximum(kind, self.rec_kind), kind)
        self.rec_fb |= loss
        self.spare_at = np.where(ev, np.maximum(self.spare_at, ready), self.spare_at)
        wait = np.where(ev, np.maximum(self.spare_at - t_e, 0.0), 0.0)
        self.rec_kind = np.where(ev, kind, self.rec_kind)
        self.rec_wait = np.where(ev, wait, self.rec_wait)
        self.rec_start = np.where(ev, t_e, self.rec_start)
        self.rec_end = np.where(ev, t_e + wait + self.costs[kind], self.rec_end)

    def result(self, seed: int, runtime_s: float) -> MCResult:
        """The per-trajectory outcomes."""
        sc, cr, cnt = self.sc, self.cr, self.cnt
        return MCResult(
            policy=self.policy,
            scenario=sc,
            ckpt_every=self.k_int if (cr or sc.persist_every > 0) else 0,
            trajectories=self.T,
            seed=seed,
            wall_s=self.end_time,
            useful_s=self.useful,
            failures=cnt["fail"],
            transient=cnt["tr"],
            domain_events=cnt["dom"],
            shard_losses=cnt["loss"],
            interrupted=cnt["intr"],
            lost={c: self.lost[np.arange(self.T), _C[c]].copy() for c in CAUSES},
            episodes=cnt["ep"],
            episode_sum_s=self.ep_sum,
            unfinished=int(self.unfinished.sum()),
            iterations=self.iterations,
            runtime_s=runtime_s,
            episode_samples=np.concatenate(self.samples) if self.record_episodes and self.samples else None,
        )


def simulate(
    sc: Scenario,
    policy: str,
    *,
    ckpt_every: int | None = None,
    trajectories: int = 1000,
    seed: int = 0,
    record_episodes: bool = False,
    horizon_factor: float = 10.0,
) -> MCResult:
    """Simulate ``trajectories`` independent runs of ``sc`` under ``policy``.

    ``ckpt_every`` is the checkpoint interval ``K`` (steps, each write costing ``sc.ckpt_s``) of
    checkpoint-restart (required) and of in-place's persistent tier (optional); otherwise the
    in-memory policies use ``sc.persist_every`` / ``sc.persist_s`` for their persistent tier
    (``persist_every = 0``: none, a fallback restarts from step 0).

    Failure arrivals come from their own random streams, so two policies run with the same seed
    see the same failure times (common random numbers) until a shrink changes the node count.
    Trajectories still running after ``horizon_factor`` times the failure-free duration are
    stopped and counted in ``unfinished``.
    """
    t_start = time.perf_counter()
    policy = canonical_policy(policy)
    k_int, delta = _checkpoint_plan(sc, policy, ckpt_every, trajectories)
    runs = _Runs(sc, policy, k_int, delta, trajectories, seed, record_episodes)
    horizon = horizon_factor * sc.failure_free_s
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        while runs.active.any():
            runs.advance(horizon)
    return runs.result(seed, time.perf_counter() - t_start)
