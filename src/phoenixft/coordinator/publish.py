"""Publication of epochs, journal first.

Every topology the coordinator publishes is signed (`topo/<e>/sig`, written first) and goes out with
its journal record (the membership's spare pool and dead with it): on a store with leases in one transaction that
succeeds only while this process leads (`controlplane.guarded_set`), and, when a journal file is
given, after the record was fsynced there. A restarted coordinator, or a standby that takes over,
reloads the last record (`reload`) and finishes publishing whatever was decided, so that no epoch is
ever decided twice. A leader that finds it no longer leads exits at once (`deposed`).

The journal record, the epoch and the promoted spares' assignments are sealed with the run key
(`controlplane.sealed`): a record that does not verify is not reloaded, nor is one older than the newest
signed topology in the store (an earlier record of this run written back: a replay); the journal file,
where there is one, is used then, and without a record to trust the coordinator fails the run (one line)
rather than decide from a made-up or stale membership.
"""

from __future__ import annotations

import hmac
import json
import os
import sys
from typing import Any

from phoenixft.controlplane import Election, auth, guarded_set, keys, sealed
from phoenixft.controlplane.values import note_bad, parse_json
from phoenixft.coordinator.shared import Job, Membership, index
from phoenixft.dist.topology import Topology

__all__ = ["Publisher", "deposed", "JournalUntrusted"]


class JournalUntrusted(RuntimeError):
    """There is a journal, and no record of it can be trusted: the coordinator cannot go on from it."""


def _epoch_of(rec: dict[str, Any]) -> int | None:
    topo = rec.get("topo")
    e = topo.get("epoch") if isinstance(topo, dict) else None
    return e if isinstance(e, int) and not isinstance(e, bool) and e >= 0 else None


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
        values: list[str | bytes] = [auth.sign_topology(self.token, topo.epoch, raw), raw,
                                     sealed.seal(keys.EPOCH, str(topo.epoch))]
        for s in topo.meta.get("promoted", []):
            names.append(keys.assign(s))
            values.append(sealed.seal(keys.assign(s), str(topo.epoch)))
        if not replay:
            names.insert(0, keys.JOURNAL)
            values.insert(0, sealed.seal(keys.JOURNAL, record))
        if not guarded_set(self.store, self.election, names, values):
            deposed()
        self.state.topo = topo
        if not replay:
            self.job.event("epoch", epoch=topo.epoch, nodes=topo.nodes, world=topo.world,
                           resume_step=topo.resume_step)

    def _file_record(self) -> dict[str, Any] | None:
        """The last record of the journal file (None: no file, or no record in it)."""
        last = None
        if self.journal and os.path.exists(self.journal):
            with open(self.journal) as f:
                for line in f:
                    if line.strip():
                        try:
                            last = json.loads(line)
                        except ValueError:
                            break  # a torn last line: the decision before it stands
        return last if isinstance(last, dict) else None

    def _record(self) -> tuple[dict[str, Any] | None, str]:
        """The journal record to reload (the store's if it verifies and is not stale, else the file's), and
        why there is none to trust ('' if there is one, or no journal at all: a fresh start)."""
        there = self.store.check([keys.JOURNAL])
        rec = parse_json(sealed.get(self.store, keys.JOURNAL), keys.JOURNAL) if there else None
        file_rec = self._file_record()
        cands = [r for r in (rec, file_rec) if r is not None and _epoch_of(r) is not None]
        if not cands:
            if there or file_rec is not None:
                return None, "the journal in the store is not sealed with this run's key, or not a journal record"
            # (epoch 0 goes out with its journal record, in one write: a journal gone since was deleted)
            return None, "the journal is gone from the store" if self.store.check([keys.topo(0)]) else ""
        best = max(cands, key=lambda r: _epoch_of(r) or 0)
        e = _epoch_of(best) or 0
        nxt = self.store.get_nowait(keys.topo(e + 1))  # a newer epoch, signed, published: the record is stale
        sig = self.store.get_nowait(keys.topo_sig(e + 1))
        if nxt is not None and sig is not None and hmac.compare_digest(
                bytes(sig), auth.sign_topology(self.token, e + 1, nxt).encode()):
            note_bad(keys.JOURNAL, f"older than the published epoch {e + 1} (an earlier record written back)",
                     json.dumps(best))
            return None, f"the newest journal record (epoch {e}) is older than the published epoch {e + 1}"
        return best, ""

    def reload(self) -> bool:
        """Restore membership, epoch and spare pool from the journal; True if there was one. JournalUntrusted
        when there is a journal but none of its records can be trusted (see the module docstring)."""
        last, why = self._record()
        if last is None:
            if why:
                raise JournalUntrusted(why)
            return False
        try:
            dead, topo = set(last["dead"]), Topology(**last["topo"])
        except (KeyError, TypeError, ValueError):
            raise JournalUntrusted("the journal record does not describe an epoch") from None
        self.state.dead = dead
        # the journal's pool, and spares admitted since (admissions are in the store, signed)
        pool = set(last["spare_pool"]) | {n for n, m in self.state.members.items() if m["spare"]}
        self.state.spare_pool = sorted((s for s in pool if s not in self.state.dead and s not in topo.nodes),
                                       key=index)
        self.publish(topo, replay=True)
        return True
