"""The health gate for spares and the quarantine of hosts that fail again and again (docs/health.md).

Real runs: a sick spare is passed over for the next one (bitwise equal to a failure-free run); a
`--health-check` command that fails and one that outlives its timeout leave no healthy spare, so the job
shrinks; a host that failed twice is dismissed, refused when it comes back repaired, shown quarantined by
`phoenixft status`, and still refused by the coordinator after it was restarted. The built-in probes and
the quarantine rule are tested here directly (the rule over generated histories, against brute force).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import processes_with, run, wait_while_running

from phoenixft.controlplane import keys, sealed
from phoenixft.health import quarantine, quarantined_at, quarantined_hosts, read_history, record_failure
from phoenixft.health.check import builtin_checks, reference_checksum, run_command
from phoenixft.health.history import host_records
from phoenixft.health.summary import format_lines
from phoenixft.health.window import failures_in_window
from phoenixft.observe.status import collect_status, connect, format_status


# ---------------------------------------------------------------- the quarantine rule (pure)
def _brute(times: list[float], after: int, window: float) -> float | None:
    """The earliest failure time t such that `after` failures lie in [t - window, t]."""
    if after <= 0:
        return None
    hits = [t for t in sorted(times) if sum(1 for x in times if t - window <= x <= t) >= after]
    return hits[0] if hits else None


def test_the_quarantine_rule_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(0, 8)
        times = [float(rng.randint(0, 60)) for _ in range(n)]
        after, window = rng.randint(0, 4), float(rng.choice([0, 1, 5, 10, 30, 100]))
        got = quarantined_at(times, after, window)
        assert got == _brute(times, after, window), (times, after, window, got)
        if got is not None:  # at that moment the window holds enough failures; never before
            assert failures_in_window(times, got, window) >= after
            assert all(failures_in_window(times, t, window) < after for t in times if t < got)
        # order does not matter, and one more failure never lifts a quarantine or makes it later
        assert quarantined_at(list(reversed(times)), after, window) == got
        more = quarantined_at(times + [float(rng.randint(0, 60))], after, window)
        assert got is None or (more is not None and more <= got)


def test_the_history_in_a_store_dedups_ignores_garbage_and_quarantines() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = connect(f"127.0.0.1:{master.port}", 5.0)
    sealed.bind("t" * 32, "rid")  # (the job's processes seal what they append: the garbage below is not)
    record_failure(store, "h1", "n1", "lost", "dead:n1", t=100.0)
    record_failure(store, "h1", "n1", "lost", "dead:n1", t=100.0)  # the same failure again (a restarted coordinator)
    store.append(keys.HOST_HISTORY, "not json\n")
    store.append(keys.HOST_HISTORY, json.dumps({"kind": "failure", "host": "h1", "t": "soon"}) + "\n")
    assert quarantined_hosts(store, 2, 3600.0) == {}
    record_failure(store, "h1", "s4", "health check failed", "health:s4:1", t=200.0)
    record_failure(store, "h2", "n2", "lost", "dead:n2", t=100.0)
    q = quarantined_hosts(store, 2, 3600.0)
    assert list(q) == ["h1"] and q["h1"].quarantined == 200.0 and len(q["h1"].failures) == 2
    assert quarantined_hosts(store, 2, 50.0) == {}  # the two failures lie 100 s apart
    assert quarantined_hosts(store, 0, 3600.0) == {}  # 0: the rule is off
    quarantine(store, "h3", "found corrupting gradients")  # what other detectors call
    q = quarantined_hosts(store, 0, 3600.0)
    assert list(q) == ["h3"] and q["h3"].reason == "found corrupting gradients" and q["h3"].failures == []
    recs = host_records(read_history(store), 2, 3600.0)
    assert sorted(recs) == ["h1", "h2", "h3"] and len(recs["h2"].failures) == 1
    # failures an --inject fault caused are listed, never counted: h4 fails three times, two of them injected
    record_failure(store, "h4", "n4", "lost", "dead:n4", t=100.0, injected="kill:node=4@step=3")
    record_failure(store, "h4", "s5", "lost", "dead:s5", t=110.0, injected="hang:node=4@step=9")
    record_failure(store, "h4", "s7", "lost", "dead:s7", t=120.0)
    recs = host_records(read_history(store), 2, 3600.0)
    assert recs["h4"].quarantined is None and len(recs["h4"].failures) == 3, recs["h4"]
    assert [f.get("injected") for f in recs["h4"].failures] == ["kill:node=4@step=3", "hang:node=4@step=9", None]
    record_failure(store, "h4", "s9", "lost", "dead:s9", t=130.0)  # its second real failure
    assert host_records(read_history(store), 2, 3600.0)["h4"].quarantined == 130.0


# ---------------------------------------------------------------- the built-in check
def test_the_builtin_check_and_the_command(tmp_path: Path) -> None:
    from phoenixft.distributed.device import Device

    ref = reference_checksum()
    assert ref == reference_checksum() and len(ref) == 32
    path = f"/dev/shm/phoenixft-healthtest{os.getpid()}-x.health"
    ok = builtin_checks(Device("cpu"), path, 1 << 20, ref)
    assert ok.ok and set(ok.times) == {"matmul", "shm", "collective"}, ok
    bad = builtin_checks(Device("cpu"), path, 1 << 20, ref, perturb=True)
    assert not bad.ok and bad.reason.startswith("matrix product: checksum"), bad
    assert not os.path.exists(path)
    assert run_command("true", 5) == ""
    assert "exited 3: boom" in run_command("echo boom; exit 3", 5)
    t = time.monotonic()
    assert "did not finish within --health-check-timeout=0.5s" in run_command(f"sleep 30; touch {tmp_path}/x", 0.5)
    assert time.monotonic() - t < 5 and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the gate's decisions, over a real store
def _store() -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    return master, connect(f"127.0.0.1:{master.port}", 5.0)


def _post(store: Any, node: str, n: int, ok: bool | None = None, age: float = 0.0, ask: int = 0) -> None:
    """What spare `node`'s agent posts: check n started `age` s ago, and (ok not None) its verdict."""
    t = time.time() - age
    sealed.put(store, keys.health_running(node), json.dumps({"n": n, "phase": "join", "ask": ask, "t": t}))
    if ok is not None:
        verdict = {"ok": ok, "reason": "" if ok else "matrix product: bad", "n": n, "ask": ask, "t": t,
                   "phase": "join", "node": node}
        sealed.put(store, keys.health(node), json.dumps(verdict))


def _ask(store: Any) -> dict[str, Any]:
    return sealed.get_json(store, keys.HEALTH_ASK) or {}


def test_the_gate_takes_fresh_verdicts_waits_for_running_checks_and_asks_stale_ones(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from phoenixft.config import RunConfig
    from phoenixft.coordinator.shared import Job, Membership
    from phoenixft.health import gate as gate_mod

    _master, store = _store()
    sealed.bind("t" * 32, "rid")  # (the job's processes seal what they write and check what they read)
    spares = ["s0", "s1", "s2", "s3", "s4"]
    state = Membership(members={s: {"hostid": f"h/{s}"} for s in spares}, spare_pool=list(spares))
    g = gate_mod.HealthGate(Job(store, 1), RunConfig(health_max_age=10.0, health_recheck_every=3.0), state)
    _post(store, "s0", 1, ok=True, age=1.0)  # fresh
    _post(store, "s1", 1, ok=True, age=50.0)  # passed, but older than --health-max-age
    _post(store, "s2", 1)  # its join check still running
    _post(store, "s3", 1, ok=False)  # sick
    assert g.healthy(spares) == ["s0", "s1"]  # (s4 never started a check: never promoted)
    assert g.healthy(spares, pending=True) == ["s0", "s1", "s2"]
    from phoenixft.controlplane import LogReader

    log, seen = LogReader(store, keys.EVENTS), []  # (the events: a queue, taken from as a launcher does)
    events = lambda: seen.extend(sealed.records(keys.EVENTS, log.read_bytes())) or seen  # noqa: E731
    assert [(e["kind"], e["node"]) for e in events()] == [("spare_unhealthy", "s3")]  # once, though read twice

    g.begin(["s0", "s1", "s2"])  # a recovery: only the stale one is asked to check again
    assert _ask(store)["nodes"] == ["s1"] and _ask(store)["recheck"] == []
    t = time.monotonic()
    assert g.vet(["s0", "s1", "s2"], 1) == ["s0"] and time.monotonic() - t < 0.5  # fresh: taken at once

    def answer(node: str, n: int, ok: bool, ask: int, after: float) -> threading.Thread:
        th = threading.Thread(target=lambda: (time.sleep(after), _post(store, node, n, ok=ok, ask=ask)))
        th.start()
        return th

    th = answer("s2", 1, True, 0, 0.3)  # the running join check's verdict comes
    t = time.monotonic()
    assert g.vet(["s2"], 1) == ["s2"] and time.monotonic() - t >= 0.25
    th.join()
    th = answer("s1", 2, True, _ask(store)["seq"], 0.2)  # s1 answers the recovery's ask
    assert g.vet(["s1"], 1) == ["s1"] and "s1" not in g.asked
    th.join()
    _post(store, "s2", 2)  # a background re-check of s2 runs: its fresh verdict is taken, not waited for
    assert g.vet(["s2"], 1) == ["s2"]
    _post(store, "s2", 2, ok=True, age=50.0)  # ... a stale one is not: s2's check runs, and fails (passed over
    _post(store, "s2", 3)  # for the next, and announced)
    th = answer("s2", 3, False, 0, 0.2)
    assert g.vet(["s2", "s0"], 1) == ["s0"]
    th.join()
    assert [e["kind"] for e in events()][-2:] == ["spare_unhealthy", "spares_passed_over"]

    # idle spares are re-checked in the background once their verdict is --health-recheck-every old
    _post(store, "s0", 3, ok=True, age=4.0)
    _post(store, "s1", 3, ok=True, age=1.0)
    idle = g.healthy(["s0", "s1"])
    g.keep_fresh(idle)
    ask = _ask(store)
    assert ask["nodes"] == ["s0"] and ask["recheck"] == ["s0"], ask
    g.keep_fresh(g.healthy(["s0", "s1"]))  # asked already: not again
    assert _ask(store)["seq"] == ask["seq"]
    _post(store, "s0", 4, ok=True, ask=ask["seq"])  # answered: settled
    g.keep_fresh(g.healthy(["s0", "s1"]))
    assert "s0" not in g.asked and _ask(store)["seq"] == ask["seq"]

    # a spare that never answers is passed over once the check's bound and the margin ran out
    monkeypatch.setattr(gate_mod, "check_bound_s", lambda cfg: 0.2)
    monkeypatch.setattr(gate_mod, "ANSWER_MARGIN_S", 0.1)
    _post(store, "s1", 4, ok=True, age=50.0)
    _post(store, "s1", 5)
    t = time.monotonic()
    assert g.vet(["s1"], 1) == [] and 0.25 <= time.monotonic() - t < 2
    why = json.loads(sealed.get(store, keys.health("s1")) or b"null")["reason"]
    assert "no answer to the check before its promotion" in why
    # --health-max-age 0: no verdict is fresh, every promotion asks for a check just before it
    strict = gate_mod.HealthGate(Job(store, 1), RunConfig(health_max_age=0.0), state)
    _post(store, "s0", 6, ok=True)
    strict.begin(strict.healthy(["s0"], pending=True))
    assert _ask(store)["nodes"] == ["s0"]


def test_a_spare_checks_in_the_background_and_a_running_check_answers_an_ask(tmp_path: Path) -> None:
    from phoenixft.config import RunConfig
    from phoenixft.health.spare import SpareHealth

    _master, store = _store()
    sealed.bind("t" * 32, "rid")  # (the job's processes seal what they write and check what they read)
    h = SpareHealth(RunConfig(nodes=2), "s0", "t3strun000", "h/s0", workers=1)
    t = time.monotonic()
    h.start_join(store)  # announced at once; its process starts once the node's worker is ready
    assert time.monotonic() - t < 1.0 and h.running is None and h.busy
    running = json.loads(sealed.get(store, keys.health_running("s0")) or b"null")
    assert running["n"] == 1 and running["phase"] == "join" and not store.check([keys.health("s0")])
    h.poll(store)
    assert h.running is None
    sealed.put(store, keys.ready("s0.0"), str(time.time()))
    h.poll(store)  # the worker is ready: the check runs now, in its own process
    assert h.running is not None
    sealed.put(store, keys.HEALTH_ASK, json.dumps({"seq": 7, "nodes": ["s0"], "recheck": [], "t": time.time()}))
    h.answer(store)  # asked while its join check runs: that check answers the ask, no second one starts
    assert h.n == 1
    deadline = time.monotonic() + 60
    while h.running is not None and time.monotonic() < deadline:
        h.poll(store)
        time.sleep(0.02)
    rec = json.loads(sealed.get(store, keys.health("s0")) or b"null")
    assert rec["ok"] and rec["n"] == 1 and rec["ask"] == 7 and rec["phase"] == "join", rec
    sealed.put(store, keys.HEALTH_ASK, json.dumps({"seq": 8, "nodes": ["s0"], "recheck": ["s0"], "t": time.time()}))
    h.answer(store)
    assert h.n == 2 and json.loads(sealed.get(store, keys.health_running("s0")) or b"null")["phase"] == "recheck"
    h.stop()  # its agent leaves: the check is killed, nothing posted
    assert h.running is None and json.loads(sealed.get(store, keys.health("s0")) or b"null")["n"] == 1
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("phoenixft-t3strun000")]


# ---------------------------------------------------------------- real runs
def test_a_sick_spare_is_passed_over_for_the_next(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=3, steps=14)
    rep = run(tmp_path, nodes=3, spares=2, steps=14, inject=["sick:spare=0", "kill:node=1@step=8"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["faults_not_fired"] == []
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["dead"] == ["n1"] and rec["promoted"] == ["s1"], rec
    health = {s["node"]: s for s in rep["health"]["spares"]}
    assert rep["health"]["unhealthy"] == ["s0"]
    assert health["s0"]["reason"].startswith("matrix product: checksum") and health["s0"]["phase"] == "join"
    # s1's verdict (from its join, or a background re-check on a slow machine) was fresh (--health-max-age):
    # promoted on it, with no check on the recovery's path
    assert health["s1"]["ok"] and health["s1"]["phase"] in ("join", "recheck"), health["s1"]
    planned = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"recovery_planned"' in x]
    assert planned[0]["promoted"] == ["s1"], planned
    hosts = {h["host"].rsplit("/", 1)[-1]: h for h in rep["quarantine"]["hosts"]}
    assert sorted(hosts) == ["n1", "s0"] and rep["quarantine"]["quarantined"] == []  # one failure each
    from phoenixft.observe.html_report import write_report

    html = write_report(tmp_path).read_text()
    assert 'id="spare-health"' in html and "UNHEALTHY" in html and "matrix product: checksum" in html


@pytest.mark.slow
def test_a_spare_that_falls_sick_after_joining_fails_its_check_before_promotion(  # type: ignore[no-untyped-def]
        tmp_path: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --health-max-age 0 every promotion waits for a check just before it: the one that finds s0 sick.
    The run is paced (tests/user_workload.py: 0.3 s more per microbatch, asleep) so that both spares' join
    checks, which start once their workers are ready, run before s0 falls sick: unpaced, the suite's model
    reached that step before they started."""
    monkeypatch.setenv("PHOENIXFT_TEST_PACE_S", "0.3")
    ref = reference(nodes=2, steps=12, workload="user_workload:workload")
    rep = run(tmp_path, nodes=2, spares=2, steps=12, inject=["sick:spare=0@step=6", "kill:node=1@step=9"],
              health_max_age=0.0, workload="user_workload:paced_workload")
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["promoted"] == ["s1"], rec
    health = {s["node"]: s for s in rep["health"]["spares"]}
    assert health["s0"]["phase"] == "promotion" and not health["s0"]["ok"], health  # it passed when it joined
    assert health["s1"]["phase"] == "promotion" and health["s1"]["ok"], health


@pytest.mark.slow
def test_a_background_recheck_finds_a_spare_fallen_sick_before_a_recovery(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """Idle spares re-checked every 0.3 s: s0 falls sick at step 4 and its next re-check says so, long before the
    kill at step 30, whose recovery promotes s1 on its fresh verdict; bitwise equal to the failure-free run."""
    ref = reference(nodes=2, steps=32)
    rep = run(tmp_path, nodes=2, spares=2, steps=32, health_recheck_every=0.3,
              inject=["sick:spare=0@step=4", "kill:node=1@step=30"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["promoted"] == ["s1"], rec
    health = {s["node"]: s for s in rep["health"]["spares"]}
    # (a spare that started late under load takes its first check once the job is past step 4: that join check is
    # then the one that finds it sick, still long before the kill; otherwise a background re-check does)
    assert health["s0"]["phase"] in ("recheck", "join") and not health["s0"]["ok"], health
    assert health["s0"]["reason"].startswith("matrix product: checksum"), health
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    sick = next(e["t"] for e in events if e["kind"] == "spare_unhealthy" and e["node"] == "s0")
    fault = next(e["t"] for e in events if e["kind"] == "fault" and e.get("fault") == "kill")
    assert sick < fault, "found sick only by the recovery"
    assert not [e for e in events if e["kind"] == "spares_passed_over"]  # (the recovery had nothing to pass over)


def test_failing_and_hanging_health_commands_leave_no_spare(tmp_path: Path) -> None:
    # spare s0's command fails, s1's outlives its timeout: no spare may be promoted, so the job shrinks
    cmd = 'case "$PHOENIXFT_HOST_ID" in */s0) echo no GPU; exit 3;; */s1) sleep 60;; esac'
    rep = run(tmp_path, nodes=2, spares=2, steps=8, health_check=cmd, health_check_timeout=1.0,
              inject=["kill:node=1@step=5,wait=3"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    assert rec["action"] == "shrink" and rec["promoted"] == [], rec
    health = {s["node"]: s for s in rep["health"]["spares"]}
    assert rep["health"]["unhealthy"] == ["s0", "s1"], health
    assert "exited 3: no GPU" in health["s0"]["reason"], health["s0"]
    assert "did not finish within --health-check-timeout=1s" in health["s1"]["reason"], health["s1"]


def test_a_host_that_failed_twice_is_dismissed_and_refused_when_repaired(tmp_path: Path) -> None:
    """n1's host is lost (failure 1); repaired (--repair-after), it comes back as spare s1, whose check fails
    (failure 2): the host is quarantined, s1 dismissed, and its next return refused. Both failures are injected,
    so --quarantine-injected counts them (the quarantine itself under test). (The corruption at rest holds
    step 12 for up to 8 s, as the job is never whole again: time for the host's second return; the replicas it
    corrupts are never used.)"""
    rep = run(tmp_path, nodes=2, spares=1, steps=30, repair_after=0.5, quarantine_injected=True,
              inject=["kill:node=1@step=3", "sick:spare=1", "corrupt:node=0@step=12,wait=8"])
    assert rep["state"] == "done", rep.get("error")
    host = f"{socket.gethostname()}/n1"
    assert rep["quarantine"]["quarantined"] == [host], rep["quarantine"]
    (h,) = [h for h in rep["quarantine"]["hosts"] if h["host"] == host]
    assert [f["node"] for f in h["failures"]] == ["n1", "s1"] and h["reason"] == "2 failures within 86400s", h
    assert rep["health"]["unhealthy"] == ["s1"]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["node"] for e in events if e["kind"] == "spare_dismissed"] == ["s1"]
    refused = [e for e in events if e["kind"] == "join_refused"]
    assert len(refused) == 1 and f"host {host} is quarantined" in refused[0]["reason"], refused
    lines = "\n".join(format_lines(rep))  # what `phoenixft status` prints of it
    assert f"host {host}: QUARANTINED, 2 failure(s)" in lines and f"quarantined hosts: {host}" in lines, lines




def test_injected_faults_are_never_held_against_a_host_and_a_real_lemon_is_quarantined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose nodes die by themselves (tests/user_workload.py: lemon_workload, no --inject) is quarantined
    after its second failure; a host that only an --inject kill struck is not, and its repaired node returns.
    n1 (the lemon's host) dies at step 3 (real failure 1), s0 takes its slot, n1's host comes back repaired as
    s1; the injected kill at step 8 strikes s0 (listed for s0's host, not counted), s1 is promoted and dies at
    once (real failure 2): the lemon's host is quarantined and its next return refused, while s0's host
    comes back as s2 and the run trains to its end. (The corruption at rest holds step 13 for up to 8 s, as
    the job is never whole again: time for both returns; the replicas it corrupts are never used.)"""
    host = f"{socket.gethostname()}/n1"
    monkeypatch.setenv("PHOENIXFT_TEST_LEMON_HOST", host)
    rep = run(tmp_path, nodes=2, spares=1, steps=16, repair_after=0.5, workload="user_workload:lemon_workload",
              inject=["kill:node=1@step=8", "corrupt:node=0@step=13,wait=8"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["faults_not_fired"] == [], rep["faults_not_fired"]
    hosts = {h["host"]: h for h in rep["quarantine"]["hosts"]}
    assert rep["quarantine"]["quarantined"] == [host], rep["quarantine"]
    assert [(f["node"], f.get("injected")) for f in hosts[host]["failures"]] == [("n1", None), ("s1", None)], hosts
    s0 = hosts[f"{socket.gethostname()}/s0"]
    assert not s0["quarantined"] and [(f["node"], f.get("injected")) for f in s0["failures"]] == \
        [("s0", "kill:node=1@step=8,wait=60")], s0
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    refused = [e for e in events if e["kind"] == "join_refused"]
    assert refused and all(f"host {host} is quarantined" in e["reason"] for e in refused), refused
    repaired = {e["node"]: e["replaces"] for e in events if e["kind"] == "spare_repaired"}
    promoted = [n for r in rep["recoveries"] for n in r["promoted"]]
    assert repaired.get("s2") == "s0" and "s2" in promoted, (repaired, rep["recoveries"])
    lines = "\n".join(format_lines(rep))
    assert f"host {host}: QUARANTINED, 2 failure(s)" in lines, lines
    assert f"host {socket.gethostname()}/s0: not quarantined, 1 failure(s), 1 of them injected (not counted)" in lines


LAUNCH = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from phoenixft.cli.main import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.slow
def test_a_host_that_failed_twice_is_quarantined_across_a_coordinator_restart(tmp_path: Path) -> None:
    """n1's host is lost (failure 1); repaired, it comes back as spare s1, whose check fails (failure 2): it
    is quarantined, s1 dismissed, and its next return (s2) refused. `phoenixft status` shows it; the
    coordinator is then killed, and the restarted one refuses that host too (an agent started by hand)."""
    run_dir, log = tmp_path / "live", tmp_path / "launcher.log"
    cmd = [sys.executable, "-c", LAUNCH, "run", "--nodes", "2", "--spares", "1", "--steps", "2000", "--repair-after",
           "1", "--inject", "kill:node=1@step=3,wait=60", "--inject", "sick:spare=1", "--quarantine-injected",
           "--run-dir", str(run_dir), "--quiet"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    needles = [str(run_dir)]
    try:
        port_file = run_dir / "coordinator.port"
        wait_while_running("coordinator.port", lambda: port_file.exists() and port_file.read_text().strip(), proc, 90)
        addr = f"127.0.0.1:{port_file.read_text().strip()}"
        needles.append(addr)
        store = connect(addr, 5.0)

        def refused() -> Any:
            st = collect_status(store, events=100)
            return st["quarantine"]["quarantined"] and any(
                e["kind"] == "join_refused" and "quarantined" in e.get("reason", "") for e in st["events"]) and st

        st = wait_while_running("the repaired host refused", refused, proc, 150)
        host = f"{socket.gethostname()}/n1"
        assert st["quarantine"]["quarantined"] == [host], st["quarantine"]
        text = format_status(st, addr)
        assert f"host {host}: QUARANTINED, 2 failure(s)" in text and "quarantined hosts: " in text, text
        assert re.search(r"s1 UNHEALTHY \(join check\): matrix product", text), text
        kinds = [e["kind"] for e in st["events"]]
        assert "spare_dismissed" in kinds and "host_quarantined" in kinds

        # the coordinator dies; the launcher restarts it; the history is the store's, not the process's
        pid = int(sealed.peel(store.get(keys.COORDINATOR_PID)) or 0)
        os.kill(pid, signal.SIGKILL)
        wait_while_running("the coordinator restarted", lambda: any(
            e["kind"] == "coordinator_restarted" for e in collect_status(store, events=200)["events"]), proc, 60)
        agent = subprocess.run(
            [sys.executable, "-m", "phoenixft", "agent", "--coordinator", addr, "--node", "back-again", "--spare",
             "--token-file", str(run_dir / "token"), "--join-timeout", "60"],
            env=dict(os.environ, PHOENIXFT_HOST_ID=host), capture_output=True, text=True, timeout=120)
        assert agent.returncode == 2 and f"host {host} is quarantined" in agent.stderr, agent.stderr
        assert collect_status(store)["quarantine"]["quarantined"] == [host]

        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        report = json.loads((run_dir / "report.json").read_text())
        assert report["quarantine"]["quarantined"] == [host] and report["health"]["unhealthy"] == ["s1"]
        gone_by = time.monotonic() + 15
        while any(processes_with(n) for n in needles) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not any(processes_with(n) for n in needles), "processes of the run outlived it"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in sorted({p for n in needles for p in processes_with(n)}):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
