"""phoenixft under a real Slurm (tests/slurmcluster.py: slurmctld, one slurmd per test host, munge), submitted with
the batch script users submit, examples/slurm/phoenixft.sbatch: 2 active nodes and 1 spare in one allocation.

Failures as Slurm delivers them: a node's step SIGKILLed, a node set DOWN with `scontrol` (hot-swap to the spare,
the final state bitwise equal to the failure-free run); a node's notice (its step signalled SIGUSR1: a planned
drain onto the spare, 0 steps lost); the job's notice (`--signal=B:USR1@T`, delivered as Slurm does, to the
batch script: the job stops at a step boundary with that step saved, exits 75, the script requeues it and the
requeued job resumes from the persistent tier, bitwise equal to the failure-free run); the job ended with no
notice (SIGTERM to every process: `scancel`, the time limit, a requeue by the scheduler): the same stop, within
KillWait, exit 75, and a resumed job (resubmitted, or requeued) goes on from the step saved; a job refused at
start (exit 2) and one that cannot continue (exit 1): failed, never requeued. The tests whose job ends by itself
also check that no process is left in the node hosts but slurmd, and no memory of the run in their /dev/shm (each
host has its own) but a SIGKILLed node's. The `slurm` marker: `make test` runs the ones not also marked `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slurmcluster import SlurmCluster, unavailable

from phoenixft.protect import shm

if unavailable() is not None:
    if os.environ.get("CI") and shutil.which("ip") is not None and os.geteuid() == 0:
        raise RuntimeError(f"CI: {unavailable()}: phoenixft under Slurm is untested")
    pytest.skip(str(unavailable()), allow_module_level=True)

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "phoenixft.sbatch"
NODES = ("node1", "node2", "node3")  # 2 active + the spare (PHOENIXFT_SPARES=1, the script's default)
MICRO = "4"  # microbatches per step: with the paced workload a step lasts 4 x PACE_S at least
PACE_S = "0.05"
JOB_S = 240.0  # at most this long for a job (a requeued one: both attempts)
STEPS = 16  # every job's (one failure-free reference run for the file)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=NODES) as c:
        yield c
    assert c.leftovers() == [], "the Slurm cluster outlived its tests"


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster, every node idle before the test and every job of the test cancelled after it."""
    cluster.cmd("scontrol", "update", f"nodename={','.join(NODES)}", "state=resume", check=False)
    cluster._wait("every node idle", lambda: all(s == "idle" for s in cluster.node_states().values()))
    yield cluster
    cluster.cmd("scancel", "--user=root", check=False)


def _submit(c: SlurmCluster, tmp: Path, steps: int, *flags: str, sbatch_args: tuple[str, ...] = (),
            **env: str) -> tuple[int, float]:
    """Submit the users' batch script (3 nodes: 2 active, 1 spare) with the suite's model and the paced workload
    (`sbatch_args`: sbatch's own options, over the script's #SBATCH lines); (job id, when)."""
    e = {**c.env, "PHOENIXFT": str(Path(sys.executable).parent / "phoenixft"), "PHOENIXFT_DIR": str(tmp / "jobs"),
         "PHOENIXFT_TEST_PACE_S": PACE_S,
         "PYTHONPATH": os.pathsep.join(q for q in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if q), **env}
    t = time.time()
    job = c.sbatch(f"--nodes={len(NODES)}", f"--output={tmp / 'job.out'}", *sbatch_args, str(SBATCH), "--steps",
                   str(steps),
                   "--model", "nano", "--micro-batch", "2", "--microbatches", MICRO,
                   "--workload", "user_workload:paced_workload", "--failure-timeout", "3", *flags, env=e)
    return job, t


def _ref(reference: Any, steps: int) -> dict[str, Any]:
    return reference(nodes=2, steps=steps, microbatches=int(MICRO), workload="user_workload:workload")


def _run_dir(tmp: Path, job: int, attempt: int = 0) -> Path:
    return tmp / "jobs" / str(job) / f"run.{attempt}"


def _metrics(run: Path) -> list[dict[str, Any]]:
    f = run / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # (a line being written)
            pass
    return out


def _wait_step(c: SlurmCluster, tmp: Path, job: int, step: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """The metrics record of `step` once the job trained it (fails with the job's output otherwise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [m for m in _metrics(_run_dir(tmp, job)) if m.get("step", 0) >= step]
        if got:
            return got[0]
        if c.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.05)
    pytest.fail(f"job {job} did not reach step {step} (state {c.job(job).get('JobState')}):\n{_out(tmp)}")


def _out(tmp: Path) -> str:
    f = tmp / "job.out"
    return f.read_text(errors="replace")[-4000:] if f.is_file() else "(no output)"


def _report(tmp: Path, job: int, attempt: int = 0) -> dict[str, Any]:
    f = _run_dir(tmp, job, attempt) / "report.json"
    assert f.is_file(), f"no report of attempt {attempt}:\n{_out(tmp)}"
    return json.loads(f.read_text())


def _step_of(c: SlurmCluster, job: int, node: str) -> str:
    """The id (JOB.STEP) of the step running `node`'s agent."""
    out = c.cmd("squeue", "-h", "-s", "-j", str(job), "-o", "%i %j").stdout
    ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [f"agent-{node}"]]
    assert len(ids) == 1, out
    return ids[0]


def _left_behind(c: SlurmCluster, run_id: str, within_s: float = 30.0, killed: str = "") -> dict[str, Any]:
    """Once the job ended: processes in the node hosts other than slurmd, and the run's memory in each host's own
    /dev/shm (seen through slurmd's root), waited for up to `within_s` to go (the `killed` node's memory stays:
    not waited for)."""
    deadline = time.monotonic() + within_s
    while True:
        procs: dict[str, list[str]] = {}
        segs: dict[str, list[str]] = {}
        for n in NODES:
            for pid in c.pids(n):
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if comm == "slurmd":
                    shm_dir = Path(f"/proc/{pid}/root/dev/shm")
                    mine = [p.name for p in shm_dir.iterdir() if p.name.startswith(f"{shm.PREFIX}{run_id}")]
                    if mine:
                        segs[n] = mine
                elif comm not in ("sh", "unshare"):
                    procs.setdefault(n, []).append(comm)
        if (not procs and set(segs) <= {killed} - {""}) or time.monotonic() > deadline:
            return {"processes": procs, "segments": segs}
        time.sleep(0.2)


def _first_step_s(j: dict[str, str], run: Path, t_submit: float) -> dict[str, float]:
    """Seconds from the submission to: Slurm starting the job (its StartTime, to the second), every node admitted,
    the run's start (the workers ready), the end of the first step."""
    import datetime

    ev = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    started = datetime.datetime.fromisoformat(j["StartTime"]).astimezone().timestamp()
    marks = {"slurm_started": started, "all_admitted": max(e["t"] for e in ev if e["kind"] == "admitted"),
             "run_start": next(e["t"] for e in ev if e["kind"] == "run_start"),
             "first_step": _metrics(run)[0]["t_end"]}
    return {k: round(v - t_submit, 2) for k, v in marks.items()}


def _say(what: str, **numbers: Any) -> None:
    print(f"\n[slurm] {what}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), flush=True)


def _private_files(tmp: Path, job: int) -> str:
    """While the job runs: its directory is private (0700), its token file 0600, the CA's key gone; the token."""
    jobdir = tmp / "jobs" / str(job)
    assert (jobdir.stat().st_mode & 0o777) == 0o700 and ((jobdir / "token").stat().st_mode & 0o777) == 0o600
    assert not (jobdir / "pki" / "ca.key").exists() and (jobdir / "pki" / "job.crt").is_file()
    token = (jobdir / "token").read_text().strip()
    assert len(token) == 64
    return token


def _token_gone(tmp: Path, job: int, token: str) -> None:
    """Once the job ended: the token and the TLS files removed, the token in no file the run wrote, nor in the
    job's output; the store was reached through TLS."""
    jobdir = tmp / "jobs" / str(job)
    assert not (jobdir / "token").exists() and not (jobdir / "pki").exists()
    for p in _run_dir(tmp, job).rglob("*"):
        if p.is_file():
            assert token not in p.read_text(errors="replace"), p
    assert token not in _out(tmp) and token not in SBATCH.read_text()
    assert "(TLS" in _out(tmp), _out(tmp)


@pytest.mark.slow
def test_sbatch_job_runs_to_the_end_bitwise(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """The users' script, submitted as is: the job trains to its last step on the allocation's first 2 nodes with
    the third a warm spare, exits 0 (Slurm: COMPLETED, never requeued), ends bitwise equal to the failure-free run,
    with the token only in the job's private directory (never on a command line, never in a file the run wrote)
    and nothing left on the nodes."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, t0 = _submit(slurm, tmp_path, steps)
    _wait_step(slurm, tmp_path, job, 1)
    token = _private_files(tmp_path, job)
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and j["Restarts"] == "0", (j, _out(tmp_path))
    rep = _report(tmp_path, job)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    names = sorted(m["name"] for m in rep["members"].values())
    assert names == list(NODES), rep["members"]
    assert [m["name"] for k, m in rep["members"].items() if k.startswith("s")] == ["node3"], rep["members"]
    _token_gone(tmp_path, job, token)
    assert _left_behind(slurm, rep["run_id"]) == {"processes": {}, "segments": {}}
    _say("submission to", **_first_step_s(j, _run_dir(tmp_path, job), t0))


def _hot_swapped(rep: dict[str, Any], victim_name: str) -> dict[str, Any]:
    (rec,) = rep["recoveries"]
    victim = next(k for k, m in rep["members"].items() if m["name"] == victim_name)
    assert rec["action"] == "hotswap" and rec["dead"] == [victim] and rec["promoted"] == ["s0"], rec
    assert rec["lost_steps"] <= 1 and rec["invariants"] == {"I1": True, "I2": True, "I3": True, "I4": True}, rec
    return rec


def _kill_to_recovery_s(rep: dict[str, Any], run: Path, t_kill: float) -> float:
    """Seconds from the kill to the end of the first step of the recovered job."""
    after = [m for m in _metrics(run) if m.get("epoch", 0) >= 1]
    return round(after[0]["t_end"] - t_kill, 2)


def test_node_step_killed_hot_swaps_to_the_spare(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """node2's step (its agent and workers) SIGKILLed by Slurm (`scancel --signal=KILL JOB.STEP`) at step 5: the
    coordinator declares its node dead within --failure-timeout and hot-swaps the spare (node3) into its slot; the
    job ends COMPLETED, exit 0, bitwise equal to the failure-free run. Only the killed node's memory is left (in its
    host's /dev/shm: nobody alive there could free it). The job's files private, its token nowhere else; the time
    from the submission to the first step measured."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, t0 = _submit(slurm, tmp_path, steps)
    _wait_step(slurm, tmp_path, job, 5)
    token = _private_files(tmp_path, job)
    t_kill = time.time()
    slurm.cmd("scancel", "--signal=KILL", _step_of(slurm, job, "node2"))
    j = slurm.wait_job(job, JOB_S)
    _say("submission to", **_first_step_s(j, _run_dir(tmp_path, job), t0))
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, _out(tmp_path))
    rep = _report(tmp_path, job)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    rec = _hot_swapped(rep, "node2")
    left = _left_behind(slurm, rep["run_id"], killed="node2")
    assert left["processes"] == {} and set(left["segments"]) <= {"node2"}, left
    _token_gone(tmp_path, job, token)
    _say("step killed", kill_to_recovery_s=_kill_to_recovery_s(rep, _run_dir(tmp_path, job), t_kill),
         detect_s=rec.get("detect_s"), lost_steps=rec["lost_steps"])


@pytest.mark.slow
def test_node_set_down_hot_swaps_to_the_spare(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """node2 set DOWN by the administrator (`scontrol update nodename=node2 state=down`) at step 5: Slurm kills
    what the job runs there and (`--no-kill`) keeps the job running on the others; the spare takes node2's slot,
    the job ends COMPLETED, bitwise equal to the failure-free run."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, _ = _submit(slurm, tmp_path, steps)
    _wait_step(slurm, tmp_path, job, 5)
    t_kill = time.time()
    slurm.cmd("scontrol", "update", "nodename=node2", "state=down", "reason=phoenixft-test")
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, _out(tmp_path))
    rep = _report(tmp_path, job)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    rec = _hot_swapped(rep, "node2")
    _say("node set DOWN", kill_to_recovery_s=_kill_to_recovery_s(rep, _run_dir(tmp_path, job), t_kill),
         detect_s=rec.get("detect_s"), lost_steps=rec["lost_steps"])


@pytest.mark.slow
def test_node_notice_drains_onto_the_spare(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """node2's step signalled SIGUSR1 (`scancel --signal=USR1 JOB.STEP`, as Slurm signals every process of a
    step): its workers ignore it, its agent asks for a drain, the coordinator moves node2's role onto the spare at
    a step boundary with 0 steps lost, node2's agent leaves (exit 0); the job ends bitwise equal."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, _ = _submit(slurm, tmp_path, steps)
    _wait_step(slurm, tmp_path, job, 5)
    # (Slurm 22.05's scancel signals the step's processes and then says "Invalid job id specified", exit 225: its
    # exit code tells nothing, the drain below says whether the notice arrived)
    slurm.cmd("scancel", "--signal=USR1", _step_of(slurm, job, "node2"), check=False)
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, _out(tmp_path))
    rep = _report(tmp_path, job)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    (rec,) = rep["recoveries"]
    node2 = next(k for k, m in rep["members"].items() if m["name"] == "node2")
    assert rec["class"] == "planned" and rec["action"] == "drain" and rec["lost_steps"] == 0, rec
    assert rec["drain"]["node"] == node2 and rec["drain"]["completed"] and rec["promoted"] == ["s0"], rec
    assert _left_behind(slurm, rep["run_id"]) == {"processes": {}, "segments": {}}
    _say("node notice", lost_steps=rec["lost_steps"], notice_to_swapped_s=rec["drain"]["notice_to_swapped_s"])


def test_job_notice_stops_saved_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """The job's notice as `--signal=B:USR1@T` delivers it, to the batch script (`scancel --batch --signal=USR1`):
    every node goes, so no spare helps; the script has the head stop the job at the next step boundary with that
    step written to the persistent tier (whatever --persist-every says), the head exits 75, the script requeues
    the job, and the requeued job (same id, Restarts=1) resumes from that step and ends COMPLETED, bitwise equal to
    the failure-free run: nothing lost."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, _ = _submit(slurm, tmp_path, steps, "--persist-every", "1000")
    _wait_step(slurm, tmp_path, job, 5)
    t_notice = time.time()
    slurm.cmd("scancel", "--batch", "--signal=USR1", str(job))
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "COMPLETED" and j["Restarts"] == "1", (j, _out(tmp_path))
    first = _report(tmp_path, job, 0)
    assert first["state"] == "stopped" and first["stopped"]["saved"] is True, (first.get("stopped"), _out(tmp_path))
    saved = first["stopped"]["step"]
    assert 5 < saved < steps and first["steps_completed"] == saved, first["stopped"]
    assert (tmp_path / "jobs" / str(job) / "ckpt" / f"step_{saved:08d}" / "MANIFEST.json").is_file()
    assert "the head exited 75 (attempt 0)" in _out(tmp_path) and "the head exited 0 (attempt 1)" in _out(tmp_path)
    second = _report(tmp_path, job, 1)
    assert second["state"] == "done" and second["first_step"] == saved + 1, (second.get("first_step"), saved)
    assert second["final_state_sha256"] == ref["final_state_sha256"], second.get("error")
    assert _left_behind(slurm, second["run_id"]) == {"processes": {}, "segments": {}}
    resumed = _metrics(_run_dir(tmp_path, job, 1))[0]["t_end"]
    _say("job notice", saved_step=saved, lost_steps=0, notice_to_stopped_s=first["stopped"]["notice_to_stopped_s"],
         notice_to_resumed_first_step_s=round(resumed - t_notice, 2))


def test_job_ended_without_notice_saves_and_resumes(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """`scancel JOB` with no --signal (as at the time limit without `--signal`): Slurm sends SIGTERM to every
    process of the job at once - the batch script, the head, the store's front, every node's agent, workers and
    TLS forwarder - and SIGKILL KillWait later (5 s on the tests' cluster). The relays keep relaying, the nodes
    stay, the job stops at the next step boundary with that step written to the persistent tier (at or past the
    step it had reached: --persist-every 1000 alone would have written none), the head exits 75 and the script
    with it, before the SIGKILL; a job submitted again with that checkpoint (PHOENIXFT_CKPT) resumes from it and
    ends COMPLETED, bitwise equal to the failure-free run. Nothing is left on any node."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, _ = _submit(slurm, tmp_path, steps, "--persist-every", "1000")
    _wait_step(slurm, tmp_path, job, 5)
    reached = max(m["step"] for m in _metrics(_run_dir(tmp_path, job)))
    t_term = time.time()
    slurm.cmd("scancel", str(job))
    j = slurm.wait_job(job, JOB_S)
    term_to_job_ended_s = round(time.time() - t_term, 2)  # (Slurm records the end once the batch script exited)
    first = _report(tmp_path, job, 0)
    term_to_report_s = round((_run_dir(tmp_path, job) / "report.json").stat().st_mtime - t_term, 2)
    assert j["JobState"] == "CANCELLED" and j["Restarts"] == "0", (j, _out(tmp_path))
    assert first["state"] == "stopped" and first["stopped"]["saved"] is True, (first.get("stopped"), _out(tmp_path))
    assert first["stopped"]["reason"] == "SIGTERM received", first["stopped"]
    saved = first["stopped"]["step"]
    assert reached - 1 <= saved < steps and first["steps_completed"] == saved, (reached, first["stopped"])
    ckpt = tmp_path / "jobs" / str(job) / "ckpt"
    assert (ckpt / f"step_{saved:08d}" / "MANIFEST.json").is_file()
    assert "the head exited 75 (attempt 0)" in _out(tmp_path) and "not requeued here" in \
        _out(tmp_path), _out(tmp_path)
    assert j["ExitCode"] == "75:0", j["ExitCode"]
    assert _left_behind(slurm, first["run_id"]) == {"processes": {}, "segments": {}}
    _say("job ended without notice", reached=reached, saved_step=saved, exit_code=j["ExitCode"],
         notice_to_stopped_s=first["stopped"]["notice_to_stopped_s"], sigterm_to_report_s=term_to_report_s,
         sigterm_to_job_ended_s=term_to_job_ended_s)

    again, _ = _submit(slurm, tmp_path, steps, "--persist-every", "1000", PHOENIXFT_CKPT=str(ckpt))
    j2 = slurm.wait_job(again, JOB_S)
    assert j2["JobState"] == "COMPLETED" and j2["ExitCode"] == "0:0", (j2, _out(tmp_path))
    second = _report(tmp_path, again, 0)
    assert second["state"] == "done" and second["first_step"] == saved + 1, (second.get("first_step"), saved)
    assert second["final_state_sha256"] == ref["final_state_sha256"], second.get("error")
    assert _left_behind(slurm, second["run_id"]) == {"processes": {}, "segments": {}}


@pytest.mark.slow
def test_time_limit_without_notice_saves_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path,
                                                              reference: Any) -> None:
    """A job that reaches its time limit (`--time=1`, no `--signal` notice): Slurm sends SIGTERM to every process of
    it (SIGKILL KillWait later); the job stops at a step boundary with that step saved, the head exits 75, the script
    requeues it (Reason=TimeLimit), and each attempt resumes from the step the one before saved (an attempt that
    reaches the limit again is stopped and requeued the same way) until the job ends COMPLETED, bitwise equal to the
    failure-free run. (Slurm looks at time limits every 30 s: an attempt lasts 60-90 s.)"""
    steps = 500  # (paced: >= 100 s of steps, more than one attempt's 90 s)
    ref = _ref(reference, steps)
    # the script's notice (--signal=B:USR1@120, which a 1-minute job would get at once) replaced by a signal the batch
    # shell ignores (sbatch cannot drop an #SBATCH --signal): no notice reaches the job before its SIGTERM
    job, _ = _submit(slurm, tmp_path, steps, "--persist-every", "1000", sbatch_args=("--time=1", "--signal=B:URG@1"))
    j = slurm.wait_job(job, 600)
    assert j["JobState"] == "COMPLETED" and int(j["Restarts"]) >= 1, (j, _out(tmp_path))
    attempts = int(j["Restarts"]) + 1
    for a in range(attempts - 1):
        rep = _report(tmp_path, job, a)
        stopped = rep["stopped"]
        assert rep["state"] == "stopped" and stopped["saved"] and stopped["reason"] == "SIGTERM received", stopped
        assert f"the head exited 75 (attempt {a})" in _out(tmp_path), _out(tmp_path)
        nxt = _report(tmp_path, job, a + 1)
        assert nxt["first_step"] == stopped["step"] + 1, (a, nxt["first_step"], stopped["step"])
        _say(f"time limit, attempt {a}", saved_step=stopped["step"], notice_to_stopped_s=stopped["notice_to_stopped_s"])
    last = _report(tmp_path, job, attempts - 1)
    assert last["state"] == "done" and last["final_state_sha256"] == ref["final_state_sha256"], last.get("error")
    assert _left_behind(slurm, last["run_id"]) == {"processes": {}, "segments": {}}


@pytest.mark.slow
def test_scheduler_requeue_saves_and_resumes(slurm: SlurmCluster, tmp_path: Path, reference: Any) -> None:
    """A requeue by the scheduler (`scontrol requeue`, as a preemption with PreemptMode=REQUEUE: SIGTERM to every
    process of the job, no notice first): the job stops at a step boundary with that step saved (--persist-every 4
    notwithstanding), the head exits 75 (the script leaves the requeue to Slurm, which does it), and the requeued
    job resumes from that step, nothing lost, bitwise equal to the failure-free run."""
    steps = STEPS
    ref = _ref(reference, steps)
    job, _ = _submit(slurm, tmp_path, steps, "--persist-every", "4")
    _wait_step(slurm, tmp_path, job, 6)
    reached = max(m["step"] for m in _metrics(_run_dir(tmp_path, job)))
    slurm.cmd("scontrol", "requeue", str(job))
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "COMPLETED" and j["Restarts"] == "1", (j, _out(tmp_path))
    first = _report(tmp_path, job, 0)
    assert first["state"] == "stopped" and first["stopped"]["saved"] is True, (first.get("stopped"), _out(tmp_path))
    saved = first["stopped"]["step"]
    assert reached <= saved < steps and "the head exited 75 (attempt 0)" in _out(tmp_path), (reached, saved)
    second = _report(tmp_path, job, 1)
    assert second["state"] == "done" and second["first_step"] == saved + 1, (second["first_step"], saved)
    assert second["final_state_sha256"] == ref["final_state_sha256"], second.get("error")
    _say("scheduler requeue", reached=reached, saved_step=saved, resumed_at_step=second["first_step"])


def test_refused_job_exits_2_and_is_not_requeued(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A job whose flags are wrong: the head refuses it in one line and exits 2; the script exits 2, Slurm records
    FAILED with exit code 2 and does not requeue it (the same flags would fail again)."""
    job, _ = _submit(slurm, tmp_path, STEPS, "--protect", "bogus")
    j = slurm.wait_job(job, 60)
    assert j["JobState"] == "FAILED" and j["ExitCode"] == "2:0" and j["Restarts"] == "0", (j, _out(tmp_path))
    assert "--protect" in _out(tmp_path) and "Traceback" not in _out(tmp_path), _out(tmp_path)


@pytest.mark.slow
def test_failed_job_exits_1_and_is_not_requeued(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A job that cannot continue (the loss of step 3 NaN: not a node's failure, no spare helps): the run stops
    at its last committed step with one line saying why, the head exits 1, Slurm records FAILED with exit code 1
    and does not requeue it."""
    job, _ = _submit(slurm, tmp_path, STEPS, "--inject", "nan:step=3")
    j = slurm.wait_job(job, JOB_S)
    assert j["JobState"] == "FAILED" and j["ExitCode"] == "1:0" and j["Restarts"] == "0", (j, _out(tmp_path))
    rep = _report(tmp_path, job)
    assert rep["state"].startswith("failed") and "the head exited 1 (attempt 0)" in _out(tmp_path), rep["state"]
    assert _left_behind(slurm, rep["run_id"]) == {"processes": {}, "segments": {}}
