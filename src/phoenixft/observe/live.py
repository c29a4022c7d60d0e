"""What the launcher records as the run goes: every step record appended to `metrics.jsonl` (line
buffered, so `tail -f` follows it), the live goodput, and the exports (`observe/sinks.py`).

Step records are read from the store in order, each once it exists and belongs to an epoch that may
still write it: after a recovery resumed from step R in epoch E, steps past R are read again once
their record is E's or later (the replay), and appended again. At the end the report makes
`metrics.jsonl` hold each step's last execution once (`report.write_metrics`).
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
from phoenixft.controlplane.values import parse_json
from phoenixft.observe.goodput import account
from phoenixft.observe.report import STEP_BATCH, read_recoveries
from phoenixft.observe.sinks import PrometheusSink, TensorBoardSink

__all__ = ["LiveMetrics"]

GOODPUT_EVERY_S = 1.0  # the live goodput is recomputed at most this often
GOODPUT_SHARE = 0.02  # and at most this share of the launcher's time (a long run's records take longer)


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
            for s in [s for s in self.steps if s > r]:
                del self.steps[s]
            if self.next is not None:
                self.next = min(self.next, r + 1)
            self.pending = True
        elif kind == "classified":
            if self.ongoing is not None:
                self.ongoing.update({"class": ev.get("class"), "action": ev.get("action")})
            self.n_recoveries += 1
            if self.prom is not None:
                self.prom.recovery(str(ev.get("class")), str(ev.get("action")))
            self._tb("recovery", self.n_recoveries, max(self.steps, default=0))
        elif kind in ("quarantined", "host_quarantined") and ev.get("host"):
            self.quarantined.add(str(ev["host"]))
            if self.prom is not None:
                self.prom.quarantined.set(len(self.quarantined))

    def advance(self, store: Store, progress: int) -> None:
        """Read the step records up to `progress` that are there (in order), record each."""
        if self.next is None:
            topo = read_topology(store, 0, self.token)
            self.next = topo.resume_step + 1 if topo is not None else 1
        while self.next <= progress:
            last = min(progress, self.next + STEP_BATCH - 1)
            names = [keys.step(s) for s in range(self.next, last + 1)]
            if store.check(names):
                raws = store.multi_get(names)
            elif store.check(names[:1]):  # (a later one missing: one at a time)
                raws = [store.get(names[0])]
            else:
                return
            for s, raw in zip(range(self.next, last + 1), raws, strict=False):
                rec = parse_json(sealed.unseal(keys.step(s), raw), keys.step(s))
                epoch = rec.get("epoch") if rec is not None else None
                if rec is not None and (epoch if isinstance(epoch, int) else 0) < self._min_epoch(s):
                    return  # (not written yet by the epoch that runs it now)
                if rec is not None:  # (one that is not a JSON object is logged by parse_json, and passed)
                    self._record(rec)
                self.next = s + 1
        if self.pending and self.steps and self.floor and self.steps[max(self.steps)][2] >= self.floor[-1][1]:
            self.pending = False  # the recovery's first step is in: its entry is complete
            self.recoveries = read_recoveries(store, self.cfg, self.token)
            self.ongoing = None
            if self.recoveries:
                self._tb("recovery", self.n_recoveries, max(self.steps), self.recoveries[-1])

    def _min_epoch(self, s: int) -> int:
        return max((e for r, e in self.floor if s > r), default=0)

    def _record(self, rec: dict[str, Any]) -> None:
        try:  # (a record without its times is written out, not accounted: anyone reaching the store can write one)
            self.steps[int(rec["step"])] = (float(rec["t_end"]), float(rec["dt"]), int(rec.get("epoch", 0)))
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
