"""Where a run's metrics are exported as it goes: TensorBoard event files (`--tensorboard DIR`) and a
Prometheus endpoint (`--metrics-port P`), each through its standard library, imported only when its
flag is given (`pip install 'phoenixft[metrics]'` installs both).

Both live in the launcher (behind `phoenixft run` and the head `phoenixft coordinator`): one process
that sees every step record and every event of the job, that survives a coordinator's restart, and
that writes nothing on the machines that train.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

from phoenixft.errors import UserError

__all__ = ["PrometheusSink", "TensorBoardSink", "require"]

EXTRA = "pip install 'phoenixft[metrics]'"


def require(module: str, flag: str) -> Any:
    """Import `module`, or a UserError naming the flag that needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"{flag} needs the {module.split('.')[0]!r} package ({e}); install it with: "
                        f"{EXTRA}") from None


class TensorBoardSink:
    """Scalars per step (`train/*`), the goodput and badput (`goodput/*`), the recoveries (`recoveries/*`),
    flushed at most every `flush_s` so that a TensorBoard open during training shows the live run."""

    def __init__(self, log_dir: str, flush_s: float = 1.0) -> None:
        require("tensorboard", "--tensorboard")
        tb = require("torch.utils.tensorboard", "--tensorboard")
        self.writer = tb.SummaryWriter(log_dir=log_dir, flush_secs=max(1, int(flush_s)))
        self.flush_s = flush_s
        self._flushed = time.monotonic()

    def step(self, rec: Mapping[str, Any]) -> None:
        s = int(rec["step"])
        for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                         ("train/step_time_s", "dt"), ("train/compute_s", "compute_s"), ("train/val_loss", "val_loss")):
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(tag, float(v), s, walltime=rec.get("t_end"))
        self._maybe_flush()

    def goodput(self, g: Mapping[str, Any], step: int) -> None:
        if g.get("goodput") is None:
            return
        self.writer.add_scalar("goodput/goodput", float(g["goodput"]), step)
        for cause, secs in (g.get("badput_s") or {}).items():
            self.writer.add_scalar(f"goodput/badput_{cause}_s", float(secs), step)
        self._maybe_flush()

    def recovery(self, total: int, step: int, rec: Mapping[str, Any] | None = None) -> None:
        self.writer.add_scalar("recoveries/total", float(total), step)
        if rec is not None and isinstance(rec.get("recovery_s"), (int, float)):
            self.writer.add_scalar("recoveries/recovery_s", float(rec["recovery_s"]), step)
            self.writer.add_scalar("recoveries/lost_steps", float(rec.get("lost_steps") or 0), step)
        self.writer.flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._flushed >= self.flush_s:
            self.writer.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class PrometheusSink:
    """The job's metrics on http://HOST:PORT/metrics, from a registry of its own (never the process-wide
    one). `port` 0: a free port, then in `self.port`."""

    def __init__(self, host: str, port: int) -> None:
        pc = require("prometheus_client", "--metrics-port")
        self.registry = reg = pc.CollectorRegistry(auto_describe=True)
        g, c = pc.Gauge, pc.Counter
        self.steps = g("phoenixft_steps_completed", "The last step the job completed.", registry=reg)
        self.epoch = g("phoenixft_epoch", "The job's current epoch (one per membership change).", registry=reg)
        self.world = g("phoenixft_world_size", "Ranks training in the current epoch.", registry=reg)
        self.loss = g("phoenixft_loss", "The loss of the last step.", registry=reg)
        self.step_s = g("phoenixft_step_seconds", "Wall time of the last step.", registry=reg)
        self.node_step = g("phoenixft_node_step_seconds", "The last step's wall time, per node.", ["node"],
                           registry=reg)
        self.node_compute = g("phoenixft_node_compute_seconds",
                              "The last step's compute time (forward, backward, optimizer), per node.", ["node"],
                              registry=reg)
        self.node_own = g("phoenixft_node_own_compute_seconds",
                          "Each node's own compute of the step before (its slowest rank, less its waits for others).",
                          ["node"], registry=reg)
        self.recoveries = c("phoenixft_recoveries", "Recoveries, by class and action.", ["class", "action"],
                            registry=reg)
        self.goodput = g("phoenixft_goodput", "Time inside steps that count over the wall time since the first step.",
                         registry=reg)
        self.productive = g("phoenixft_productive_seconds", "Time inside steps that count.", registry=reg)
        self.wall = g("phoenixft_wall_seconds", "Wall time since the job's launch.", registry=reg)
        self.badput = g("phoenixft_badput_seconds", "Wall time not in steps that count, by cause.", ["cause"],
                        registry=reg)
        self.quarantined = g("phoenixft_quarantined_hosts", "Hosts not admitted again for failing too often.",
                             registry=reg)
        try:
            self.server, self._thread = pc.start_http_server(port, addr=host, registry=reg)
        except OSError as e:
            raise UserError(f"--metrics-port={port} is invalid here: cannot serve on {host}:{port} ({e})") from None
        self.host, self.port = host, int(self.server.server_port)

    def step(self, rec: Mapping[str, Any], node: str | None) -> None:
        self.steps.set(int(rec["step"]))
        for gauge, key in ((self.loss, "loss"), (self.step_s, "dt"), (self.epoch, "epoch"), (self.world, "world")):
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                gauge.set(float(v))
        if node is not None:
            self.node_step.labels(node=node).set(float(rec["dt"]))
            if isinstance(rec.get("compute_s"), (int, float)):
                self.node_compute.labels(node=node).set(float(rec["compute_s"]))
        per_node = rec.get("nodes_compute_s")  # every node's own compute of the step before (coordinator/stragglers.py)
        for n, v in (per_node.items() if isinstance(per_node, Mapping) else ()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.node_own.labels(node=str(n)).set(float(v))

    def recovery(self, klass: str, action: str) -> None:
        self.recoveries.labels(**{"class": klass, "action": action}).inc()

    def set_goodput(self, g: Mapping[str, Any]) -> None:
        if g.get("goodput") is not None:
            self.goodput.set(float(g["goodput"]))
        self.productive.set(float(g.get("productive_s") or 0.0))
        self.wall.set(float(g.get("wall_s") or 0.0))
        for cause, secs in (g.get("badput_s") or {}).items():
            self.badput.labels(cause=cause).set(float(secs))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
