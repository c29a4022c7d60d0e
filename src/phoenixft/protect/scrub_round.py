"""The scrub repair round: corrupt held halves repaired from good copies held by peers, over the replication group.

Every rank of the epoch's replication group runs the round at the start of each protection job, right
after its scrub share (scrub.py); what to ask for and how to install it is scrub_repair.py's. A peer
may run on this host or another: everything moves over the group.

1. an all-reduce says whether any rank has a copy to repair, and the size of the largest one asked
   for; when none has, that is all the round costs: one collective of one integer, off the training path;
2. otherwise each rank sends its asks (`Ask`) to the peers it asks, point to point;
3. each asked peer answers whether it holds a good copy of what it was asked for (verified against the
   checksum asked for); the asking rank picks the first peer that can serve a copy, or every peer when
   it needs them all (the members of a parity block), and tells each asked peer whether to send;
4. the chosen peers send the bytes, in chunks; the asking rank hands them to its request's `install`,
   which verifies them and commits the half again.

Every rank makes the same sequence of collective calls whatever it found, asked or was asked, so the
round never desynchronises the group; a rank whose part fails locally answers "cannot serve". Its
waits give up when a recovery starts (`wait` raises): the half then stays as it is, and a recovery
refuses it by its checksum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phoenixft.distributed.comm import alltoallv
from phoenixft.protect.scrub import Finding

__all__ = ["OWN", "HELD", "Ask", "Request", "repair_round"]

OWN, HELD = 1, 2  # an ask for the peer's own committed half of a step | for the copy it holds of shard `ident`
_FIELDS = 5  # what, ident, step, crc, numel

Wait = Callable[[list[Any], str], None]  # wait for these works (one deadline), giving up when a recovery starts


@dataclass(frozen=True)
class Ask:
    """What a rank asks one peer to send: `numel` float32 whose checksum is `crc`, the peer's own committed
    half of `step` (OWN, `ident` its shard) or its held copy of shard `ident` at `step` (HELD)."""

    what: int
    ident: int
    step: int
    crc: int
    numel: int

    def encode(self) -> list[int]:
        return [self.what, self.ident, self.step, self.crc, self.numel]

    @classmethod
    def decode(cls, row: list[int]) -> Ask:
        if len(row) != _FIELDS:
            raise ValueError(f"an ask is {_FIELDS} integers, got {len(row)}")
        return cls(*row)


@dataclass
class Request:
    """One corrupt half to repair: whom to ask (`asks`: peer rank, what), whether every peer must serve
    (`every`: the members of a parity block) or the first that can is enough (a copy), and `install(got)`:
    verifies and commits what the chosen peers sent (peer rank -> bytes) and returns where the bytes came
    from, or raises `LookupError` saying why they could not be installed. `refused`: why it cannot even be
    asked (nothing is asked); `nobody`: the reason given when no peer (or not every peer) can serve."""

    finding: Finding
    asks: list[tuple[int, Ask]] = field(default_factory=list)
    every: bool = False
    install: Callable[[dict[int, torch.Tensor]], str] = lambda got: ""
    refused: str = ""
    nobody: str = ""


def _exchange(pg: Any, world: int, wait: Wait, what: str, sends: dict[int, list[int]],
              recv: dict[int, int]) -> dict[int, list[int]]:
    """One all-to-all of int64 lists (every rank of the group calls it); the lists received, by peer."""
    t = {p: torch.tensor(v, dtype=torch.int64) for p, v in sends.items() if v}
    w, _, got = alltoallv(pg, world, t, {p: n for p, n in recv.items() if n}, dtype=torch.int64)
    wait([w], f"scrub repair round: {what}")
    return {p: [int(x) for x in v.tolist()] for p, v in got.items()}


def _largest(pg: Any, wait: Wait, mine: int) -> int:
    top = torch.tensor([mine], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # (torch's stubs: RedOpType)
    wait([pg.allreduce([top], opts)], "scrub repair round")
    return int(top[0])


def repair_round(pg: Any, world: int, wait: Wait, requests: list[Request],
                 serve: Callable[[Ask], torch.Tensor | None], chunk: int, name: Callable[[int], str]) -> None:
    """This rank's part of the round; settles every request's finding (`repaired_from`, or `why_not`).
    `serve(ask)`: the bytes of a good copy this rank holds (verified against `ask.crc`), or None;
    `name(rank)`: a peer's name for the messages; `chunk`: float32 per transfer round."""
    live = [r for r in requests if not r.refused and r.asks]
    for r in requests:
        if r.refused or not r.asks:
            r.finding.why_not = r.refused or r.nobody or "no peer holds a copy of it"
    largest = _largest(pg, wait, max((a.numel for r in live for _, a in r.asks), default=0))
    if largest == 0:
        return
    out: dict[int, list[tuple[int, int]]] = {p: [] for p in range(world)}  # peer -> (request, ask) indices
    for k, r in enumerate(live):
        for i, (p, _) in enumerate(r.asks):
            out[p].append((k, i))
    counts = _exchange(pg, world, wait, "counts", {p: [len(v)] for p, v in out.items()}, dict.fromkeys(range(world), 1))
    n_in = {p: counts.get(p, [0])[0] for p in range(world)}
    rows = _exchange(pg, world, wait, "asks", {p: [x for k, i in v for x in live[k].asks[i][1].encode()]
                                              for p, v in out.items()}, {p: n * _FIELDS for p, n in n_in.items()})
    asked = {p: [Ask.decode(rows[p][j * _FIELDS:(j + 1) * _FIELDS]) for j in range(n)] for p, n in n_in.items()}
    served = {p: [_serve(serve, a) for a in v] for p, v in asked.items()}
    answers = _exchange(pg, world, wait, "answers", {p: [int(t is not None) for t in v] for p, v in served.items()},
                        {p: len(v) for p, v in out.items()})
    can = {(k, i): bool(ok) for p, v in out.items() for (k, i), ok in zip(v, answers.get(p, []), strict=True)}
    picked = {(k, i) for k, r in enumerate(live) for i in _pick(r, [can[(k, i)] for i in range(len(r.asks))])}
    go = _exchange(pg, world, wait, "choices", {p: [int(ki in picked) for ki in v] for p, v in out.items()}, n_in)
    sending = {p: [t for t, g in zip(served[p], go.get(p, []), strict=True) if g and t is not None]
               for p in range(world)}
    receiving = {p: [ki for ki in v if ki in picked] for p, v in out.items()}
    into = {ki: torch.empty(live[ki[0]].asks[ki[1]][1].numel) for v in receiving.values() for ki in v}
    _move(pg, world, wait, largest, max(1, chunk), sending, receiving, into)
    for k, r in enumerate(live):
        got = {r.asks[i][0]: into[(k, i)] for i in range(len(r.asks)) if (k, i) in into}
        _settle(r, got, name)


def _pick(r: Request, can: list[bool]) -> list[int]:
    """Which of `r`'s asks to take up: every one when `r` needs them all and all can serve, else the first
    that can serve (none when nobody can, or when `r` needs them all and one cannot)."""
    if r.every:
        return list(range(len(can))) if all(can) else []
    return [i for i, ok in enumerate(can) if ok][:1]


def _serve(serve: Callable[[Ask], torch.Tensor | None], a: Ask) -> torch.Tensor | None:
    """What this rank sends for `a`, or None (a part that fails here is a "cannot serve", never a desync)."""
    try:
        t = serve(a)
    except Exception:  # noqa: BLE001 - the round must go on on every rank
        return None
    return t.reshape(-1) if t is not None and t.numel() == a.numel else None


def _move(pg: Any, world: int, wait: Wait, largest: int, chunk: int, sending: dict[int, list[torch.Tensor]],
          receiving: dict[int, list[tuple[int, int]]], into: dict[tuple[int, int], torch.Tensor]) -> None:
    """The chosen copies, chunk by chunk: in each round every pair moves [lo, lo + chunk) of each of its
    copies, concatenated in ask order; every rank makes ceil(largest / chunk) rounds."""
    for lo in range(0, largest, chunk):
        hi = lo + chunk
        sends = {p: torch.cat([t[lo:hi] for t in v]) for p, v in sending.items() if any(t.numel() > lo for t in v)}
        recv = {p: sum(max(0, min(hi, into[ki].numel()) - lo) for ki in v) for p, v in receiving.items()}
        w, _, got = alltoallv(pg, world, sends, {p: n for p, n in recv.items() if n})
        wait([w], "scrub repair round: copies")
        for p, v in receiving.items():
            off = 0
            for ki in v:
                m = max(0, min(hi, into[ki].numel()) - lo)
                if m:
                    into[ki][lo:lo + m] = got[p][off:off + m]
                    off += m


def _settle(r: Request, got: dict[int, torch.Tensor], name: Callable[[int], str]) -> None:
    if not got:
        asked = ", ".join(name(p) for p, _ in r.asks)
        r.finding.why_not = r.nobody or f"no peer holds a good copy (asked {asked})"
        return
    try:
        r.finding.repaired_from = r.install(got)
    except LookupError as e:
        r.finding.why_not = str(e)
    except Exception as e:  # noqa: BLE001 - a repair that fails here is reported, never fatal
        r.finding.why_not = f"{type(e).__name__}: {e}"
