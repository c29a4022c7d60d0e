"""The etcd backend of the control plane: what only it has (fork-safe clients, leases, leader election,
failover between members) and whole runs that lose their leading coordinator, a node and an etcd
member (real processes, real SIGKILLs). What both backends share is tests/test_store_contract.py.

Needs the `etcd` binary (Debian: etcd-server; `.ci/run` installs it). Without it these tests skip,
except on CI (CI=true), where a missing etcd is a failure."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS, on_pythonpath, processes_with, run

from phoenixft.controlplane import (
    Election,
    EtcdUnavailable,
    Heartbeat,
    connect,
    get_nowait,
    guarded_set,
    sealed,
    validate_spec,
)
from phoenixft.controlplane.etcd_cluster import EtcdCluster, etcd_binary
from phoenixft.errors import UserError

if etcd_binary() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI: no etcd binary (apt-get install etcd-server): the etcd control plane is untested")
    pytest.skip("no etcd binary (apt-get install etcd-server)", allow_module_level=True)

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    c = EtcdCluster(3, tag="pytest")
    c.start()
    try:
        yield c
    finally:
        c.stop()
    assert not c.dir.exists(), "the cluster's data directory outlived it"


def test_etcd_client_survives_fork(cluster: EtcdCluster) -> None:
    """A client used before fork() works in the child and, after, in the parent (agents fork workers)."""
    import torch.distributed as dist

    s = connect(f"{cluster.url}/fork/{uuid.uuid4().hex[:8]}", timeout_s=10.0)
    key = f"f{uuid.uuid4().hex[:8]}"
    s.set(key, "parent")
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = s.get(key) == b"parent"
            s.set(key + "c", "child")
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s.get(key + "c") == b"child" and s.get(key) == b"parent"
    assert isinstance(s, dist.Store)


# ---------------------------------------------------------------------- etcd only: leases, election, failover
def test_heartbeat_lease_expires_with_its_writer(cluster: EtcdCluster) -> None:
    s = connect(f"{cluster.url}/hb/{uuid.uuid4().hex[:8]}", 10.0)
    hb = Heartbeat(s, "hb/n0", ttl_s=2)
    for _ in range(4):
        hb.beat(str(time.time()))
        time.sleep(0.5)
    assert s.check(["hb/n0"])  # kept alive by the beats (longer than its TTL)
    deadline = time.monotonic() + 6.0
    while s.check(["hb/n0"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not s.check(["hb/n0"]), "the heartbeat key outlived its silent writer's lease"


def test_election_one_leader_and_fenced_writes(cluster: EtcdCluster) -> None:
    url = f"{cluster.url}/el/{uuid.uuid4().hex[:8]}"
    a, b = connect(url, 10.0), connect(url, 10.0)
    ea, eb = Election(a, "A", ttl_s=2), Election(b, "B", ttl_s=2)
    assert ea.campaign(timeout_s=5.0)
    assert not eb.campaign(timeout_s=0.5)  # A leads: B stands by
    assert eb.leader() == "A"
    assert guarded_set(a, ea, ["topo"], ["from A"]) and a.get("topo") == b"from A"
    assert not guarded_set(b, eb, ["topo"], ["from B"]) and a.get("topo") == b"from A"
    ea.resign()
    assert eb.campaign(timeout_s=5.0) and eb.leader() == "B"
    assert not guarded_set(a, ea, ["topo"], ["stale A"]), "a deposed leader's write went through"
    assert b.get("topo") == b"from A"
    eb.resign()


_CAMPAIGN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from phoenixft.controlplane import Election, connect
    s = connect(sys.argv[1], 10.0)
    e = Election(s, sys.argv[2], ttl_s=2, on_lost=lambda: print("LOST", flush=True))
    while not e.campaign(timeout_s=1.0):
        pass
    print("LEADER", sys.argv[2], flush=True)
    time.sleep(120)
""")


def test_standby_takes_over_when_the_leader_is_killed(cluster: EtcdCluster, tmp_path: Path) -> None:
    url = f"{cluster.url}/el/{uuid.uuid4().hex[:8]}"
    script = tmp_path / "campaign.py"
    script.write_text(_CAMPAIGN.format(src=SRC))
    procs = {n: subprocess.Popen([sys.executable, str(script), url, n], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True) for n in ("P", "Q")}
    try:
        s = connect(url, 10.0)
        deadline = time.monotonic() + 30
        while get_nowait(s, "coordinator/leader") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        leader = (get_nowait(s, "coordinator/leader") or b"").decode()
        assert leader in procs
        other = "Q" if leader == "P" else "P"
        t_kill = time.monotonic()
        os.killpg(procs[leader].pid, signal.SIGKILL)
        while get_nowait(s, "coordinator/leader") != other.encode() and time.monotonic() < t_kill + 15:
            time.sleep(0.02)
        took = time.monotonic() - t_kill
        assert get_nowait(s, "coordinator/leader") == other.encode(), "the standby never took over"
        assert took < 5.0, f"takeover took {took:.1f}s (lease TTL 2s)"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_a_standby_campaign_outlives_a_lost_quorum() -> None:
    """A standby's campaign while etcd has no quorum (2 of 3 members killed for a while, longer than a
    call's 2 s) is no error: it returns False at its own deadline, and wins once the cluster is back
    and the leader is gone."""
    with EtcdCluster(3, tag="pytest-campaign") as c:
        url = f"{c.url}/el/{uuid.uuid4().hex[:8]}"
        ea, eb = Election(connect(url, 10.0), "A", ttl_s=2), Election(connect(url, 10.0), "B", ttl_s=2)
        assert ea.campaign(timeout_s=5.0)
        assert not eb.campaign(timeout_s=0.5)
        down = [c.leader_index()]
        down.append((down[0] + 1) % 3)
        for i in down:
            c.kill(i)
        t = time.monotonic()
        assert not eb.campaign(timeout_s=3.0)  # no quorum: nobody can lead, and standing by goes on
        assert not eb.campaign(timeout_s=1.0)
        assert time.monotonic() - t < 8.0
        for i in down:
            c.restart(i)
        ea.resign()
        assert eb.campaign(timeout_s=20.0) and eb.leader() == "B"
        eb.resign()


def test_client_fails_over_when_a_member_dies() -> None:
    with EtcdCluster(3, tag="pytest-failover") as c:
        s = connect(f"{c.url}/fo", 15.0)
        s.set("k", "before")
        victim = c.leader_index()
        c.kill(victim)
        t = time.monotonic()
        for i in range(20):  # writes keep working on the two members left (a new raft leader is elected)
            s.set(f"k{i}", str(i))
        assert s.get("k") == b"before" and s.get("k19") == b"19"
        assert time.monotonic() - t < 10.0
        c.restart(victim)  # the member rejoins on its old data
        c.kill((victim + 1) % 3)
        assert s.get("k5") == b"5"
        c.kill((victim + 2) % 3)  # no quorum left: a bounded error, naming the cluster
        s2 = connect(f"{c.url}/fo", 2.0)
        t = time.monotonic()
        with pytest.raises((EtcdUnavailable, TimeoutError)):
            s2.set("k", "no quorum")
        assert time.monotonic() - t < 6.0


def test_control_plane_flag_validation() -> None:
    from phoenixft.config import RunConfig

    assert validate_spec("tcpstore") is None and validate_spec("etcd") is None
    assert validate_spec("etcd://127.0.0.1:2379,10.0.0.2:2379/jobs") is None
    assert "HOST:PORT" in (validate_spec("etcd://127.0.0.1") or "")
    assert "tcpstore" in (validate_spec("zookeeper://x:1") or "")
    with pytest.raises(UserError, match="--control-plane"):
        RunConfig(control_plane="etcd://nohost").validate()
    with pytest.raises(UserError, match="--coordinators.*etcd"):
        RunConfig(coordinators=2).validate()
    with pytest.raises(UserError, match="--inject.*--control-plane etcd"):
        RunConfig(control_plane="etcd://127.0.0.1:2379", inject=["kill:etcd=0@step=2"]).validate()
    with pytest.raises(UserError, match="members 0, 1, 2"):
        RunConfig(control_plane="etcd", inject=["kill:etcd=5@step=2"]).validate()
    with pytest.raises(UserError, match="kill:etcd=I@step=S"):
        RunConfig(control_plane="etcd", inject=["kill:etcd=1@step=2,phase=backward"]).validate()
    from phoenixft.runtime.launcher import check_mode

    with pytest.raises(UserError, match="--control-plane=etcd is invalid here.*etcd://"):
        check_mode(RunConfig(control_plane="etcd"), local=False)


def test_unreachable_etcd_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong --control-plane address: one line naming the flag, exit code 2, within the probe's bound.
    `phoenixft run`'s own entry point, in this process, with the probe's bound made 1 s (its default,
    CLUSTER_PROBE_S, is 10 s: the same path, waited out for longer)."""
    import functools

    from phoenixft.cli.main import main
    from phoenixft.controlplane.address import provision_cluster
    from phoenixft.runtime import localjob

    monkeypatch.setattr(localjob, "provision_cluster", functools.partial(provision_cluster, probe_s=1.0))
    t = time.monotonic()
    rc = main(["run", "--control-plane", "etcd://127.0.0.1:1", "--steps", "2", "--quiet",
               "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "--control-plane=etcd://127.0.0.1:1: no etcd cluster answered there within 1s" in err, err
    assert "Traceback" not in err and time.monotonic() - t < 30


# ---------------------------------------------------------------------- whole runs
@pytest.mark.slow  # (see README, Tests: covered in `make test` by a broader run)
def test_standby_coordinator_takes_over_then_a_node_is_hot_swapped(cluster: EtcdCluster, tmp_path: Path,
                                                                  reference: Any) -> None:
    """A standby takeover mid-run: the leading coordinator is SIGKILLed at step 6, a node at step 11; a standby
    leads from etcd's state, the node is hot-swapped, and the run ends bitwise equal to a
    failure-free one. Nothing of the job is left in etcd."""
    ref = reference(nodes=4, steps=16)
    rep = run(tmp_path, nodes=4, spares=1, steps=16, control_plane=cluster.url, coordinators=2,
              inject=["kill:coordinator@step=6", "kill:node=2@step=11"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    (cp,) = rep["control_plane"]
    assert cp["new_leader"], cp  # a standby took over (not a restart of the killed one)
    assert cp["downtime_s"] is not None and cp["downtime_s"] < 10.0, cp
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["promoted"] == ["s0"] and rec["lost_steps"] <= 1
    assert all(rec["invariants"].values())
    assert connect(f"{cluster.url}/phoenixft/{rep['run_id']}", 5.0).num_keys() == 0, "the job's keys outlived it"


@pytest.mark.slow  # (see README, Tests: covered in `make test` by a broader run)
def test_etcd_member_killed_mid_run_is_not_noticed(tmp_path: Path, reference: Any) -> None:
    """`--control-plane etcd` starts a local 3-member cluster; its raft leader is SIGKILLed at step 5:
    no recovery, no lost step, the same final state; the cluster is gone after the run."""
    ref = reference(nodes=4, steps=16)
    rep = run(tmp_path, nodes=4, spares=1, steps=16, control_plane="etcd", coordinators=2,
              inject=["kill:etcd=leader@step=5"])
    assert rep["state"] == "done", rep.get("error")
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    assert rep["recoveries"] == [] and rep["steps_completed"] == 16
    (cp,) = rep["control_plane"]
    assert "raft leader" in cp["member"]
    assert processes_with(f"phoenixft-etcd-{rep['run_id']}") == [], "etcd members outlived the run"
    assert sorted(Path("/tmp").glob(f"phoenixft-etcd-{rep['run_id']}-*")) == []


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.1)


def test_the_head_host_is_lost_and_the_job_goes_on(cluster: EtcdCluster, tmp_path: Path, reference: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-host shape on loopback: a head (`phoenixft coordinator --control-plane etcd://...`), a
    standby coordinator started by hand elsewhere (`--standby URL`), two nodes and a spare joined
    with `phoenixft agent`. The head's whole process group (launcher, its coordinator) is SIGKILLed
    mid-run: the standby leads from etcd; a node fault at step 25 that waits for the job to be whole
    fires once the new leader says so; the new leader hot-swaps the node and the run ends with the
    failure-free hash."""
    from phoenixft.controlplane.auth import TOKEN_ENV, generate_token

    monkeypatch.syspath_prepend(TESTS)  # (the reference runs in this process: it imports user_workload too)
    on_pythonpath(TESTS, monkeypatch)
    ref = reference(nodes=2, steps=40, workload="user_workload:workload")
    # tests/user_workload.py's paced workload: `workload`'s arithmetic, each step 0.1 s longer asleep (the run
    # must outlast the head's loss and the takeover; training flat out would burn the CPU the suite needs)
    env = dict(os.environ, **{TOKEN_ENV: generate_token()}, PYTHONPATH=os.pathsep.join([SRC, TESTS]),
               PHOENIXFT_TEST_PACE_S="0.1")
    exe = [sys.executable, "-m", "phoenixft"]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen([*exe, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.DEVNULL, start_new_session=True)

    url = ""
    try:
        start("head", "coordinator", "--host", "127.0.0.1", "--port", "0", "--control-plane", cluster.url,
              "--nodes", "2", "--spares", "0", "--steps", "40", "--workload", "user_workload:paced_workload",
              "--failure-timeout", "5", *SUITE_FLAGS, "--inject", "kill:node=1@step=25,wait=90",
              "--run-dir", str(tmp_path / "run"), "--quiet")
        _wait_for(lambda: (tmp_path / "run" / "control_plane").exists(), 60, "the head to publish its URL")
        url = (tmp_path / "run" / "control_plane").read_text().strip()
        s = connect(url, 10.0)
        # the head's coordinator leads first (else the standby would lead and the head's loss be trivial)
        _wait_for(lambda: get_nowait(s, "coordinator/leader") is not None, 60, "the head's coordinator to lead")
        start("standby", "coordinator", "--standby", url)
        for name, extra in (("a", ()), ("b", ()), ("spare", ("--spare",))):
            start(name, "agent", "--coordinator", url, "--node", name, "--workers", "1", *extra)
        _wait_for(lambda: int(sealed.peel(get_nowait(s, "progress")) or 0) >= 3, 120, "step 3")
        first_leader = get_nowait(s, "coordinator/leader")
        old_pid = int(sealed.peel(get_nowait(s, "coordinator/pid")) or 0)
        assert int(sealed.peel(get_nowait(s, "progress")) or 0) < 20, "too late: the fault may have fired before the " \
            "head died"
        os.killpg(procs["head"].pid, signal.SIGKILL)  # the head host's launcher (its coordinator dies with it)
        procs["head"].wait(timeout=10)
        _wait_for(lambda: not Path(f"/proc/{old_pid}").exists(), 10, "the head's coordinator to die")
        # the node fault at step 25 waits (,wait=90) until the job is whole: only a new leader says so now
        s.delete_key("job/whole")
        _wait_for(lambda: get_nowait(s, "coordinator/leader") not in (None, first_leader), 30,
                  "the standby to take over")
        st = subprocess.run([*exe, "status", "--coordinator", url, "--json"], capture_output=True, env=env,
                            timeout=60)  # anyone can still look at the job, through etcd
        assert st.returncode == 0, st.stderr.decode()
        assert '"epoch": ' in st.stdout.decode()
        _wait_for(lambda: get_nowait(s, "run/state") is not None, 180, "the end of the run")
        assert get_nowait(s, "run/state") == b"done", get_nowait(s, "run/error")
        import json

        final = json.loads(s.get("final"))
        assert final["sha256"] == ref["final_state_sha256"]
        assert final["epoch"] == 1  # one recovery: the hot-swap the standby decided
        rec = json.loads(sealed.peel(s.get("recovery/1")) or b"")
        members = json.loads(sealed.peel(s.get("members")) or b"")
        b_id = next(n for n, m in members.items() if m["name"] == "b")
        assert rec["action"] == "hotswap" and rec["promoted"] == ["s0"] and rec["dead"] == ["n1"]
        b_slot_agent = "b" if b_id == "n1" else "a"  # the fault killed slot 1
        for name in ({"a", "b"} - {b_slot_agent}) | {"spare", "standby"}:
            procs[name].wait(timeout=60)  # everything else ends with the run
            assert procs[name].returncode == 0, (name, (tmp_path / f"{name}.log").read_text()[-2000:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        if url:
            connect(url, 5.0).delete_prefix()


# ---------------------------------------------------------------------- a standby's token, etcd failures under a job
class _Procs:
    """The `phoenixft` processes of a multi-host job on loopback (each in its own session, logged to
    tmp/NAME.log); `close()` kills whatever is still running, by process group."""

    def __init__(self, tmp: Path, token: str) -> None:
        from phoenixft.controlplane.auth import TOKEN_ENV

        self.tmp, self.procs = tmp, {}  # type: dict[str, subprocess.Popen[bytes]]
        # the head trains tests/user_workload.py's paced workload: each step 0.1 s longer asleep (these runs
        # must last while etcd members, heads and keys are taken away; flat out they burn the suite's CPU)
        self.env = dict(os.environ, **{TOKEN_ENV: token}, PYTHONPATH=os.pathsep.join([SRC, TESTS]),
                        PHOENIXFT_TEST_PACE_S="0.1")

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "phoenixft", *args], stdout=log,
                                                stderr=subprocess.STDOUT, env=env or self.env,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def head(self, cluster_url: str, steps: int, *extra: str, agents: bool = False) -> tuple[str, Any]:
        """Start the head on `cluster_url`; its job URL and a client, once its coordinator leads. With `agents`,
        the agents are started as soon as the URL is known (they start up while the head's coordinator does)."""
        self.start("head", "coordinator", "--host", "127.0.0.1", "--port", "0", "--control-plane", cluster_url,
                   "--nodes", "2", "--spares", "0", "--steps", str(steps), "--workload",
                   "user_workload:paced_workload", *SUITE_FLAGS, "--run-dir", str(self.tmp / "run"), "--quiet", *extra)
        _wait_for(lambda: (self.tmp / "run" / "control_plane").exists(), 60, "the head to publish its URL")
        url = (self.tmp / "run" / "control_plane").read_text().strip()
        if agents:
            self.agents(url)
        s = connect(url, 10.0)
        _wait_for(lambda: get_nowait(s, "coordinator/leader") is not None, 60, "the head's coordinator to lead")
        return url, s

    def agents(self, url: str) -> None:
        for name in ("a", "b"):
            self.start(name, "agent", "--coordinator", url, "--node", name, "--workers", "1")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_a_standby_with_another_token_is_refused(cluster: EtcdCluster, tmp_path: Path) -> None:
    """A standby whose token is not the job's would lead with topologies no worker accepts: it is
    refused at start (one line, exit 2), on the config the head signed; the right token stands by."""
    from phoenixft.controlplane.auth import TOKEN_ENV, generate_token

    jp = _Procs(tmp_path, generate_token())
    url = ""
    try:
        url, s = jp.head(cluster.url, 8, "--join-timeout", "120")
        t = time.monotonic()
        wrong = jp.start("wrong", "coordinator", "--standby", url,
                         env=dict(jp.env, **{TOKEN_ENV: generate_token()}))
        good = jp.start("good", "coordinator", "--standby", url)  # (both start up at once; the head leads on)
        try:
            rc = wrong.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a standby with a wrong token was not refused: {jp.log('wrong')[-1000:]}") from None
        out = jp.log("wrong").strip()
        assert rc == 2, (rc, out)
        assert len(out.splitlines()) == 1 and "not this job's token" in out and "Traceback" not in out, out
        assert "standing by" not in out and time.monotonic() - t < 60
        assert get_nowait(s, "coordinator/leader") is not None  # the head's coordinator still leads
        assert get_nowait(s, "config/sig"), "the head did not sign the config"
        _wait_for(lambda: "standing by" in jp.log("good"), 60, "the standby with the job's token to stand by")
        assert good.poll() is None, jp.log("good")
        jp.procs["head"].send_signal(signal.SIGTERM)  # the head tears the job down; the standby ends with it
        assert jp.procs["head"].wait(timeout=60) != 0
        assert good.wait(timeout=60) == 0, jp.log("good")  # it never led: the run's end is not its failure
    finally:
        jp.close()
        if url:
            connect(url, 5.0).delete_prefix()


@pytest.mark.slow  # (suite time; the campaign's retries: test_a_standby_campaign_outlives_a_lost_quorum)
def test_the_standby_outlives_raft_leader_kills(tmp_path: Path) -> None:
    """The etcd raft leader is SIGKILLed twice (restarted in between) while a standby coordinator
    stands by: the standby keeps standing by (its calls fail over to the members left and retry), the
    run completes, and every process ends with rc 0."""
    from phoenixft.controlplane.auth import generate_token

    steps = 200  # (at least 0.1 s a step, paced, and the kills stall it: the run must outlive them, ~12 s)
    jp = _Procs(tmp_path, generate_token())
    with EtcdCluster(3, tag="pytest-standby") as c:
        try:
            url, s = jp.head(c.url, steps)
            standby = jp.start("standby", "coordinator", "--standby", url)
            _wait_for(lambda: "standing by" in jp.log("standby"), 60, "the standby to stand by")
            jp.agents(url)
            _wait_for(lambda: int(sealed.peel(get_nowait(s, "progress")) or 0) >= 2, 120, "step 2")
            for _ in range(2):
                victim = c.leader_index()
                c.kill(victim)
                time.sleep(4.0)  # the members left elect a leader; the standby's lease calls wait for it
                assert get_nowait(s, "run/state") is None, "the run ended before the kills: make it longer"
                assert standby.poll() is None, f"the standby died: {jp.log('standby')[-2000:]}"
                c.restart(victim)
            # (the head removes the job's keys from etcd at its end: its report says how the run went)
            assert jp.procs["head"].wait(timeout=240) == 0, jp.log("head")[-3000:]
            import json

            rep = json.loads((tmp_path / "run" / "report.json").read_text())
            assert rep["state"] == "done" and rep["steps_completed"] == steps, rep["state"]
            for name in ("standby", "a", "b"):
                assert jp.procs[name].wait(timeout=60) == 0, (name, jp.log(name)[-2000:])
            assert "Traceback" not in jp.log("standby")
        finally:
            jp.close()


@pytest.mark.slow  # (suite time: it waits out the 15 s control-plane timeout; `make test-all` runs it)
def test_quorum_lost_mid_run_fails_the_head_in_one_line(tmp_path: Path) -> None:
    """2 of 3 etcd members SIGKILLed mid-run: the head says in one line that the control plane is lost,
    exits non-zero within a bound, and writes report.json (state failed) and events.jsonl from what it
    had seen; the agents stop by themselves; nothing of the run is left running."""
    import json

    from phoenixft.controlplane.auth import generate_token

    jp = _Procs(tmp_path, generate_token())
    with EtcdCluster(3, tag="pytest-quorum") as c:
        try:
            url, s = jp.head(c.url, 400)
            jp.agents(url)
            _wait_for(lambda: int(sealed.peel(get_nowait(s, "progress")) or 0) >= 2, 120, "step 2")
            run_id = s.get("run/id").decode()
            t = time.monotonic()
            c.kill(c.leader_index())
            c.kill(next(i for i in range(3) if c.procs[i] is not None and c.procs[i].poll() is None))
            try:
                rc = jp.procs["head"].wait(timeout=75)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the head did not end within 75s of losing etcd's quorum: "
                                     f"{jp.log('head')[-2000:]}") from None
            took = time.monotonic() - t
            out = jp.log("head")
            assert rc != 0 and took < 75, (rc, took)
            assert "Traceback" not in out, out[-3000:]
            lost = [ln for ln in out.splitlines() if "control plane lost" in ln]
            assert len(lost) == 1, out[-3000:]
            rep = json.loads((tmp_path / "run" / "report.json").read_text())
            assert rep["state"].startswith("failed: control plane lost"), rep["state"]
            assert rep["run_id"] == run_id and "control plane lost" in rep["error"]
            assert (tmp_path / "run" / "events.jsonl").read_text().strip(), "no events written"
            for name in ("a", "b"):  # the agents stop their nodes after --control-plane-timeout (15 s)
                assert jp.procs[name].wait(timeout=60) != 0
            _wait_for(lambda: processes_with(run_id) == [], 20, "every process of the run to end")
            assert sorted(Path("/dev/shm").glob(f"phoenixft-{run_id}[-.]*")) == [], "shared memory outlived the run"
        finally:
            jp.close()


def test_a_head_cut_off_from_etcd_leaves_the_job_to_the_standby(cluster: EtcdCluster, tmp_path: Path) -> None:
    """The head's launcher lost etcd (its host cut off for 15 s) while a standby coordinator on another
    host took over and carried the job on. When etcd answers again, the head's teardown must neither
    announce the run's end nor remove the job's keys: it did both, and so ended a job that had survived
    the loss of its head's host (measured in network namespaces: the head's link down for 18 s, the
    standby trained on to step 146, then the head came back and deleted the prefix; both agents' workers
    crashed). A job still led by a coordinator the head started itself is ended as before."""
    import socket

    from phoenixft.config import RunConfig
    from phoenixft.controlplane import LEADER_KEY, keys
    from phoenixft.runtime.launcher import LocalJob

    def cut_off_head(leader: str, pids: list[int]) -> tuple[LocalJob, Any]:
        cfg = RunConfig(nodes=2, steps=4, control_plane=cluster.url, quiet=True,
                        run_dir=str(tmp_path / f"run-{len(pids)}"))
        job = LocalJob(cfg, local=False)
        job.store = connect(f"{cluster.url}/phoenixft/{job.run_id}", 5.0)
        job.store.multi_set([keys.CONFIG, keys.MEMBERS, LEADER_KEY],  # (the job's members: sealed, as it writes them)
                            ["{}", sealed.seal(keys.MEMBERS, '{"n0": {}}'), leader])
        job._coord_pids = pids
        job.control_plane_lost = "etcd at URL did not answer for 15s (last: Network is unreachable)"
        return job, connect(f"{cluster.url}/phoenixft/{job.run_id}", 5.0)

    job, s = cut_off_head("standby-host:4242:1", [])
    t = time.monotonic()
    job.teardown()
    assert time.monotonic() - t < 5.0, "it waited for agents that go on with the job"
    assert job.handed_over == "standby-host:4242:1"
    # (linearizable reads: a serializable one from another member may not see the writes above yet)
    assert s.exists_many([keys.RUN_STATE, keys.CONFIG]) == [False, True], \
        "the head announced the end of, or removed the keys of, a job a standby leads"
    assert bytes(s.get(keys.CONFIG)) == b"{}"
    s.delete_prefix()
    # its own coordinator leads (it dies with the head): the job ends with the head, its keys removed
    mine, s = cut_off_head(f"{socket.gethostname()}:{os.getpid()}:1", [os.getpid()])
    sealed.put(mine.store, keys.left("n0"), "0")
    mine.teardown()
    assert mine.handed_over is None and s.num_keys() == 0


def test_agents_stop_when_the_jobs_keys_are_gone(cluster: EtcdCluster, tmp_path: Path) -> None:
    """The job's keys removed from etcd under running agents (its head ended the run and removed them
    while an agent had not seen the end, e.g. one cut off meanwhile): each agent stops its node at once,
    in one line, instead of going on for minutes, their workers crashing and being restarted in place
    (a traceback each: `wait timeout: key 'config' not set within 30s`) until the crash loop gives up."""
    from phoenixft.controlplane.auth import generate_token

    jp = _Procs(tmp_path, generate_token())
    url = ""
    try:
        url, s = jp.head(cluster.url, 5000, agents=True)
        _wait_for(lambda: int(sealed.peel(get_nowait(s, "progress")) or 0) >= 2, 120, "step 2")
        os.killpg(jp.procs["head"].pid, signal.SIGKILL)  # (no head left to end the run properly)
        jp.procs["head"].wait(timeout=10)
        s.delete_prefix()
        t = time.monotonic()
        for name in ("a", "b"):
            try:
                rc = jp.procs[name].wait(timeout=max(1.0, 20.0 - (time.monotonic() - t)))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {name} runs on without its job: {jp.log(name)[-1500:]}") from None
            assert rc == 1 and "the job's keys are gone" in jp.log(name), (rc, jp.log(name)[-1500:])
    finally:
        jp.close()
        if url:
            connect(url, 5.0).delete_prefix()
