"""The `--inject` faults a local job's launcher fires itself (`Point.PROGRESS`): the kill of a member of
the replicated control-plane cluster the run started (its `member` target), when the run's progress
reaches the step before S. Faults of the workers fire in the workers (`phoenixft.faults.inject`), those of a
node's agent in the agent (`phoenixft.faults.partition`, `phoenixft.faults.notice`)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from phoenixft.controlplane import Store, keys, sealed

if TYPE_CHECKING:
    from phoenixft.config import RunConfig
    from phoenixft.controlplane import ProvisionedCluster

__all__ = ["LauncherFaults"]


class LauncherFaults:
    """The launcher's own faults of one run, each fired once."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self._fired: set[int] = set()

    def fire_due(self, store: Store, cluster: ProvisionedCluster | None, progress: int) -> None:
        """Kills of a member of the control-plane cluster the run started (`FaultSpec.member`: its index,
        -1 for its leader) during step S, once `progress` (the last completed step) reached S - 1."""
        for f in self.cfg.faults:
            member = f.member
            if member is None or f.index in self._fired or f.step is None or progress < f.step - 1:
                continue
            self._fired.add(f.index)
            assert cluster is not None  # validated: needs a cluster the run starts itself
            i, name = cluster.member(member)
            rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": "kill",
                   "node": name, "step": f.step, "phase": "control plane", "by": "launcher"}
            sealed.put(store, keys.fault_fired(f.index), "1")
            sealed.put(store, keys.fault(f.index), json.dumps(rec))
            sealed.append(store, keys.EVENTS, rec)
            cluster.kill_member(i)
