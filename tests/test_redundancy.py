"""Erasure-coded protection, pure logic (milliseconds): the scheme flag, the codes, group placement,
decodability, the planner with parity groups, and the --dry-run estimator.

Property tests over thousands of generated cases, each against a brute-force oracle:
- codes: every pattern of up to h lost data blocks is rebuilt bit for bit (float bytes included:
  NaN payloads, -0.0, denormals), stripe by stripe equals whole blocks;
- placement: groups partition the ring, one member per node, sizes <= d and within one of each
  other; parity on h further distinct nodes, other racks first as far as the ring allows; any h
  lost nodes leave every group d pieces;
- decodability: an option is offered exactly when d consistent pieces of one step exist, and
  every piece it names is held, verified, of that step, and not a known bad source;
- the planner: never declares lost what a group can rebuild, picks the newest recoverable step,
  and every decode job it emits names pieces its sources hold at that step.
"""

from __future__ import annotations

import itertools
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from phoenixft.cli.main import main as cli_main
from phoenixft.config import RunConfig
from phoenixft.distributed.topology import Topology, shard_name
from phoenixft.errors import UserError
from phoenixft.protect.redundancy.codes import ReedSolomon, XorCode, make_code, stripe_bytes
from phoenixft.protect.redundancy.decodable import decode_options
from phoenixft.protect.redundancy.estimate import estimate
from phoenixft.protect.redundancy.parity import ParityHolding, parity_name
from phoenixft.protect.redundancy.placement import RingRank, place_groups
from phoenixft.protect.redundancy.plan import ec_groups, ec_plan
from phoenixft.protect.redundancy.scheme import Redundancy, parse_redundancy
from phoenixft.protect.snapshot import Holding, ShardState
from phoenixft.recovery.planner import Descriptor, PlanInput, plan_recovery

# ---------------------------------------------------------------------------------------------- scheme


@pytest.mark.parametrize("text,want", [("replicas:1", Redundancy("replicas", k=1)),
                                       ("ec:3+1", Redundancy("ec", d=3, h=1)), ("ec:4+2", Redundancy("ec", d=4, h=2)),
                                       (" ec:1+1 ", Redundancy("ec", d=1, h=1))])
def test_parse(text: str, want: Redundancy) -> None:
    assert parse_redundancy(text) == want


@pytest.mark.parametrize("text", ["ec:3+0", "ec:0+2", "replicas:0", "ec:3", "raid5", "ec:200+100", ""])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_redundancy(text)


def test_for_ring_degrades_to_what_fits() -> None:
    ec = Redundancy("ec", d=4, h=2)
    assert ec.for_ring(8) == ec and ec.for_ring(6) == ec
    assert ec.for_ring(5) == Redundancy("ec", d=3, h=2) and ec.for_ring(3) == Redundancy("ec", d=1, h=2)
    assert ec.for_ring(2) == Redundancy("ec", d=1, h=1) and ec.for_ring(1) is None
    assert Redundancy("replicas", k=3).for_ring(3) == Redundancy("replicas", k=2)


def test_bad_flag_is_one_line_naming_flag_value_and_what_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["run", "--dry-run", "--nodes", "4", "--redundancy", "ec:3+0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "--redundancy='ec:3+0'" in err and "H must be >= 1" in err and "ec:D+H" in err and "replicas:K" in err


@pytest.mark.parametrize("kw,flag", [(dict(redundancy="ec:3+1", nodes=3), "--redundancy"),
                                     (dict(redundancy="ec:2+1", replicas=2, nodes=4), "--replicas"),
                                     (dict(redundancy="replicas:2", replicas=3, nodes=4), "--redundancy")])
def test_config_conflicts(kw: dict[str, object], flag: str) -> None:
    with pytest.raises(UserError, match=flag):
        RunConfig(**kw).validate()  # type: ignore[arg-type]


def test_replicas_is_a_shorthand() -> None:
    assert RunConfig(replicas=2).redundancy == "replicas:2"
    assert RunConfig(redundancy="replicas:3").replicas == 3
    c = RunConfig(redundancy="ec:2+1", nodes=3)
    c.validate()
    assert c.scheme == Redundancy("ec", d=2, h=1) and c.replicas == 1


# ---------------------------------------------------------------------------------------------- codes


def _float_blocks(rng: np.random.Generator, d: int, nbytes: int) -> list[np.ndarray]:
    out = []
    for _ in range(d):
        x = rng.standard_normal(nbytes // 4).astype(np.float32)
        x[:: 7] = np.float32(-0.0)
        x[3::11] = np.float32(np.nan)
        x[5::13] = np.float32(1e-40)  # denormal
        x[1::17] = np.float32(np.inf)
        out.append(x.view(np.uint8))
    return out


def test_codes_rebuild_every_erasure_pattern_bit_for_bit() -> None:
    rng = np.random.default_rng(15)
    cases = 0
    for d, h in [(1, 1), (2, 1), (3, 1), (8, 1), (1, 2), (2, 2), (3, 2), (4, 2), (5, 3), (6, 4), (10, 4)]:
        code = make_code(d, h)
        assert isinstance(code, XorCode if h == 1 else ReedSolomon)
        for nbytes in (64, 640, 4096):
            blocks = _float_blocks(rng, d, nbytes)
            parity = code.encode(blocks)
            assert len(parity) == h and all(p.nbytes == nbytes for p in parity)
            allb = {i: b for i, b in enumerate(blocks)} | {d + j: p for j, p in enumerate(parity)}
            # every set of up to h lost blocks (data or parity), rebuilding the lost data
            for k in range(1, h + 1):
                for lost in itertools.combinations(range(d + h), k):
                    pieces = {i: b for i, b in allb.items() if i not in lost}
                    data_lost = [i for i in lost if i < d]
                    got = code.decode(pieces, data_lost)
                    for i in data_lost:
                        assert np.array_equal(got[i], blocks[i]), (d, h, lost)
                    cases += 1
    assert cases > 1000


def test_codes_are_position_wise_and_refuse_too_few_pieces() -> None:
    rng = np.random.default_rng(3)
    for d, h in [(3, 1), (4, 2), (5, 3)]:
        code = make_code(d, h)
        blocks = _float_blocks(rng, d, 1280)
        whole = code.encode(blocks)
        halves = [code.encode([b[:640] for b in blocks]), code.encode([b[640:] for b in blocks])]
        for j in range(h):
            assert np.array_equal(whole[j], np.concatenate([halves[0][j], halves[1][j]]))
        pieces = {i: blocks[i] for i in range(h + 1, d)} | {d + j: whole[j] for j in range(h)}
        with pytest.raises(ValueError):
            code.decode(pieces, list(range(h + 1)))  # h + 1 lost: not enough


def test_codes_refuse_what_they_cannot_do_saying_why() -> None:
    """Each refusal of a code names what is wrong: a parity count XOR cannot give, a group zfec cannot
    build, the wrong number of data blocks, lost blocks that are parity or given, too few pieces; and
    nothing lost is nothing rebuilt."""
    with pytest.raises(ValueError, match=r"^XOR protects against one loss only \(h = 1\)$"):
        XorCode(3, 2)
    assert (XorCode(3).d, XorCode(3).h) == (3, 1)
    one = ReedSolomon(3, 1)  # (make_code takes XOR for one parity block; Reed-Solomon gives it too)
    blocks1 = _float_blocks(np.random.default_rng(9), 3, 128)
    (p1,) = one.encode(blocks1)
    assert p1.dtype == np.uint8 and p1.shape == (128,)
    assert np.array_equal(one.decode({0: blocks1[0], 2: blocks1[2], 3: p1}, [1])[1], blocks1[1])
    for d, h in [(0, 1), (1, 0), (200, 57)]:
        with pytest.raises(ValueError, match=rf"ec:{d}\+{h}: need d >= 1, h >= 1, d \+ h <= 256"):
            ReedSolomon(d, h)
    assert (ReedSolomon(200, 56).d, ReedSolomon(200, 56).h) == (200, 56)
    rng = np.random.default_rng(8)
    for h in (1, 2):
        code = make_code(3, h)
        blocks = _float_blocks(rng, 3, 640)
        with pytest.raises(ValueError, match="need 3 data blocks, got 2"):
            code.encode(blocks[:2])
        allb = {i: b for i, b in enumerate(blocks)} | {3 + j: p for j, p in enumerate(code.encode(blocks))}
        assert code.decode(allb, []) == {}
        without = {i: b for i, b in allb.items() if i != 3}
        with pytest.raises(ValueError, match=r"lost blocks \[3\] must be data blocks \(0..2\) that are not given"):
            code.decode(without, [3])  # a parity block
        with pytest.raises(ValueError, match=r"lost blocks \[0\] must be data blocks"):
            code.decode(allb, [0])  # given
        few = {i: allb[i] for i in (1, 2)} | {3 + h: allb[1]}  # (index 3 + h is no piece of a 3 + h group)
        with pytest.raises(ValueError, match=rf"^2 pieces cannot rebuild a 3\+{h} group: need 3$"):
            code.decode(few, [0])
        assert all(p.dtype == np.uint8 and p.shape == (640,) for p in code.encode(blocks))
        exact = {i: allb[i] for i in (1, 2, 3)}  # exactly d pieces, one of them parity
        assert np.array_equal(code.decode(exact, [0])[0], blocks[0])


def test_stripe_bytes() -> None:
    for payload in (4, 100, 4096, 10**6 + 4):
        for d in (1, 2, 3, 7):
            s = stripe_bytes(payload, d)
            assert s % 64 == 0 and s * d >= payload and (s - 64) * d < payload or s == 64


# ---------------------------------------------------------------------------------------------- placement


def _random_ring(rng: random.Random) -> tuple[list[RingRank], int, int, int]:
    n = rng.randint(2, 24)
    racks = rng.choice([r for r in (1, 2, 3, 4, 6) if n % r == 0])
    h = rng.randint(1, min(4, n - 1))
    d = rng.randint(1, n - h)
    g = rng.choice([1, 1, 2, 4])
    lr = rng.randrange(g)
    ring = [RingRank(rank=s * g + lr, node=s, rack=s * racks // n) for s in range(n)]
    return ring, d, h, racks


def test_placement_properties_over_generated_rings() -> None:
    rng = random.Random(20261215)
    for _ in range(3000):
        ring, d, h, racks = _random_ring(rng)
        n = len(ring)
        groups = place_groups(ring, d, h)
        by_rank = {r.rank: r for r in ring}
        members = [m for grp in groups for m in grp.members]
        assert sorted(members) == sorted(r.rank for r in ring), "groups must partition the ring"
        sizes = [grp.d for grp in groups]
        assert max(sizes) <= d and max(sizes) - min(sizes) <= 1 and len(groups) == -(-n // d)
        load = {r.rank: 0 for r in ring}
        for grp in groups:
            assert grp.h == h
            nodes = [by_rank[x].node for x in grp.members + grp.parity]
            assert len(set(nodes)) == len(nodes), "members and parity holders on distinct nodes"
            # other racks first: parity lands in a member's rack only when no other rack has room
            member_racks = {by_rank[x].rack for x in grp.members}
            outside = [r for r in ring if r.rack not in member_racks]
            inside = sum(by_rank[x].rack in member_racks for x in grp.parity)
            assert inside == max(0, h - len(outside)), (grp, racks)
            for x in grp.parity:
                load[x] += 1
        if racks == 1:  # without rack constraints the parity blocks spread evenly
            assert max(load.values()) - min(load.values()) <= max(1, h), load
        # any h lost nodes leave every group at least d pieces
        for _k in range(5):
            lost = set(rng.sample(range(n), h))
            for grp in groups:
                alive = [x for x in grp.members + grp.parity if by_rank[x].node not in lost]
                assert len(alive) >= grp.d


def _reference_placement(ring: list[RingRank], d: int, h: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The placement rule written out directly (one Python key per position): the definition the fast
    `place_groups` must reproduce exactly (every rank computes it; a different answer is another layout)."""
    n = len(ring)
    g_count = -(-n // d)
    load = [0] * n
    out = []
    for g in range(g_count):
        pos = list(range(g, n, g_count))
        member_racks = {ring[p].rack for p in pos}
        chosen: list[int] = []
        for _j in range(h):
            parity_racks = {ring[p].rack for p in chosen}
            cands = [p for p in range(n) if p not in set(pos) | set(chosen)]
            best = min(cands, key=lambda p: (ring[p].rack in member_racks, ring[p].rack in parity_racks, load[p],
                                             (p - pos[0]) % n))
            chosen.append(best)
            load[best] += 1
        out.append((tuple(ring[p].rank for p in pos), tuple(ring[p].rank for p in chosen)))
    return out


def test_placement_equals_its_definition_over_generated_rings() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        ring, d, h, _racks = _random_ring(rng)
        if rng.random() < 0.3:  # uneven, unordered racks too
            ring = [RingRank(rank=r.rank, node=r.node, rack=rng.randrange(5)) for r in ring]
        got = [(grp.members, grp.parity) for grp in place_groups(ring, d, h)]
        assert got == _reference_placement(ring, d, h), (ring, d, h)


def test_placement_rejects_what_cannot_be_placed() -> None:
    ring = [RingRank(rank=i, node=i) for i in range(4)]
    with pytest.raises(ValueError, match=r"^ec:3\+2 needs 5 nodes in the ring, it has 4$"):
        place_groups(ring, 3, 2)
    distinct = r"^a ring has one rank per node: ranks and nodes must be distinct$"
    with pytest.raises(ValueError, match=distinct):
        place_groups([RingRank(rank=0, node=0), RingRank(rank=1, node=0), RingRank(rank=2, node=1)], 1, 1)
    with pytest.raises(ValueError, match=distinct):
        place_groups([RingRank(rank=0, node=0), RingRank(rank=0, node=1), RingRank(rank=2, node=2)], 1, 1)
    for d, h in [(0, 1), (1, 0), (2, -1)]:
        with pytest.raises(ValueError, match=rf"^ec:{d}\+{h}: need d >= 1 and h >= 1$"):
            place_groups(ring, d, h)


def test_ec_plan_one_ring_per_local_rank() -> None:
    topo = Topology(epoch=0, nodes=[f"n{i}" for i in range(6)], workers_per_node=2, replicas=1, resume_step=0, racks=2)
    groups = ec_groups(topo, Redundancy("ec", d=2, h=1))
    for grp in groups:  # a group and its parity stay on one local rank, on distinct nodes
        ranks = grp.members + grp.parity
        assert len({r % 2 for r in ranks}) == 1 and len({r // 2 for r in ranks}) == len(ranks)
    plans = [ec_plan(topo, r, Redundancy("ec", d=2, h=1)) for r in range(topo.world)]
    held = sorted((hb.gid, hb.j) for p in plans if p for hb in p.held)
    assert held == sorted((gid, j) for gid, g in enumerate(groups) for j in range(g.h))


# ---------------------------------------------------------------------------------------------- decodability


def crc_of(name: str, step: int) -> int:
    return zlib.crc32(f"{name}@{step}".encode()) or 1


def _ec_case(rng: random.Random) -> tuple[Topology, list, dict, dict, set]:  # type: ignore[type-arg]
    n = rng.randint(2, 9)
    h = rng.randint(1, min(3, n - 1))
    d = rng.randint(1, n - h)
    topo = Topology(epoch=rng.randint(0, 3), nodes=[f"n{i}" for i in range(n)], workers_per_node=1, replicas=1,
                    resume_step=0)
    groups = ec_groups(topo, Redundancy("ec", d=d, h=h))
    dead = {x for x in topo.nodes if rng.random() < 0.35}
    s = rng.randint(3, 20)
    copies: dict[str, dict[int, dict[str, int]]] = {}
    parity: dict[str, dict[str, dict[int, dict[str, object]]]] = {}
    bad: set[tuple[str, int, str]] = set()
    for gid, grp in enumerate(groups):
        names = [shard_name(m, topo.world) for m in grp.members]
        for st in (s, s - 1):
            mcrc = [crc_of(x, st) for x in names]
            for i, m in enumerate(grp.members):
                w = f"{topo.nodes[m]}.0"
                if topo.nodes[m] not in dead and rng.random() < 0.8:
                    crc = mcrc[i] if rng.random() > 0.03 else mcrc[i] + 1  # rarely: a copy of other content
                    copies.setdefault(names[i], {}).setdefault(st, {})[w] = crc
            for j, holder in enumerate(grp.parity):
                w = f"{topo.nodes[holder]}.0"
                if topo.nodes[holder] in dead or rng.random() < 0.15:
                    continue
                name = parity_name(names, j)
                parity.setdefault(w, {}).setdefault(name, {})[st] = {"crc": crc_of(name, st), "j": j, "h": grp.h,
                                                                     "gid": gid, "members": names, "mcrc": mcrc}
                if rng.random() < 0.08:
                    bad.add((name, st, w))
    return topo, groups, copies, parity, bad


def test_decode_options_against_brute_force() -> None:
    rng = random.Random(151)
    offered = 0
    for _ in range(3000):
        topo, groups, copies, parity, bad = _ec_case(rng)
        opts = decode_options(copies, parity, bad)
        for gid, grp in enumerate(groups):
            names = [shard_name(m, topo.world) for m in grp.members]
            for st in {st for w in parity.values() for x in w.values() for st in x} | {0}:
                mcrc = [crc_of(x, st) for x in names]
                have = [i for i, x in enumerate(names)
                        if any(c == mcrc[i] for c in copies.get(x, {}).get(st, {}).values())]
                js = {e["j"] for w, ps in parity.items() for pn, x in ps.items() for s2, e in x.items()
                      if s2 == st and e["gid"] == gid and (pn, st, w) not in bad}
                missing = [i for i in range(grp.d) if i not in have]
                can = bool(missing) and len(have) + len(js) >= grp.d
                for i in range(grp.d):
                    got = opts.get(names[i], {}).get(st)
                    assert (got is not None) == (can and i in missing), (names[i], st, have, js)
                    if got is None:
                        continue
                    offered += 1
                    assert len(got.pieces) == grp.d and len({p.index for p in got.pieces}) == grp.d
                    assert sorted(got.lost) == missing and got.step == st and got.mcrc == mcrc
                    for p in got.pieces:
                        if p.index < grp.d:
                            assert copies[names[p.index]][st][p.holder] == mcrc[p.index]
                        else:
                            e = parity[p.holder][p.name][st]
                            assert e["j"] == p.index - grp.d and e["crc"] == p.crc and (p.name, st, p.holder) not in bad
    assert offered > 500


# ---------------------------------------------------------------------------------------------- the planner


def _planner_case(rng: random.Random) -> PlanInput:
    n = rng.randint(3, 9)
    h = rng.randint(1, min(3, n - 2))
    d = rng.randint(1, n - h)
    nodes = [f"n{i}" for i in range(n)]
    old = Topology(epoch=rng.randint(0, 4), nodes=nodes, workers_per_node=1, replicas=1, resume_step=0)
    groups = ec_groups(old, Redundancy("ec", d=d, h=h))
    dead = {x for x in nodes if rng.random() < 0.3} or {rng.choice(nodes)}
    s = rng.randint(3, 20)
    descs: dict[str, Descriptor] = {}
    for r, node in enumerate(nodes):
        if node not in dead:
            w = f"{node}.0"
            newest = s - (1 if rng.random() < 0.15 else 0)
            descs[w] = Descriptor(wid=w, params=sorted({newest, newest - 1} if rng.random() < 0.7 else {newest}))
            if rng.random() > 0.1:  # a spare promoted earlier may hold nothing yet
                name = shard_name(r, old.world)
                descs[w].own[name] = {st: crc_of(name, st) for st in (newest, newest - 1) if rng.random() < 0.85}
    for gid, grp in enumerate(groups):
        names = [shard_name(m, old.world) for m in grp.members]
        for st in (s, s - 1, s - 2):
            for j, holder in enumerate(grp.parity):
                w = f"{nodes[holder]}.0"
                if w in descs and rng.random() < 0.8:
                    pn = parity_name(names, j)
                    descs[w].parity.setdefault(pn, {})[st] = {"crc": crc_of(pn, st), "j": j, "h": grp.h, "gid": gid,
                                                              "members": names,
                                                              "mcrc": [crc_of(x, st) for x in names]}
    if descs and rng.random() < 0.2:  # a parity block already delivered bad data once
        victim, w = rng.choice(sorted(descs)), rng.choice(sorted(descs))
        for pn, steps in descs[w].parity.items():
            for st in steps:
                descs[victim].bad_sources.append((pn, st, w))
    pool = [f"s{i}" for i in range(rng.randint(0, 3))]
    return PlanInput(old=old, dead=dead, restarted=set(), descs=descs, pool=pool, target_nodes=n, replicas=1,
                     racks=1)


def test_planner_with_parity_groups_against_generated_schedules() -> None:
    rng = random.Random(1515)
    seen: dict[str, int] = {}
    for _ in range(3000):
        pi = _planner_case(rng)
        plan = plan_recovery(pi)
        # oracle: per step, every shard has a verified copy or its group has d pieces of that step
        bad = {x for dd in pi.descs.values() for x in dd.bad_sources}
        copies: dict[str, dict[int, dict[str, int]]] = {}
        for w, dd in pi.descs.items():
            for name, steps in dd.own.items():
                for st, crc in steps.items():
                    copies.setdefault(name, {}).setdefault(st, {})[w] = crc
        opts = decode_options(copies, {w: dd.parity for w, dd in pi.descs.items()}, bad)
        shards = [shard_name(i, pi.old.world) for i in range(pi.old.world)]
        params = {st for dd in pi.descs.values() for st in dd.params}
        ok = {st for st in params if all(st in copies.get(x, {}) or st in opts.get(x, {}) for x in shards)}
        if not pi.descs and not pi.pool:
            continue
        if not ok:
            assert not plan.ok, "a plan without a recoverable step"
            # lost: the shards with neither a copy nor a group that can rebuild them, at any step
            assert plan.lost == [x for x in shards if not copies.get(x) and not opts.get(x)], (plan.lost, plan.error)
            seen["lost"] = seen.get("lost", 0) + 1
            continue
        assert plan.ok, plan.error
        assert plan.resume_step == max(ok)
        topo = plan.topo
        assert topo is not None
        r = plan.resume_step
        jobs = topo.meta.get("decode", [])
        for job in jobs:  # every piece is held by the member the plan names, at r, with that checksum
            assert job["step"] == r and len(job["pieces"]) == len(job["shards"])
            for p in job["pieces"]:
                w = f"{topo.node_of_rank(p['src'])}.0"
                assert w == p["wid"] and (p["name"], r, w) not in bad
                dd = pi.descs[w]
                if p["index"] < len(job["shards"]):
                    assert dd.own[p["name"]][r] == p["crc"]
                else:
                    assert dd.parity[p["name"]][r]["crc"] == p["crc"]
        if "reshard" in topo.meta:
            seen["reshard"] = seen.get("reshard", 0) + 1
            providers = topo.meta["reshard"]["providers"]
            assert sorted(providers, key=int) == [str(i) for i in range(pi.old.world)], providers
            for i, (prov, kind, crc) in providers.items():
                name = shard_name(int(i), pi.old.world)
                if kind == "decode":
                    job = next(j for j in jobs if int(i) in j["shards"])
                    pos = job["shards"].index(int(i))
                    assert job["to"][str(pos)] == prov and job["mcrc"][pos] == crc and r not in copies.get(name, {})
                    # rebuilt by the holder of the job's first piece: the pieces then travel to it
                    assert f"{topo.node_of_rank(prov)}.0" == job["pieces"][0]["wid"], (prov, job)
                else:
                    assert copies[name][r][f"{topo.node_of_rank(prov)}.0"] == crc
            continue
        seen["decode" if jobs else "in-memory"] = seen.get("decode" if jobs else "in-memory", 0) + 1
        for t in topo.transfers:
            name = shard_name(t["shard"], topo.world)
            w = f"{topo.node_of_rank(t['dst'])}.0"
            assert t["opt_src"] != t["dst"], f"{w} is its own source"
            if t["opt_src"] < 0 and "decode" not in t:  # it keeps its own shard, or installs the copy it holds itself
                held = copies.get(name, {}).get(r, {})
                assert held.get(w) == t["crc"] and (bool(t.get("local")) == (r not in pi.descs[w].own.get(name, {})))
            elif t["opt_src"] < 0:
                job = jobs[t["decode"]]
                pos = job["shards"].index(t["shard"])
                assert job["to"][str(pos)] == t["dst"] and t["crc"] == job["mcrc"][pos]
                assert r not in copies.get(name, {}), "decoded although a copy exists"
            else:
                assert copies[name][r][f"{topo.node_of_rank(t['opt_src'])}.0"] == t["crc"]
    for outcome in ("decode", "reshard", "lost"):  # every case loses a node: without replicas, a decode
        assert seen.get(outcome, 0) >= 300, seen


def test_planner_decodes_in_the_layout_of_an_incomplete_repartition() -> None:
    """A grow (3 -> 4 nodes) whose repartition a node loss interrupted: the state is still in the 3-node
    layout, and the lost node's shard of it is rebuilt from its group. The decode job must name the
    shards (and their world) of that layout; it looked them up in the 4-node one, and the coordinator
    crashed on a KeyError on every restart (the run lost: "the coordinator keeps exiting")."""
    prev = Topology(epoch=1, nodes=["n0", "n2", "n3"], workers_per_node=1, replicas=1, resume_step=3)
    old = Topology(epoch=2, nodes=["n0", "n2", "n3", "s0"], workers_per_node=1, replicas=1, resume_step=7,
                   meta={"reshard": {"old_world": 3, "providers": {}, "params_to": {}}, "generation": 2})
    r, dead = 7, {"n3"}
    descs = {w: Descriptor(wid=w, params=[r]) for w in ("n0.0", "n2.0", "s0.0")}
    for slot, node in enumerate(prev.nodes):  # the shards of the 3-node layout, on their owners
        if node not in dead:
            name = shard_name(slot, 3)
            descs[f"{node}.0"].own[name] = {r: crc_of(name, r)}
    for gid, grp in enumerate(ec_groups(prev, Redundancy("ec", d=2, h=1))):
        names = [shard_name(m, 3) for m in grp.members]
        for j, holder in enumerate(grp.parity):
            if prev.nodes[holder] not in dead:
                pn = parity_name(names, j)
                descs[f"{prev.nodes[holder]}.0"].parity[pn] = {r: {
                    "crc": crc_of(pn, r), "j": j, "h": grp.h, "gid": gid, "members": names,
                    "mcrc": [crc_of(x, r) for x in names]}}
    plan = plan_recovery(PlanInput(old=old, dead=dead, restarted=set(), descs=descs, pool=[], target_nodes=4,
                                   replicas=1, racks=1))
    assert plan.ok, plan.error
    topo = plan.topo
    assert topo is not None and plan.resume_step == r and topo.meta["reshard"]["old_world"] == 3
    (job,) = topo.meta["decode"]
    lost = shard_name(2, 3)  # n3's shard of the 3-node layout
    assert job["world"] == 3 and lost in [shard_name(i, 3) for i in job["shards"]]
    assert topo.meta["reshard"]["providers"]["2"][1] == "decode"


def test_planner_with_parity_groups_after_generated_unfinished_repartitions() -> None:
    """Generated: a p-node state protected by ec groups, repartitioned onto q nodes, a member lost before it
    finished. The planner never raises (a KeyError here crash-looped the coordinator), and every decode job
    it emits names shards, world and pieces of the p-node layout, the one the state is in."""
    rng = random.Random(2024)
    decoded = 0
    for _ in range(1500):
        p, q = rng.sample(range(2, 8), 2)
        nodes = [f"n{i}" for i in range(q)]
        old = Topology(epoch=3, nodes=nodes, workers_per_node=1, replicas=1, resume_step=0,
                       meta={"generation": 1, "reshard": {"old_world": p, "providers": {}, "params_to": {}}})
        src = Topology(epoch=2, nodes=[f"x{i}" for i in range(p)], workers_per_node=1, replicas=1, resume_step=0)
        groups = ec_groups(src, Redundancy("ec", d=rng.randint(1, 3), h=rng.randint(1, 2)))
        s = rng.randint(3, 20)
        dead = set(rng.sample(nodes, rng.randint(1, q - 1)))
        holders = rng.sample(nodes, min(p, q))  # holders[i] was rank i of the p-node layout
        descs: dict[str, Descriptor] = {}
        for n in nodes:
            if n in dead:
                continue
            d = descs[f"{n}.0"] = Descriptor(wid=f"{n}.0", params=sorted({s, s - 1} if rng.random() < 0.7 else {s}))
            if n not in holders:
                continue
            i = holders.index(n)
            name = shard_name(i, p)
            d.own[name] = {st: crc_of(name, st) for st in (s, s - 1) if rng.random() < 0.85}
            for gid, grp in enumerate(groups):
                names = [shard_name(m, p) for m in grp.members]
                for j, holder in enumerate(grp.parity):
                    if holder == i:
                        pn = parity_name(names, j)
                        d.parity[pn] = {st: {"crc": crc_of(pn, st), "j": j, "h": grp.h, "gid": gid, "members": names,
                                             "mcrc": [crc_of(x, st) for x in names]}
                                        for st in (s, s - 1) if rng.random() < 0.8}
        plan = plan_recovery(PlanInput(old=old, dead=dead, restarted=set(), descs=descs, pool=[],
                                       target_nodes=max(p, q), replicas=1, racks=1))
        if not plan.ok:
            continue
        assert plan.topo is not None
        for job in plan.topo.meta.get("decode", []):
            decoded += 1
            assert plan.topo.meta["reshard"]["old_world"] == p and job["world"] == p
            assert all(0 <= x < p for x in job["shards"])
            for piece in job["pieces"]:
                held = descs[piece["wid"]]
                got = (held.own if piece["index"] < len(job["shards"]) else held.parity)[piece["name"]][job["step"]]
                assert (got if isinstance(got, int) else got["crc"]) == piece["crc"]
    assert decoded > 100, decoded


# ---------------------------------------------------------------------------------------------- estimator


@pytest.mark.parametrize("scheme", [Redundancy("replicas", k=1), Redundancy("replicas", k=2),
                                    Redundancy("ec", d=2, h=1), Redundancy("ec", d=3, h=2)])
def test_estimator_matches_what_is_allocated(scheme: Redundancy) -> None:
    from phoenixft.train.gpt import GPT, PRESETS
    from phoenixft.train.zero import FlatModel

    nodes = 6
    model = GPT(PRESETS["tiny"])
    numel = sum(p.numel() for p in model.parameters())
    flat = FlatModel(model, shards=nodes)
    threads = torch.get_num_threads()
    est = estimate(nodes=nodes, workers_per_node=1, racks=1, scheme=scheme, numel=numel,
                   buffer_bytes=flat.buffer_bytes, rows=3, payload_rows=2)
    st = ShardState(flat.shard_numel, rows=3)
    params = sum(b.numel() * b.element_size() for b in flat.bufs) + flat.tags.numel() * 8
    state = st.data.numel() * 4 + st.header.numel() * 8
    payload = 2 * flat.shard_numel * 4
    assert est.payload_bytes == payload
    for c in est.nodes:
        assert c.params == params and c.state == state
    if scheme.is_ec:
        groups = ec_groups(Topology(epoch=0, nodes=[f"n{i}" for i in range(nodes)], workers_per_node=1, replicas=1,
                                    resume_step=0), scheme)
        dmax = max(g.d for g in groups)
        for c in est.nodes:
            want = 0
            for g in groups:
                if c.slot in g.parity:
                    ph = ParityHolding(g.d * stripe_bytes(payload, g.d) // 4, dmax)
                    want += ph.data.numel() * 4 + ph.header.numel() * 8 + ph.info.numel() * 8
            assert c.protection == want
            me = next(g for g in groups if c.slot in g.members)
            assert c.sends == (me.d - 1 + me.h) * stripe_bytes(payload, me.d)
    else:
        hold = Holding(flat.shard_numel, rows=2)
        for c in est.nodes:
            assert c.protection == scheme.k * (hold.data.numel() * 4 + hold.header.numel() * 8)
            assert c.sends == scheme.k * payload
    assert torch.get_num_threads() == threads  # the estimate is arithmetic: it leaves torch's settings alone


def test_dry_run_prints_memory_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["run", "--dry-run", "--nodes", "8", "--model", "tiny", "--redundancy", "ec:4+2", "--spares", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "nothing is started" in out and "ec:4+2" in out and "host memory per node" in out
    assert out.count("parity on [") == 2 and "bytes each rank sends per step" in out
    assert not list(__import__("pathlib").Path("runs").glob("*dry*"))


def test_dry_run_of_a_large_job_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    """5,000 nodes: equal neighbouring nodes share a row and the groups are summarised after the first 16, so
    the estimate is a screenful (it was a line per node and per group), and it comes back at once."""
    rc = cli_main(["run", "--dry-run", "--nodes", "5000", "--spares", "0", "--model", "tiny", "--redundancy", "ec:4+1"])
    out = capsys.readouterr().out
    assert rc == 0 and len(out.splitlines()) < 40, out
    assert "... and 1234 more groups of the same form" in out and "    n1-n1250 " in out, out


_META_PROBE = r"""
import sys, torch
from torch import nn
from phoenixft.train.gpt import GPT, PRESETS
from phoenixft.workload import build_on_meta

class EveryInit(nn.Module):  # every initialiser of torch.nn.init, the Tensor fills, tied and frozen parameters
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight
        self.conv = nn.Conv1d(8, 8, 3)
        self.w = nn.ParameterList(nn.Parameter(torch.empty(6, 4)) for _ in range(10))
        self.frozen = nn.Parameter(torch.empty(3, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("stat", torch.empty(5).fill_(1.0))
        self.register_buffer("pos", torch.empty(5, 3).clamp_(0, 1).t_().unsqueeze_(0))  # (metadata ops run)
        for f, p in zip([nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.xavier_uniform_,
                         nn.init.xavier_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
                         nn.init.orthogonal_, nn.init.eye_, nn.init.zeros_], self.w):
            f(p)
        nn.init.dirac_(self.conv.weight)
        nn.init.constant_(self.conv.bias, 0.5)
        self.frozen.data.uniform_().bernoulli_(0.5)

def structure(m: nn.Module) -> list:
    return [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters()] + \
        [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()]

compiler_before = "torch._dynamo" in sys.modules
for build in (lambda: GPT(PRESETS["tiny"]), EveryInit):
    meta = build_on_meta(build)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert structure(meta) == structure(build()), build
    assert len(list(meta.parameters())) == len(list(build().parameters()))  # tied weights stay tied
assert compiler_before or "torch._dynamo" not in sys.modules, "a meta build imported torch's compiler"
print("ok")
"""


def test_a_meta_build_has_the_models_structure_and_runs_no_initialiser() -> None:
    """--dry-run, the launcher's host check and the config's checks build the model on the meta device to
    count it. They skip its initialisers: run on meta, torch sends the random ones through Python reference
    kernels whose first call imports torch's compiler, seconds of every launch's start-up on a slow host. The
    structure (names, shapes, dtypes, which parameters train, tied weights) must be the model's own; checked
    in a fresh interpreter, where the compiler is not yet imported."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _META_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- the encode job


class _Repl:
    """What `ErasureProtector.protect` needs of a `Replicator`, around a real gloo group."""

    def __init__(self, pg: object, world: int, state: ShardState) -> None:
        from types import SimpleNamespace

        self.comm = SimpleNamespace(repl=pg, world=world)
        self.state = state

    def wait_all(self, works: list, what: str) -> None:  # type: ignore[type-arg]
        for w in works:
            w.wait()

    def commit_guard(self, comm: object, step: int):  # type: ignore[no-untyped-def]
        import contextlib

        return contextlib.nullcontext()

    def in_flight(self, step: int, joined: object) -> None:
        pass


@pytest.mark.parametrize("nodes,scheme", [(5, Redundancy("ec", d=2, h=1)), (7, Redundancy("ec", d=3, h=2))])
def test_distributed_encode_then_rebuild_any_h_members(nodes: int, scheme: Redundancy) -> None:
    """Real gloo groups, one thread per rank: every rank encodes its stripe of its group's payloads and the
    parity holders commit the blocks; uneven groups (5 = 2+2+1, 7 = 3+2+2); then every set of up to h
    members of every group is rebuilt bit for bit from the others and the parity of the same step."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from phoenixft.protect.redundancy.protect import ErasureProtector, u8
    from phoenixft.recovery.rebuild import block_floats, decode_blocks

    topo = Topology(epoch=0, nodes=[f"n{i}" for i in range(nodes)], workers_per_node=1, replicas=1, resume_step=0)
    store = dist.HashStore()
    numel, step = 1000, 5  # shard elements: payload 2 x 1000 float32, not a multiple of the stripe
    states, protectors, errors = {}, {}, []
    gen = torch.Generator().manual_seed(nodes)
    for r in range(nodes):
        st = ShardState(numel, rows=3)
        st.data[0] = torch.randn(3, numel, generator=gen)
        st.data[0, 1, ::9] = float("nan")
        st.commit(0, step, 0, (r, nodes))
        states[r] = st

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), r, nodes, timedelta(seconds=60))
            ep = ErasureProtector(lambda gid, n, dmax: ParityHolding(n, dmax))
            ep.plan = ec_plan(topo, r, scheme)
            sent, committed = ep.protect(_Repl(pg, nodes, states[r]), step)  # type: ignore[arg-type]
            assert sent > 0 and set(committed) == {hb.gid for hb in ep.plan.held}  # type: ignore[union-attr]
            protectors[r] = ep
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    from phoenixft.protect.snapshot import checksum

    n = 2 * numel
    payload = {r: states[r].payload(0).reshape(-1) for r in range(nodes)}
    for gid, grp in enumerate(ec_groups(topo, scheme)):
        d, h = grp.d, grp.h
        pf = block_floats(n, d)
        blocks = {}
        for i, r in enumerate(grp.members):
            b = torch.zeros(pf)
            b[:n] = payload[r]
            blocks[i] = u8(b)
        for j, holder in enumerate(grp.parity):
            ph = protectors[holder].parity[gid]
            half = ph.half_with(step)
            assert half is not None and ph.verify(half)
            info = ph.info_of(half)
            assert info.j == j and list(info.members) == list(grp.members)
            assert list(info.mcrc) == [checksum(payload[r]) for r in grp.members]
            blocks[d + j] = u8(ph.payload(half).reshape(-1).clone())
        code = make_code(d, h)
        for k in range(1, min(h, d) + 1):
            for lost in itertools.combinations(range(d), k):
                pieces = {i: b for i, b in blocks.items() if i not in lost}
                got = decode_blocks(code, pieces, n, list(lost))
                for i in lost:
                    assert torch.equal(got[i].view(torch.int32), payload[grp.members[i]].view(torch.int32))


def test_dry_run_of_a_model_that_fails_to_build_is_one_line(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--dry-run builds the workload's model on the meta device: its build_model raising was a traceback."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    rc = cli_main(["run", "--dry-run", "--nodes", "2", "--workload", "user_workload:bad_model_workload"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("phoenixft run: error: --workload='user_workload:bad_model_workload': its build_model "
                               "failed on torch's meta device (where --dry-run builds it, allocating nothing): "
                               "RuntimeError: layer sizes do not match (deliberate bug)"), err
