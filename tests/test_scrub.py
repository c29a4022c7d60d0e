"""Scrubbing (protect/scrub.py, scrub_round.py, scrub_repair.py) and the at-rest bit flip (faults/at_rest.py):
the rate limiter's promise over generated schedules, verification of held halves, the repair round between
real processes over generated rounds, and end to end: a bit flipped in the copy a later recovery needs is
found and repaired first (from a peer on this host or another), and the run ends bitwise."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run

from phoenixft.config import RunConfig
from phoenixft.distributed.topology import Topology
from phoenixft.errors import UserError
from phoenixft.faults.at_rest import flip_bit
from phoenixft.faults.kinds import Point
from phoenixft.faults.spec import parse_fault
from phoenixft.protect import scrub_repair
from phoenixft.protect.scrub import Finding, HeldCopy, Scrubber, ScrubSchedule
from phoenixft.protect.scrub_round import HELD, OWN, Ask
from phoenixft.protect.snapshot import Holding, PingPong, checksum


# ------------------------------------------------------------------ the rate limiter
def test_every_pass_covers_every_item_within_n_ticks_and_bounds_the_bytes_per_tick() -> None:
    rng = random.Random("scrub-schedule")
    for _case in range(600):
        every = rng.randint(1, 9)
        sizes = {i: rng.choice([0, 1, rng.randint(1, 10**6)]) for i in range(rng.randint(0, 12))}
        sched = ScrubSchedule(every)
        total = sum(sizes.values())
        budget = max(1, math.ceil(total / every))
        biggest = max(sizes.values(), default=0)
        for _p in range(3):  # passes in a row: each one alone within `every` ticks
            seen: list[int] = []
            ticks = 0
            while ticks < every:
                ticks += 1
                due = sched.tick(sizes)
                assert sum(sizes[k] for k in due) <= budget + biggest, (every, sizes, due)
                seen += due
                if sorted(seen) == sorted(sizes):
                    break
            assert sorted(seen) == sorted(sizes), (every, sizes, seen)  # every item once, within `every` ticks
            assert sched.pass_ticks == ticks


def test_items_that_come_and_go_are_covered_by_the_next_pass() -> None:
    rng = random.Random("scrub-churn")
    for _case in range(300):
        every = rng.randint(1, 5)
        sched = ScrubSchedule(every)
        present = {i: rng.randint(1, 1000) for i in range(rng.randint(1, 8))}
        last_seen = {k: 0 for k in present}
        for t in range(1, 40):
            if rng.random() < 0.2:  # a holding dropped or added (a recovery, a new ring)
                k = rng.randint(0, 10)
                if k in present and len(present) > 1:
                    del present[k]
                    last_seen.pop(k, None)
                else:
                    present[k] = rng.randint(1, 1000)
                    last_seen[k] = t
            for k in sched.tick(present):
                assert k in present  # never one that is gone
                last_seen[k] = t
            for k in present:  # an item present for two whole passes was verified in one of them
                assert t - last_seen[k] < 2 * every + 1, (every, t, k, last_seen)


def test_schedule_refuses_a_pass_of_zero_steps() -> None:
    with pytest.raises(ValueError):
        ScrubSchedule(0)


# ------------------------------------------------------------------ verification and repair
def _holding(step: int, numel: int = 1000, path: str | None = None, seed: int = 0) -> Holding:
    h = Holding(numel, path, rows=2)
    g = torch.Generator().manual_seed(seed)
    for half, s in ((0, step - 1), (1, step)):
        h.begin_write(half)
        h.payload(half).copy_(torch.randn(h.payload(half).shape, generator=g))
        h.commit(half, s, checksum(h.payload(half)), (0, 3))
    return h


def test_flip_bit_flips_exactly_that_bit_and_flipping_again_restores() -> None:
    rng = random.Random("flip")
    t = torch.randn(257)
    for _ in range(200):
        before = t.clone()
        e, b = rng.randrange(t.numel()), rng.randrange(32)
        flip_bit(t, e, b)
        diff = (t.view(torch.int32) ^ before.view(torch.int32))
        assert int((diff != 0).sum()) == 1 and int(diff[e]) == ((1 << b) if b < 31 else -(1 << 31))
        flip_bit(t, e, b)
        assert torch.equal(t.view(torch.int32), before.view(torch.int32))


def test_scrubber_finds_a_flipped_bit_repairs_it_and_reports_once() -> None:
    h, other = _holding(5, seed=1), _holding(5, seed=1)  # `other`: a good copy of the same bytes
    found: list[Finding] = []
    rounds: list[list[tuple[str, int, int]]] = []  # what each tick's repair was handed

    def repair(pairs: list[tuple[HeldCopy, Finding]]) -> None:
        rounds.append([(f.kind, f.half, f.step) for _, f in pairs])
        for c, f in pairs:
            src = other.payload(other.half_with(f.step) or 0)
            assert checksum(src) == f.crc
            c.pp.payload(f.half).copy_(src)
            f.repaired_from = "the good copy"

    sc = Scrubber(1, lambda: [HeldCopy("replica", 0, h)], repair, found.append)
    sc.tick()
    assert found == [] and sc.stats.last_bytes == 2 * 2 * 1000 * 4  # both halves hashed, nothing found
    assert rounds == [[]]  # the repair is called every tick (a collective round in the product), empty here
    flip_bit(h.payload(1), 123, 30)
    assert not h.verify(1)
    sc.tick()
    (f,) = found
    assert (f.kind, f.ident, f.half, f.step, f.repaired_from) == ("replica", 0, 1, 5, "the good copy")
    assert h.verify(1) and sc.stats.found == sc.stats.repaired == 1 and rounds[1] == [("replica", 1, 5)]
    # a copy that cannot be repaired is said once, not at every pass; a half not committed is not hashed
    flip_bit(h.payload(0), 7, 3)

    def no_repair(pairs: list[tuple[HeldCopy, Finding]]) -> None:
        rounds.append([(f.kind, f.half, f.step) for _, f in pairs])
        for _, f in pairs:
            f.why_not = "no good copy"

    sc2 = Scrubber(1, lambda: [HeldCopy("replica", 0, h)], no_repair, found.append)
    sc2.tick()
    sc2.tick()
    assert [(x.half, x.step, x.why_not) for x in found[1:]] == [(0, 4, "no good copy")]
    assert rounds[2:] == [[("replica", 0, 4)], []]
    h.begin_write(0)  # torn: skipped
    sc2.tick()
    assert sc2.stats.last_bytes == 1000 * 2 * 4 and len(found) == 2


def test_the_repair_round_is_made_even_when_verification_fails() -> None:
    calls: list[int] = []

    def copies() -> list[HeldCopy]:
        raise RuntimeError("a holding went away")

    sc = Scrubber(1, copies, lambda pairs: calls.append(len(pairs)), lambda f: None)
    with pytest.raises(RuntimeError, match="went away"):
        sc.tick()
    assert calls == [0]  # every rank makes the round, or the group's collectives would no longer match


def _flipped(t: torch.Tensor) -> torch.Tensor:
    bad = t.clone()
    flip_bit(bad, 17, 11)
    return bad


def test_a_repair_installs_only_a_copy_that_verifies_against_the_committed_checksum() -> None:
    """Rank 0 of a 3-node ring holds a replica whose newest half went bad. What a peer sends is installed
    only when its bytes match the checksum the half was committed with: a copy one bit off (a lying or
    damaged peer, a flip in transit) is refused and nothing is written: the half keeps its bad bytes, which do not
    verify, so nothing serves or restores it as a good copy; the right bytes repair it."""
    topo = Topology(epoch=1, nodes=["n0", "n1", "n2"], workers_per_node=1, replicas=1, resume_step=0)
    (x,) = topo.sources(0)
    h = Holding(1000, rows=2)
    g = torch.Generator().manual_seed(5)
    for half, s in ((0, 4), (1, 5)):
        h.begin_write(half)
        h.payload(half).copy_(torch.randn(h.payload(half).shape, generator=g))
        h.commit(half, s, checksum(h.payload(half)), (x, 3))
    good, crc = h.payload(1).clone(), h.crc_of(1)
    flip_bit(h.payload(1), 3, 7)
    corrupt = h.payload(1).clone()
    f = Finding(kind="replica", ident=x, half=1, step=5, crc=crc)
    (req,) = scrub_repair.requests([(HeldCopy("replica", x, h), f)], 0, topo, True, lambda d, k: None, 1000)
    assert [p for p, _ in req.asks] == [x] and req.asks[0][1] == Ask(OWN, x, 5, crc, 2000)
    with pytest.raises(LookupError, match="does not match the committed checksum"):
        req.install({x: _flipped(good)})
    assert torch.equal(h.payload(1).view(torch.int32), corrupt.view(torch.int32)) and h.crc_of(1) == crc
    assert h.verified_half(5) is None
    assert req.install({x: good.clone()}) == f"owner n{x}.0"
    assert torch.equal(h.payload(1).view(torch.int32), good.view(torch.int32)) and h.verified_half(5) == 1


def test_a_peer_serves_only_bytes_that_match_the_checksum_asked_for_hashed_when_asked() -> None:
    """The serving side of a repair: its own committed half, or its replica, only when the bytes hash to the
    checksum asked for at the time of the ask; a bit flipped at rest after an earlier verification (the
    header unchanged) makes it refuse, and so does a checksum or step it does not hold."""
    own = PingPong(2, 500)
    h = Holding(300, rows=2)
    g = torch.Generator().manual_seed(9)
    for pp in (own, h):
        for half, s in ((0, 6), (1, 7)):
            pp.begin_write(half)
            pp.payload(half).copy_(torch.randn(pp.payload(half).shape, generator=g))
            pp.commit(half, s, checksum(pp.payload(half)), (2, 4))
    serve = scrub_repair.server(lambda: own, lambda: {2: h})
    own_ask, held_ask = Ask(OWN, 1, 7, own.crc_of(1), 1000), Ask(HELD, 2, 7, h.crc_of(1), 600)
    for pp, ask in ((own, own_ask), (h, held_ask)):
        t = serve(ask)
        assert t is not None and torch.equal(t, pp.payload(1))
        assert serve(Ask(ask.what, ask.ident, 7, ask.crc ^ 1, ask.numel)) is None  # another checksum
        assert serve(Ask(ask.what, ask.ident, 8, ask.crc, ask.numel)) is None  # a step it does not hold
        assert pp.verify(1) and pp.verified_half(7) == 1  # (verified once: a later flip must not ride on it)
        flip_bit(pp.payload(1), 40, 2)
        assert serve(ask) is None, ask
        assert not pp.verify(1) and pp.verified_half(7) is None  # a failed verification ends "verified"
        flip_bit(pp.payload(1), 40, 2)
        assert serve(ask) is not None
    assert serve(Ask(HELD, 3, 7, h.crc_of(1), 600)) is None  # a shard it holds no replica of


def test_scrubber_spreads_a_pass_over_n_steps() -> None:
    copies = [HeldCopy("replica", i, _holding(3, seed=i)) for i in range(4)]  # 8 halves of 8000 bytes
    sc = Scrubber(4, lambda: copies, lambda pairs: None, lambda f: None)
    per_tick = []
    for _ in range(4):
        sc.tick()
        per_tick.append(sc.stats.last_bytes)
    assert per_tick == [16000] * 4 and sc.schedule.passes == 1


def test_halves_older_than_any_recovery_point_are_not_hashed() -> None:
    h = _holding(5)  # halves of steps 4 and 5
    flip_bit(h.payload(h.half_with(4) or 0), 1, 1)  # damage in the half of step 4
    found: list[Finding] = []
    sc = Scrubber(1, lambda: [HeldCopy("replica", 0, h)], lambda pairs: None, found.append, oldest=lambda: 5)
    sc.tick()
    assert found == [] and sc.stats.last_bytes == 1000 * 2 * 4  # only the half of step 5: a recovery point
    sc._oldest = lambda: 4
    sc.tick()
    assert [f.step for f in found] == [4]


@pytest.mark.parametrize("text,why", [
    ("sdc:node=1@step=3", "expected sdc:node=I@step=S,target=param|grad|shard[,bit=B][,persist]"),
    ("sdc:node=1@step=3,target=disk", "target='disk': one of param, grad, shard"),
    ("sdc:node=1@step=3,target=shard,bit=32", "bit='32': a bit of a 32-bit element, 0..31"),
    ("sdc:node=1@step=3,target=shard,phase=forward", "expected sdc:node=I@step=S,target=param|grad|shard"),
    ("sdc:node=1@step=3,target=shard,persist", "persist is for target=param or target=grad"),
    ("sdc:node=1@step=3,target=shard,wait=5", "wait=SECONDS is for"),
    ("kill:node=1@step=3,bit=3", "expected kill:"),
])
def test_sdc_shard_specs_refused_say_why(text: str, why: str) -> None:
    with pytest.raises(UserError, match=re.escape(why)):
        parse_fault(text)


def test_sdc_shard_fires_at_rest_and_writes_back() -> None:
    f = parse_fault("sdc:node=1@bit=30,step=6,target=shard")
    assert (f.point, f.target, f.bit, f.step, f.nodes) == (Point.AT_REST, "shard", 30, 6, (1,))
    assert str(f) == "sdc:node=1@step=6,target=shard,bit=30"
    assert not f.kind_of.answered_by_recovery(f)


def test_a_finding_is_one_live_line(capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.observe.display import Display

    d = Display(quiet=True, steps=10)
    d.event({"kind": "scrub_found", "node": "n1", "copy": "replica", "shard": "pp0.tp0.dp0of3", "step": 3,
             "repaired": True, "repaired_from": "owner n0.0"})
    d.event({"kind": "scrub_found", "node": "n2", "copy": "parity", "shard": "parity0:a,b", "step": 4,
             "repaired": False, "why_not": "no good copy of step 4 readable on this host (tried n0.0)"})
    assert capsys.readouterr().err.splitlines() == [
        "!! scrub: n1 found its replica pp0.tp0.dp0of3 of step 3 corrupt at rest; repaired: owner n0.0",
        "!! scrub: n2 found its parity block parity0:a,b of step 4 corrupt at rest; NOT repaired (no good copy of "
        "step 4 readable on this host (tried n0.0)); no recovery will use it"]


def test_scrub_every_is_validated_in_one_line() -> None:
    with pytest.raises(UserError, match=r"--scrub-every=-1 is invalid: must be >= 0"):
        RunConfig(scrub_every=-1).validate()


# ------------------------------------------------------------------ end to end
# n1 keeps n0's replica (replicas:1) or the parity block of {n0, n2} (ec:2+1, 3 nodes). A bit of the copy of
# step 3 that n1 committed during step 4 flips at rest; n0 is then killed during its protection of step 4
# (replicate phase of step 5, every pair over TCP in small chunks, so the copy of step 4 never completes): the
# recovery's only copy of n0's shard is the one of step 3. Without scrubbing the run is lost (tested slow
# below); with it, n1 found and repaired its copy in its next protection job, and the run ends bitwise.
INJECT = ["sdc:node=1@step=4,target=shard", "kill:node=0@step=5,phase=replicate"]
E2E = dict(nodes=3, spares=1, steps=12, replica_transport="tcp", chunk_mb=0.01)


def _check(rep: dict[str, Any], tmp_path: Path, ref: dict[str, Any], source: str) -> None:
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["faults_not_fired"] == []
    sc = rep["scrub"]
    assert (sc["every"], sc["found"], sc["repaired"]) == (1, 1, 1), sc
    (f,) = sc["findings"]
    assert f["node"] == "n1" and f["step"] == 3 and f["repaired"] and f["repaired_from"].startswith(source), f
    (rec,) = rep["recoveries"]
    assert rec["resumed_step"] == 3 and rec["replicas_rejected"] == [], rec  # the repaired copy was used
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    (hit,) = [e for e in events if e.get("kind") == "corrupted_at_rest"]
    assert hit["node"] == "n1" and hit["step"] == 3 and hit["copy"] == f["copy"], hit
    found_t = next(e["t"] for e in events if e.get("kind") == "scrub_found")
    kill_t = next(e["t"] for e in events if e.get("kind") == "fault" and e["spec"].startswith("kill"))
    assert found_t < kill_t + 1.0  # (found in n1's job of step 4, the job the kill interrupts on n0)


def test_scrub_repairs_a_replica_before_the_recovery_that_needs_it(tmp_path: Path, reference: Any) -> None:
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, **E2E, inject=INJECT)
    _check(rep, tmp_path, ref, "owner n0.0")
    assert rep["scrub"]["findings"][0]["shard"] == "pp0.tp0.dp0of3"
    from phoenixft.observe.html_report import write_report

    html = write_report(tmp_path).read_text()
    table = html[html.index('<table id="scrub">'):]
    assert "from owner n0.0" in table[: table.index("</table>")] and ">n1<" in table[: table.index("</table>")]


def test_scrub_reencodes_a_parity_block_before_the_rebuild_that_needs_it(tmp_path: Path, reference: Any) -> None:
    ref = reference(nodes=3, steps=12)
    rep = run(tmp_path, **E2E, redundancy="ec:2+1", inject=INJECT)
    _check(rep, tmp_path, ref, "re-encoded from n0.0, n2.0")
    assert rep["scrub"]["findings"][0]["shard"] == "parity0:pp0.tp0.dp0of3,pp0.tp0.dp2of3"
    assert rep["recoveries"][0]["decoded"], rep["recoveries"][0]


@pytest.mark.slow
def test_without_scrubbing_the_same_schedule_loses_the_shard(tmp_path: Path) -> None:
    rep = run(tmp_path, **E2E, scrub_every=0, inject=INJECT)
    assert rep["state"] == "failed"
    assert "lost shards: pp0.tp0.dp0of3" in rep["error"] and "['pp0.tp0.dp0of3', 3]" in rep["error"], rep["error"]
    assert rep["scrub"] == {"every": 0, "found": 0, "repaired": 0, "findings": []}


@pytest.mark.slow  # (about 25 s: five hosts' processes; the round itself is in make test, test_scrub_round.py)
def test_scrub_repairs_a_replica_from_its_owner_on_another_host(tmp_path: Path, reference: Any) -> None:
    """The same schedule across hosts (network namespaces, each host on a /dev/shm of its own, so that no
    memory file of one host can be read from another): n1's corrupt replica is repaired with bytes sent by
    its owner n0 over the network, and the recovery after n0's kill resumes from it, bitwise."""
    import secrets
    import subprocess

    from conftest import SUITE_FLAGS
    from netns import Hosts, unavailable
    from test_hosts import PORT, PY, _env

    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    ref = reference(nodes=3, steps=12)
    token = secrets.token_hex(16)
    with Hosts(["head", "h1", "h2", "h3", "h4"]) as H:
        head = H.run("head", [PY, "-m", "phoenixft", "coordinator", "--host", H.addr["head"], "--port", PORT,
                              "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "report.json"),
                              "--nodes", "3", "--spares", "1", "--steps", "12", "--model", "tiny", "--quiet",
                              "--replica-transport", "tcp", "--chunk-mb", "0.01", "--scrub-every", "1",
                              "--failure-timeout", "2", *SUITE_FLAGS, *[x for f in INJECT for x in ("--inject", f)]],
                     log=tmp_path / "head.log", env=_env(token))
        for h in ("h1", "h2", "h3", "h4"):
            H.run(h, [PY, "-m", "phoenixft", "agent", "--coordinator", f"{H.addr['head']}:{PORT}", "--node", h,
                      *(["--spare"] if h == "h4" else [])], log=tmp_path / f"{h}.log", env=_env(token), own_shm=True)
        try:
            rc = head.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail("the run did not end:\n" + (tmp_path / "head.log").read_text()[-3000:])
        assert rc == 0, (tmp_path / "head.log").read_text()[-3000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    assert rep["faults_not_fired"] == []
    (f,) = rep["scrub"]["findings"]
    assert (f["node"], f["step"], f["repaired"], f["repaired_from"]) == ("n1", 3, True, "owner n0.0"), f
    (rec,) = rep["recoveries"]
    assert rec["resumed_step"] == 3 and rec["replicas_rejected"] == [] and rec["dead"] == ["n0"], rec
    owner, holder = rep["members"]["n0"]["name"], rep["members"]["n1"]["name"]
    assert owner != holder and {owner, holder} <= {"h1", "h2", "h3"}, rep["members"]  # (on two hosts)
