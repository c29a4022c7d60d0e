"""What the launcher records as the run goes: every step record appended to `metrics.jsonl` (line
buffered, so `tail -f` follows it), the live goodput, and the exports (`observe/sinks.py`).

Step records are read from the store in order, each once it exists and belongs to an epoch that may
still write it: after a recovery resumed from step R in epoch E, steps past R are read again once
their record is E's or later (the replay), and appended again. At the end the report makes
`metrics.jsonl` hold each step's last execution once (`report.write_metrics`).

The launcher is also the one process that deletes step records from the store (`prune`): a record leaves
once it is in `metrics.jsonl` and `--store-step-records` newer steps were recorded, so the store holds a
window of the newest steps whatever the run's length (the report takes the older ones from the file,
`history`). The window covers what reads step records from the store: the latest one (the display, `phoenixft
status`, a drain's or stop's step), the coordinator's straggler poll, and a join's spike-guard window up to
its resume step. Only a record the current epoch keeps is deleted (a step at or before its resume step, or
one the epoch wrote itself), and the epoch is read again after the deletes: a recovery published meanwhile
may have replayed one of them, and such a step, once the new epoch is past it, is passed over (its earlier
execution stays in the file) instead of being waited for.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.auth import read_topology
from phoenixft.controlplane.values import parse_int, parse_json
from phoenixft.observe.goodput import account
from phoenixft.observe.report import STEP_BATCH, read_recoveries
from phoenixft.observe.sinks import PrometheusSink, TensorBoardSink

__all__ = ["LiveMetrics"]

GOODPUT_EVERY_S = 1.0  # the live goodput is recomputed at most this often
GOODPUT_SHARE = 0.02  # and at most this share of the launcher's time (a long run's records take longer)
PRUNE_EVERY_S = 0.2  # step records are deleted at most this often (each look: one epoch read, a topology, the deletes)
PRUNE_MAX = 4096  # and at most this many per look (a launcher that fell behind catches up over several)


class LiveMetrics:
    """The run's live records. `host`: where the Prometheus endpoint listens (the launcher's: 127.0.0.1, or
    the head's --host)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, host: str, t_launch: float,
                 info: Callable[[str], None] = print, token: str | None = None) -> None:
        self.cfg, self.run_dir, self.t_launch, self.info = cfg, run_dir, t_launch, info
        self.token = token  # the job token the topologies read are checked with
        self.steps: dict[int, tuple[float, float, int]] = {}  # each step's latest execution seen: t_end, dt, epoch
        self.events: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.next: int | None = None  # the next step record to read
        self.floor: list[tuple[int, int]] = []  # (R, E): steps past R are read from epoch E's records on
        self.pending = False  # a recovery planned whose first step has not been read yet
        self.ongoing: dict[str, Any] | None = None  # the recovery under way, as its events tell it so far
        self.rank0_node: str | None = None
        self.n_recoveries = 0
        self.quarantined: set[str] = set()
        self.goodput: dict[str, Any] | None = None
        self._goodput_next = 0.0  # when the live goodput may be recomputed
        # the endpoint first: a port that is taken fails the start before any file is open
        self.prom: PrometheusSink | None = PrometheusSink(cfg.metrics_host, cfg.metrics_port) \
            if cfg.metrics_port >= 0 else None
        self.tb: TensorBoardSink | None = TensorBoardSink(cfg.tensorboard) if cfg.tensorboard else None
        self._file: IO[str] | None = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._start = self._file.tell()  # where this run's lines begin (a reused run directory has older ones)
        self.keep = cfg.store_step_records  # the newest step records left in the store
        self.pruned = 0  # the step records up to this one were deleted from the store (each one is in the file)
        self.pruned_epoch = -1  # the newest epoch under which records were deleted
        self.newest_epoch = -1  # the newest epoch a step record recorded so far came from
        self.spike_window = cfg.spike_window
        self.claims: list[tuple[int, str]] = []  # (step, what): SDC records' once-a-run claims, deleted with the step
        self.raced: dict[int, int] = {}  # a step deleted while epoch E began (E's resume step before it): E
        self._prune_at = 0.0
        if self.prom is not None:
            (run_dir / "metrics.port").write_text(f"{self.prom.port}\n")

    # ------------------------------------------------------------------ inputs
    def event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        kind = ev.get("kind")
        if kind == "epoch" and isinstance(ev.get("nodes"), list) and ev["nodes"]:
            self.rank0_node = str(ev["nodes"][0])
        elif kind == "failures_reported":
            t_first = ev.get("t_first", ev.get("t"))
            faults = [float(f["t"]) for f in self.events if f.get("kind") == "fault" and isinstance(f.get("t"), float)
                      and isinstance(t_first, float) and f["t"] <= t_first]
            self.ongoing = {"class": None, "action": None, "stages": {}, "resumed_step": None,
                            "times": {"fault": max(faults, default=None), "first_report": t_first}}
        elif kind == "recovery_planned" and isinstance(ev.get("resume_step"), int):
            if self.ongoing is not None:
                self.ongoing["times"]["decided"] = ev.get("t")
            r, e = int(ev["resume_step"]), int(ev.get("epoch") or 0)
            self.floor.append((r, e))
            self._rewind(r, e)
            self.pending = True
        elif kind == "classified":
            if self.ongoing is not None:
                self.ongoing.update({"class": ev.get("class"), "action": ev.get("action")})
            self.n_recoveries += 1
            if self.prom is not None:
                self.prom.recovery(str(ev.get("class")), str(ev.get("action")))
            self._tb("recovery", self.n_recoveries, max(self.steps, default=0))
        elif isinstance(ev.get("once"), str) and isinstance(ev.get("step"), int):  # (an SDC record logged once)
            self.claims.append((int(ev["step"]), ev["once"]))
        elif kind in ("quarantined", "host_quarantined") and ev.get("host"):
            self.quarantined.add(str(ev["host"]))
            if self.prom is not None:
                self.prom.quarantined.set(len(self.quarantined))

    def _rewind(self, r: int, e: int) -> None:
        """Epoch `e` resumes from step `r`: the steps past it recorded from an earlier epoch are read again once
        `e` replays them (those recorded from `e` already, when its event came late, are not). A step deleted
        from the store under `e` or a later epoch is final for that epoch: its recorded execution stands."""
        stale = [s for s, (_, _, ep) in self.steps.items() if s > r and ep < e]
        lo = max(r, self.pruned if e <= self.pruned_epoch else 0) + 1
        for s in stale:
            if s >= lo:
                del self.steps[s]
        if self.next is None:
            return
        # (a record without its times is not in `steps`: read again unless deleted already)
        unknown = next((s for s in range(max(lo - 1, self.pruned) + 1, self.next) if s not in self.steps), None)
        again = min([s for s in stale if s >= lo] + ([unknown] if unknown is not None else []), default=self.next)
        if again < self.next:
            self.next = again
            self.pruned = min(self.pruned, again - 1)  # (the replay writes them again: deleted again once recorded)

    def advance(self, store: Store, progress: int) -> None:
        """Read the step records up to `progress` that are there (in order), record each."""
        if self.next is None:
            topo = read_topology(store, 0, self.token)
            self.next = topo.resume_step + 1 if topo is not None else 1
            self.pruned = self.next - 1  # (a resumed run has no record before its checkpoint's step)
        while self.next <= progress:
            last = min(progress, self.next + STEP_BATCH - 1)
            names = [keys.step(s) for s in range(self.next, last + 1)]
            if store.check(names):
                raws = store.multi_get(names)
            elif store.check(names[:1]):  # (a later one missing: one at a time)
                raws = [store.get(names[0])]
            elif self._replayed_and_deleted(store, self.next, progress):
                self.next += 1
                continue
            else:
                return
            for s, raw in zip(range(self.next, last + 1), raws, strict=False):
                rec = parse_json(sealed.unseal(keys.step(s), raw), keys.step(s))
                epoch = rec.get("epoch") if rec is not None else None
                if rec is not None and (epoch if isinstance(epoch, int) else 0) < self._min_epoch(s):
                    return  # (not written yet by the epoch that runs it now)
                if rec is not None:  # (one that is not a JSON object is logged by parse_json, and passed)
                    self._record(rec)
                self.raced.pop(s, None)
                self.next = s + 1
        if self.pending and self.steps and self.floor and self.steps[max(self.steps)][2] >= self.floor[-1][1]:
            self.pending = False  # the recovery's first step is in: its entry is complete
            self.recoveries = read_recoveries(store, self.cfg, self.token)
            self.ongoing = None
            if self.recoveries:
                self._tb("recovery", self.n_recoveries, max(self.steps), self.recoveries[-1])

    def _replayed_and_deleted(self, store: Store, s: int, progress: int) -> bool:
        """Whether step s was deleted while a recovery began whose epoch has gone past it since (its record of
        that execution is gone for good: the one before it stays in the file). Said once."""
        e = self.raced.get(s)
        if e is None or progress <= s:
            return False
        rec = sealed.get_json(store, keys.step(progress)) if store.check([keys.step(progress)]) else None
        epoch = rec.get("epoch") if isinstance(rec, dict) else None
        if not isinstance(epoch, int) or epoch < e:
            return False
        del self.raced[s]
        self.info(f"!! step {s}: its record as epoch {e} replayed it was deleted from the store as that epoch began; "
                  "metrics.jsonl holds its earlier execution")
        return True

    def prune(self, store: Store, now: float | None = None) -> int:
        """Delete the step records that are in metrics.jsonl and older than the newest --store-step-records
        (at most every PRUNE_EVERY_S, PRUNE_MAX at a time); how many were deleted. Nothing is deleted once
        the file could not be written (the store then keeps every record, for the report)."""
        now = time.monotonic() if now is None else now
        if self._file is None or self.next is None or now < self._prune_at:
            return 0
        self._prune_at = now + PRUNE_EVERY_S
        upto = min(self.next - 1 - self.keep, self.pruned + PRUNE_MAX)
        if upto <= self.pruned:
            return 0
        e0, r0 = self._current_epoch(store)
        if e0 < 0:
            return 0
        first = self.pruned + 1
        names = [keys.step(s) for s in range(first, upto + 1)]
        raws = store.multi_get(names) if store.check(names) else [store.get_nowait(n) for n in names]
        for s, raw in zip(range(first, upto + 1), raws, strict=True):
            if not self._final(s, raw, e0, r0):
                upto = s - 1
                break
        if upto < first:
            return 0
        for s in range(first, upto + 1):
            store.delete_key(keys.step(s))
        for _, what in [c for c in self.claims if c[0] <= upto]:  # (each names its epoch: never claimed again)
            store.delete_key(keys.sdc_logged(what))
        self.claims = [c for c in self.claims if c[0] > upto]
        e1, r1 = self._current_epoch(store)
        if e1 != e0:  # a recovery began meanwhile: a step past its resume step may have been replayed, then deleted
            self.raced.update({s: e1 for s in range(max(first, r1 + 1), upto + 1)})
        self.pruned, self.pruned_epoch = max(self.pruned, upto), max(self.pruned_epoch, e0)
        return upto - first + 1

    def _final(self, s: int, raw: bytes | None, e0: int, r0: int) -> bool:
        """Whether the record of step s that this launcher recorded is the one the store holds (`raw`) and the
        one epoch `e0` (resumed from step `r0`) keeps: a step at or before r0, or one `e0` wrote itself."""
        rec = parse_json(sealed.unseal(keys.step(s), raw, note=False), keys.step(s)) if raw is not None else None
        mine = self.steps.get(s)
        if mine is None:  # (recorded without its times: anyone reaching the store can write one)
            return not isinstance(rec, dict) or not isinstance(rec.get("t_end"), (int, float))
        if not isinstance(rec, dict) or (rec.get("t_end"), rec.get("epoch", 0)) != (mine[0], mine[2]):
            return False  # (another execution replaced it: read again once this launcher hears of its recovery)
        if r0 - self.spike_window < s <= r0 and self.newest_epoch < e0:
            return False  # (e0's members read the spike guard's window before its resume step as they join)
        return s <= r0 or mine[2] == e0

    def _current_epoch(self, store: Store) -> tuple[int, int]:
        """The epoch now published and its resume step ((-1, 0): none that verifies yet)."""
        e = parse_int(sealed.get(store, keys.EPOCH), keys.EPOCH, -1) if store.check([keys.EPOCH]) else -1
        topo = read_topology(store, e, self.token) if e >= 0 else None
        return (e, topo.resume_step) if topo is not None else (-1, 0)

    def history(self) -> dict[int, dict[str, Any]]:
        """Each step's last execution this run appended to metrics.jsonl (by step; a line that is not a JSON
        object with an int `step` is passed over)."""
        out: dict[int, dict[str, Any]] = {}
        try:
            with open(self.run_dir / "metrics.jsonl", "rb") as f:
                f.seek(self._start)
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                        out[rec["step"]] = rec
        except OSError as e:
            self.info(f"!! metrics.jsonl: could not read it back ({e})")
        return out

    def _min_epoch(self, s: int) -> int:
        return max((e for r, e in self.floor if s > r), default=0)

    def _record(self, rec: dict[str, Any]) -> None:
        try:  # (a record without its times is written out, not accounted: anyone reaching the store can write one)
            self.steps[int(rec["step"])] = (float(rec["t_end"]), float(rec["dt"]), int(rec.get("epoch", 0)))
            self.newest_epoch = max(self.newest_epoch, int(rec.get("epoch", 0)))
        except (KeyError, TypeError, ValueError):
            pass
        if self._file is not None:
            try:
                self._file.write(json.dumps(rec) + "\n")
            except OSError as e:  # (the report writes the whole file at the end)
                self.info(f"!! metrics.jsonl: stopped writing it as the run goes ({e})")
                self._file.close()
                self._file = None
        self._tb("step", rec)
        if self.prom is not None:
            self.prom.step(rec, self.rank0_node)

    # ------------------------------------------------------------------ outputs
    def live_goodput(self, now: float | None = None) -> dict[str, Any] | None:
        """The goodput so far (recomputed at most every GOODPUT_EVERY_S), exported as it is computed."""
        now = time.time() if now is None else now
        if now >= self._goodput_next and self.steps:
            took = time.perf_counter()
            self.set_goodput(self.account(now))
            took = time.perf_counter() - took
            self._goodput_next = now + max(GOODPUT_EVERY_S, took / GOODPUT_SHARE)
        return self.goodput

    def account(self, now: float | None = None) -> dict[str, Any]:
        """The goodput of what was seen so far (`now`: the end of the window; None: the last record's)."""
        steps = [{"step": s, "t_end": t, "dt": d} for s, (t, d, _) in self.steps.items()]
        ongoing = [self.ongoing] if self.ongoing is not None else []  # (its detection and decision so far)
        return account(steps, self.recoveries + ongoing, self.events, t_launch=self.t_launch, t_now=now)

    def set_goodput(self, g: dict[str, Any]) -> None:
        self.goodput = g
        if self.prom is not None:
            self.prom.set_goodput(g)
        self._tb("goodput", g, max(self.steps, default=0))

    def _tb(self, what: str, *args: Any) -> None:
        """A write to the TensorBoard files; one that fails (a full disk) stops them, not the run."""
        if self.tb is None:
            return
        try:
            getattr(self.tb, what)(*args)
        except Exception as e:  # noqa: BLE001 - whatever the writer raises: the training goes on
            self.info(f"!! --tensorboard: stopped writing ({type(e).__name__}: {e})")
            self.tb = None

    def close(self, report: dict[str, Any] | None = None) -> None:
        """The final goodput exported (the report's), the files flushed, the endpoint stopped."""
        if report is not None and isinstance(report.get("goodput"), dict):
            self.set_goodput(report["goodput"])
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tb is not None:
            with contextlib.suppress(Exception):
                self.tb.close()
            self.tb = None
        if self.prom is not None:
            self.prom.close()
            self.prom = None
