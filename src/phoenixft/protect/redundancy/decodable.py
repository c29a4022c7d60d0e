"""Which lost shards a group can rebuild, and from which pieces: pure logic for the planner.

Input: every verified copy of every shard (shard -> step -> {holder: checksum}, as the planner
gathers them from the descriptors) and every verified parity block (holder -> parity name -> step
-> entry: j, h, gid, the group's members and the checksum each member committed for that step).
A group can rebuild its missing members at step s when it has d pieces *of that step*: members'
copies whose checksum is the one the parity recorded for them, plus parity blocks of step s whose
recorded member checksums are the same (so every piece comes from one and the same state). Pieces
that already failed verification in transit (`bad`: (name, step, holder)) are never offered.

`decode_options` returns, for every shard that has no copy at some step but can be rebuilt there,
the `DecodeJob` that rebuilds it (and every other missing member of its group at that step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DecodeJob", "Piece", "decode_options", "parity_entries"]

Copies = Mapping[str, Mapping[int, Mapping[str, int]]]


@dataclass(frozen=True)
class Piece:
    index: int  # block index: 0..d-1 a member's data, d+j parity block j
    name: str  # the shard's name, or the parity block's
    holder: str  # the worker id that holds it
    crc: int


@dataclass(kw_only=True)
class DecodeJob:
    step: int
    gid: int
    h: int
    members: list[str]  # shard names, block order
    mcrc: list[int]  # each member's checksum at `step`
    pieces: list[Piece]  # exactly d: every available member first, then parity blocks
    lost: list[int] = field(default_factory=list)  # block indices of the members it rebuilds

    @property
    def d(self) -> int:
        return len(self.members)

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.step, tuple(self.members), tuple(self.mcrc))


def parity_entries(descs: Mapping[str, Any]) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """holder wid -> its descriptor's `parity` (parity name -> step -> entry)."""
    return {w: d.parity for w, d in descs.items() if getattr(d, "parity", None)}


def decode_options(copies: Copies, parity: Mapping[str, Mapping[str, Mapping[int, Mapping[str, Any]]]],
                   bad: set[tuple[str, int, str]] | frozenset[tuple[str, int, str]] = frozenset()
                   ) -> dict[str, dict[int, DecodeJob]]:
    """shard -> step -> the job that rebuilds it there (only shards without a copy at that step)."""
    # parity pieces, grouped by what they encode: (step, members, member checksums, h, gid)
    pieces: dict[tuple[Any, ...], dict[int, list[tuple[str, str, int]]]] = {}
    for w in sorted(parity):
        for name, steps in parity[w].items():
            for st, e in steps.items():
                if (name, st, w) in bad:
                    continue
                key = (st, tuple(e["members"]), tuple(int(x) for x in e["mcrc"]), int(e["h"]), int(e["gid"]))
                pieces.setdefault(key, {}).setdefault(int(e["j"]), []).append((w, name, int(e["crc"])))
    out: dict[str, dict[int, DecodeJob]] = {}
    for (st, members, mcrc, h, gid), by_j in sorted(pieces.items()):
        d = len(members)
        data: list[Piece] = []
        missing: list[int] = []
        for i, m in enumerate(members):
            holders = sorted(w for w, c in copies.get(m, {}).get(st, {}).items() if c == mcrc[i])
            if holders:
                data.append(Piece(index=i, name=m, holder=holders[0], crc=mcrc[i]))
            else:
                missing.append(i)
        if not missing or len(data) + len(by_j) < d:
            continue
        par = [Piece(index=d + j, name=by_j[j][0][1], holder=by_j[j][0][0], crc=by_j[j][0][2])
               for j in sorted(by_j)[: len(missing)]]
        job = DecodeJob(step=st, gid=gid, h=h, members=list(members), mcrc=list(mcrc), pieces=data + par,
                        lost=missing)
        for i in missing:
            out.setdefault(members[i], {}).setdefault(st, job)
    return out
