"""The scrub repair round (protect/scrub_round.py) between real processes on a gloo group, over generated rounds.

Every round is drawn from a seed all ranks share: which copies each rank holds and which of them are
corrupt, which corrupt halves each rank asks to repair, whom it asks and in what order, requests that
need every peer (a parity block's members), requests refused before asking, peers whose part fails.
Each rank then checks its own outcome against what the draw implies: a copy is repaired from the first
asked peer that holds a good one, bit for bit; a request needing every peer is served only when all of
them can; and the group's collectives stay matched round after round whatever each rank did.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import run_ranks

from phoenixft.distributed.comm import wait_work
from phoenixft.protect.scrub import Finding
from phoenixft.protect.scrub_round import HELD, OWN, Ask, Request, repair_round
from phoenixft.protect.snapshot import checksum

WORLD = 4
ROUNDS = 60
CHUNK = 16  # float32 per transfer round: copies of 20-60 floats cross several rounds
BROKEN = 7777  # a shard whose serving raises on the peer asked for it


def _data(shard: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(shard * 100_003 + step)
    return torch.randn(20 + 13 * (shard % 4), generator=g)


def _corrupt(t: torch.Tensor) -> torch.Tensor:
    bad = t.clone()
    bad.view(torch.int32)[len(t) // 2] ^= 1 << 9
    return bad


def _draw(g: int) -> dict[str, Any]:
    """Round g: each rank's copies (good or corrupt) and its requests, the same on every rank."""
    rng = random.Random(f"scrub-round-{g}")
    own_good = {p: rng.random() < 0.7 for p in range(WORLD)}
    held = {(p, x): rng.random() < 0.6 for p in range(WORLD) for x in range(WORLD) if p != x and rng.random() < 0.7}
    reqs: dict[int, list[dict[str, Any]]] = {r: [] for r in range(WORLD)}
    for r in range(WORLD):
        for _ in range(0 if g % 10 == 0 else rng.randrange(4)):  # every tenth round: nothing anywhere
            kind = rng.choices(["copy", "every", "refused", "empty"], [6, 2, 1, 1])[0]
            x = rng.randrange(WORLD)
            peers = rng.sample(range(WORLD), rng.randrange(1, WORLD + 1))
            if kind == "copy":
                peers = [p for p in peers if p != r] or [(r + 1) % WORLD]
                asks = [(p, OWN if p == x else HELD, x) for p in peers]
                if rng.random() < 0.15:
                    asks.insert(rng.randrange(len(asks) + 1), (rng.choice(peers), HELD, BROKEN))
            else:  # every member's own half (a parity block's re-encode), this rank included or not
                asks = [(p, OWN, p) for p in peers]
            reqs[r].append({"kind": kind, "asks": [] if kind == "empty" else asks})
    return {"step": g, "own_good": own_good, "held": held, "reqs": reqs}


def _holds_good(d: dict[str, Any], p: int, what: int, x: int) -> bool:
    if x == BROKEN:
        return False
    return bool(d["own_good"][p]) if what == OWN else bool(d["held"].get((p, x), False))


def _round(pg: Any, rank: int, g: int) -> list[str]:
    """Run round g on this rank; the list of its outcomes that differ from the draw's (empty: all as drawn)."""
    d = _draw(g)
    step = d["step"]

    def serve(a: Ask) -> torch.Tensor | None:
        if a.ident == BROKEN:
            raise RuntimeError("this peer's part fails")
        if a.what == OWN and a.ident == rank:
            t = _data(rank, a.step) if d["own_good"][rank] else _corrupt(_data(rank, a.step))
        elif a.what == HELD and (rank, a.ident) in d["held"]:
            t = _data(a.ident, a.step) if d["held"][(rank, a.ident)] else _corrupt(_data(a.ident, a.step))
        else:
            return None
        return t if checksum(t) == a.crc else None

    installed: dict[int, Any] = {}
    requests: list[Request] = []
    for k, q in enumerate(d["reqs"][rank]):
        f = Finding(kind=q["kind"], ident=k, half=0, step=step, crc=0)
        asks = [(p, Ask(w, x, step, checksum(_data(x, step)) if x != BROKEN else 1, len(_data(x, step))
                        if x != BROKEN else 5)) for p, w, x in q["asks"]]

        def install(got: dict[int, torch.Tensor], k: int = k) -> str:
            installed[k] = {p: t.clone() for p, t in got.items()}
            return "from " + ",".join(str(p) for p in sorted(got))

        requests.append(Request(f, asks=asks, every=q["kind"] == "every", install=install,
                                refused="refused before asking" if q["kind"] == "refused" else "",
                                nobody="nobody to ask" if q["kind"] == "empty" else ""))

    def wait(works: list[Any], what: str) -> None:
        for w in works:
            wait_work(w, what, lambda: None, 60.0, 0.001)

    repair_round(pg, WORLD, wait, requests, serve, CHUNK, lambda p: f"w{p}")
    bad: list[str] = []
    for k, (q, r) in enumerate(zip(d["reqs"][rank], requests, strict=True)):
        f = r.finding
        good = [p for p, w, x in q["asks"] if _holds_good(d, p, w, x)]
        if q["kind"] == "refused":
            want = (None, "refused before asking")
        elif q["kind"] == "empty":
            want = (None, "nobody to ask")
        elif q["kind"] == "every":
            whole = len(good) == len(q["asks"])
            want = ("from " + ",".join(str(p) for p in sorted({p for p, _, _ in q["asks"]})), "") if whole else \
                (None, "no peer holds a good copy (asked " + ", ".join(f"w{p}" for p, _, _ in q["asks"]) + ")")
        else:
            want = (f"from {good[0]}", "") if good else \
                (None, "no peer holds a good copy (asked " + ", ".join(f"w{p}" for p, _, _ in q["asks"]) + ")")
        if (f.repaired_from, f.why_not) != want:
            bad.append(f"round {g} rank {rank} request {k} ({q}): got {(f.repaired_from, f.why_not)}, want {want}")
        for p, t in installed.get(k, {}).items():  # the bytes: the asked peer's own data or its shard's
            x = next(x for pp, w, x in q["asks"] if pp == p and _holds_good(d, pp, w, x))
            if not torch.equal(t.view(torch.int32), _data(x, step).view(torch.int32)):
                bad.append(f"round {g} rank {rank} request {k}: the bytes from {p} differ from shard {x}'s")
    return bad


def _worker(rank: int, world: int, port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        q.put((rank, [b for g in range(ROUNDS) for b in _round(pg, rank, g)]))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, [repr(e)]))


def test_generated_rounds_repair_from_the_first_good_peer_and_keep_the_group_in_step() -> None:
    draws = [_draw(g) for g in range(ROUNDS)]
    kinds = [q["kind"] for d in draws for v in d["reqs"].values() for q in v]
    assert {"copy", "every", "refused", "empty"} <= set(kinds) and len(kinds) > 150  # the draw covers every case
    res = run_ranks(_worker, WORLD)
    assert res == {r: [] for r in range(WORLD)}, res


def test_an_ask_is_five_integers() -> None:
    a = Ask(HELD, 3, 41, -(1 << 62), 123)
    assert Ask.decode(a.encode()) == a
    with pytest.raises(ValueError, match="5 integers, got 4"):
        Ask.decode([1, 2, 3, 4])
