"""Spare health and repeat offenders.

- `check`: the built-in health check (a deterministic matrix product, a write/read pattern over
  snapshot memory, a loopback collective through the device seam) and `--health-check CMD`;
- `spare`: a spare's agent running it when it joins (while its workers start) and when the coordinator asks;
- `gate`: the coordinator's view: which spares may be promoted, on a fresh verdict; background re-checks;
- `window`: the quarantine rule (pure); `history`: each host's failures in the control-plane store, and
  `quarantine(store, host, reason)`, which any process of the job may call to keep a host out for good.

See docs/health.md.
"""

from __future__ import annotations

from phoenixft.health.history import HOST_ID_ENV, quarantine, quarantined_hosts, read_history, record_failure
from phoenixft.health.window import quarantined_at

__all__ = ["HOST_ID_ENV", "quarantine", "quarantined_hosts", "read_history", "record_failure", "quarantined_at"]
