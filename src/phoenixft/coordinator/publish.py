"""Publication of epochs, journal first.

Every topology the coordinator publishes is signed (`topo/<e>/sig`, written first) and goes out with
its journal record (the membership's spare pool and dead with it): on a store with leases in one transaction that
succeeds only while this process leads (`controlplane.guarded_set`), and, when a journal file is
given, after the record was fsynced there. A restarted coordinator, or a standby that takes over,
reloads the last record (`reload`) and finishes publishing whatever was decided, so that no epoch is
ever decided twice. A leader that finds it no longer leads exits at once (`deposed`).

The journal record, the epoch and the promoted spares' assignments are sealed with the run key
(`controlplane.sealed`): a record that does not verify is not reloaded, nor is one older than the newest
signed topology in the store (an earlier record of this run written back: a replay). The journal file,
where there is one, is used then; without it, the record is rebuilt from what is signed: the newest
topology, the nodes of earlier ones that left it and the fenced nodes as the dead (the spare pool
follows from the admissions, which are signed too). Never from a made-up or stale membership.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import sys
from typing import Any

from phoenixft.controlplane import Election, auth, guarded_set, keys, sealed
from phoenixft.controlplane.values import note_bad, parse_json
from phoenixft.coordinator.shared import Job, Membership, index
from phoenixft.distributed.topology import Topology
from phoenixft.recovery.evidence import rank_evidence

__all__ = ["Publisher", "deposed", "published"]


def _epoch_of(rec: dict[str, Any]) -> int | None:
    topo = rec.get("topo")
    e = topo.get("epoch") if isinstance(topo, dict) else None
    return e if isinstance(e, int) and not isinstance(e, bool) and e >= 0 else None


def published(topo: Topology) -> Topology:
    """`topo` as the store holds it: without the plan's evidence, which goes out under keys of its own
    (every worker reads the topology; each needs only its own part of the evidence), saying only that it
    did (`evidence_step`: signed with the topology, so that a part gone missing is noticed)."""
    ev = topo.meta.get("evidence")
    if not isinstance(ev, dict):
        return topo
    meta = {k: v for k, v in topo.meta.items() if k != "evidence"}
    return dataclasses.replace(topo, meta={**meta, "evidence_step": ev.get("step")})


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
        self._put_evidence(topo)
        raw = published(topo).to_json()
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
        self._keep(topo.epoch, names, values)
        self.state.topo = topo
        if not replay:
            self.job.event("epoch", epoch=topo.epoch, nodes=topo.nodes, world=topo.world,
                           resume_step=topo.resume_step)

    def _put_evidence(self, topo: Topology) -> None:
        """The plan's evidence for I2/I4 (recovery/evidence.py), before its topology: each rank's part under
        its own key and the whole table, sealed. (A replay writes them again from the journal's record.)"""
        ev = topo.meta.get("evidence")
        if not isinstance(ev, dict):
            return
        names = [keys.evidence(topo.epoch)] + [keys.evidence(topo.epoch, r) for r in range(topo.world)]
        values = [json.dumps(ev)] + [json.dumps(rank_evidence(ev, r, topo.layout.coord(r).name()))
                                     for r in range(topo.world)]
        sealed.put_many(self.store, names, values)
        for n, v in zip(names, values, strict=True):
            self.job.keeper.keep(n, sealed.seal(n, v))

    KEEP_EPOCHS = 2  # the topologies (and their evidence) of this many epochs are put back if overwritten

    def _keep(self, epoch: int, names: list[str], values: list[str | bytes]) -> None:
        """What an epoch's publication wrote is kept (put back if overwritten: a worker that starts or restarts
        reads it); that of epochs older than the last KEEP_EPOCHS no longer is."""
        for n, v in zip(names, values, strict=True):
            self.job.keeper.keep(n, v.encode() if isinstance(v, str) else bytes(v))
        old = epoch - self.KEEP_EPOCHS
        if old >= 0:
            self.job.keeper.drop(keys.topo(old), keys.topo_sig(old))
            self.job.keeper.drop_prefix(keys.evidence(old) + "/")
            self.job.keeper.drop(keys.evidence(old))

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

    def _signed_topo(self, e: int) -> Topology | None:
        """The topology of epoch `e` if it is in the store and its signature verifies with the token."""
        raw, sig = self.store.get_nowait(keys.topo(e)), self.store.get_nowait(keys.topo_sig(e))
        if raw is None or sig is None or not hmac.compare_digest(bytes(sig),
                                                                 auth.sign_topology(self.token, e, raw).encode()):
            return None
        try:
            return Topology.from_json(raw)
        except (KeyError, TypeError, ValueError):
            return None

    def _record(self) -> tuple[dict[str, Any] | None, str]:
        """The journal record to reload: the store's if it verifies, else the file's, whichever is newer, and
        not older than the newest signed topology; else one rebuilt from the signed topologies. And why the
        journal's own was not taken ('' if it was, or there is none: a fresh start)."""
        there = self.store.check([keys.JOURNAL])
        rec = parse_json(sealed.get(self.store, keys.JOURNAL), keys.JOURNAL) if there else None
        cands = [r for r in (rec, self._file_record()) if r is not None and _epoch_of(r) is not None]
        best = max(cands, key=lambda r: _epoch_of(r) or 0) if cands else None
        why = "the journal in the store is not sealed with this run's key" if there and rec is None else ""
        if best is not None and self._signed_topo((_epoch_of(best) or 0) + 1) is not None:
            why = f"the journal's newest record (epoch {_epoch_of(best)}) is older than the published epochs"
            note_bad(keys.JOURNAL, why + " (an earlier record written back)", json.dumps(best))
            best = None
        if best is not None:  # (the store's own put back if it did not verify: the file's record was taken)
            return best, why
        topos: list[Topology] = []  # rebuilt: the epochs published (signed), and who left them or was fenced
        while (t := self._signed_topo(len(topos))) is not None:
            topos.append(t)
        if not topos:
            return None, ""
        ever = {n for t in topos for n in t.nodes}
        fenced = {n for n in ever | set(self.state.members) if sealed.has(self.store, keys.fence(n))}
        dead = (ever - set(topos[-1].nodes)) | fenced
        return {"topo": json.loads(topos[-1].to_json()), "spare_pool": [], "dead": sorted(dead)}, \
            why or "the journal is gone from the store"

    def reload(self) -> bool:
        """Restore membership, epoch and spare pool from the journal; True if there was one (or the epochs
        published, when no record of the journal can be trusted: see the module docstring)."""
        last, why = self._record()
        if last is None:
            return False
        dead, topo = set(last["dead"]), Topology(**last["topo"])
        if why:  # (put back, sealed, so that a later restart finds it)
            self.job.event("journal_restored", epoch=topo.epoch, why=why)
            raw = sealed.seal(keys.JOURNAL, json.dumps(last))
            if not guarded_set(self.store, self.election, [keys.JOURNAL], [raw]):
                deposed()
            self.job.keeper.keep(keys.JOURNAL, raw)
        self.state.dead = dead
        # the journal's pool, and spares admitted since (admissions are in the store, signed)
        pool = set(last["spare_pool"]) | {n for n, m in self.state.members.items() if m["spare"]}
        self.state.spare_pool = sorted((s for s in pool if s not in self.state.dead and s not in topo.nodes),
                                       key=index)
        self.publish(topo, replay=True)
        return True
