"""Publication of epochs, journal first.

Every topology the coordinator publishes is signed (`topo/<e>/sig`, written first) and goes out with
its journal record (the membership's spare pool and dead with it): on a store with leases in one transaction that
succeeds only while this process leads (`controlplane.guarded_set`), and, when a journal file is
given, after the record was fsynced there. A restarted coordinator, or a standby that takes over,
reloads the last record (`reload`) and finishes publishing whatever was decided, so that no epoch is
ever decided twice. A leader that finds it no longer leads exits at once (`deposed`).
"""

from __future__ import annotations

import json
import os
import sys

from phoenixft.controlplane import Election, auth, guarded_set, keys
from phoenixft.controlplane.values import note_bad, read_json
from phoenixft.coordinator.shared import Job, Membership, index
from phoenixft.dist.topology import Topology

__all__ = ["Publisher", "deposed"]


def deposed() -> None:
    """This process no longer leads (its lease expired): another coordinator may act already."""
    print("phoenixft coordinator: lost the leadership (lease expired); exiting so the leader acts alone",
          file=sys.stderr, flush=True)
    os._exit(3)


class Publisher:
    """Publishes epochs into `job`'s store and `journal` (a file, or None), signed with `token`,
    guarded by `election` (this process acts only while it leads; None where the store has no leases)."""

    def __init__(self, job: Job, state: Membership, journal: str | None, token: str,
                 election: Election | None) -> None:
        self.job = job
        self.store = job.store
        self.state = state
        self.journal = journal
        self.token = token
        self.election = election

    def publish(self, topo: Topology, replay: bool = False) -> None:
        """Journal first, then publish: a restarted coordinator (or the standby that takes over)
        finishes publishing whatever was decided, and never decides the same epoch twice. The
        journal record is a store key written with the topology (under an election: in one transaction that
        succeeds only while this process leads); a local journal file, fsynced first, is kept too
        when given."""
        record = json.dumps({"topo": json.loads(topo.to_json()), "spare_pool": self.state.spare_pool,
                             "dead": sorted(self.state.dead)})
        if self.journal and not replay:
            with open(self.journal, "a") as f:
                f.write(record + "\n")
                f.flush()
                os.fsync(f.fileno())
        raw = topo.to_json()
        names = [keys.topo_sig(topo.epoch), keys.topo(topo.epoch), keys.EPOCH]  # the signature first
        values = [auth.sign_topology(self.token, topo.epoch, raw), raw, str(topo.epoch)]
        for s in topo.meta.get("promoted", []):
            names.append(keys.assign(s))
            values.append(str(topo.epoch))
        if not replay:
            names.insert(0, keys.JOURNAL)
            values.insert(0, record)
        if not guarded_set(self.store, self.election, names, values):
            deposed()
        self.state.topo = topo
        if not replay:
            self.job.event("epoch", epoch=topo.epoch, nodes=topo.nodes, world=topo.world,
                           resume_step=topo.resume_step)

    def reload(self) -> bool:
        """Restore membership, epoch and spare pool from the journal; True if there was one."""
        last = None
        if self.store.check([keys.JOURNAL]):
            last = read_json(self.store, keys.JOURNAL)
        elif self.journal and os.path.exists(self.journal):
            with open(self.journal) as f:
                for line in f:
                    if line.strip():
                        try:
                            last = json.loads(line)
                        except ValueError:
                            break  # a torn last line: the decision before it stands
        if last is None:
            return False
        try:
            dead, topo = set(last["dead"]), Topology(**last["topo"])
        except (KeyError, TypeError, ValueError):
            note_bad(keys.JOURNAL, "not a journal record", json.dumps(last))
            return False
        self.state.dead = dead
        # the journal's pool, and spares admitted since (admissions are in the store, signed)
        pool = set(last["spare_pool"]) | {n for n, m in self.state.members.items() if m["spare"]}
        self.state.spare_pool = sorted((s for s in pool if s not in self.state.dead and s not in topo.nodes),
                                       key=index)
        self.publish(topo, replay=True)
        return True
