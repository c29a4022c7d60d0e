"""Nothing of a run outlives it, however it ends, looked for from outside the run.

Each exit path (a clean end; SIGINT, SIGTERM, SIGHUP and SIGKILL to the launcher; SIGKILL of an
agent and of a worker) runs `phoenixft run` as a real process whose environment carries a tag unique
to the test. Every process of the run inherits that environment (the launcher, its warm zygote and
everything forked from it: coordinator, agents, workers), so the run's processes are found by
scanning `/proc/*/environ` for the tag, not through any list the run keeps of its own PIDs; its host
memory is `/dev/shm/phoenixft-<run id>*` and its owner file. Once the exit path is over (the
launcher has exited), both must be empty within a bound, and where the launcher wrote a report its
teardown must have had nothing to kill or remove: each process freed what it owned. The look comes
before any cleanup of the test's own; what a failing test finds is then killed and unlinked by the
test itself, so a red test leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phoenixft.controlplane import keys, sealed
from phoenixft.distributed.comm import connect_store
from phoenixft.protect import shm

# `serial`: runs alone in `make test`, after the other tests: every local run that starts sweeps the memory of
# dead runs on this machine, and one started beside these tests could free what they look for (a leak would
# pass unseen, a planted orphan go missing)
pytestmark = pytest.mark.serial

TAG_ENV = "PHOENIXFT_TEST_LEAK_TAG"
GONE_WITHIN_S = 15.0  # after the launcher's exit (SIGKILL: its agents notice through a pidfd, then clean up)


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def tagged(tag: str) -> dict[int, str]:
    """Live processes (zombies excluded: they hold nothing) whose environment holds TAG_ENV=tag: pid -> argv."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        st = _stat(int(d.name))
        if st and st[0] not in ("Z", "X"):
            found[int(d.name)] = argv
    return found


def run_memory(run_id: str) -> list[str]:
    """The run's files in /dev/shm: its segments and its owner record."""
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{run_id}[-.]*"))


def _as_a_shell_starts_it() -> None:
    """Ctrl-C as in a terminal: a test run in the background (`make test &`, some CI runners) passes
    SIGINT on ignored, and Python then ignores it too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class TaggedRun:
    """`phoenixft run` (or `command`: `launch`) in its own session, with TAG_ENV set to a tag of its own."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, command: str = "run") -> None:
        self.tag = uuid.uuid4().hex
        self.run_dir, self.log = tmp / "run", tmp / "launcher.log"
        self.run_id = ""
        with open(self.log, "wb") as out:
            model = ["--model", "tiny"] if command == "run" else []  # (a launched script builds its own model)
            self.p = subprocess.Popen([sys.executable, "-m", "phoenixft", command, "--quiet", *model,
                                       "--run-dir", str(self.run_dir), "--timeout", "120", *args],
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True,
                                      env=dict(os.environ, **(env or {}), **{TAG_ENV: self.tag}),
                                      preexec_fn=_as_a_shell_starts_it)

    def progress(self) -> int:
        port = self.run_dir / "coordinator.port"
        try:
            store = connect_store(f"127.0.0.1:{int(port.read_text())}", 5.0)
            return int(sealed.peel(store.get(keys.PROGRESS)) or 0) if store.check([keys.PROGRESS]) else 0
        except Exception:  # noqa: BLE001 - not up yet, or gone
            return 0

    def wait_training(self, step: int = 2, timeout_s: float = 120.0) -> None:
        """Until the run has completed `step` steps; then its processes and memory must be there to be seen."""
        deadline = time.monotonic() + timeout_s
        while self.progress() < step:
            assert self.p.poll() is None, self.log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run did not train"
            time.sleep(0.05)
        m = re.search(r"run ([0-9a-f]{10}):", self.log.read_text(errors="replace"))
        assert m, self.log.read_text(errors="replace")
        self.run_id = m.group(1)
        # the look must have something to miss: the run's processes and its snapshots in /dev/shm
        assert len(tagged(self.tag)) >= 6 and run_memory(self.run_id), (tagged(self.tag), run_memory(self.run_id))

    def of_node(self, node: str) -> tuple[int, list[int]]:
        """The agent of `node` (found in /proc by its command line among the tagged processes) and its workers."""
        procs = tagged(self.tag)
        mine = [p for p, argv in procs.items() if "phoenixft.runtime.agent" in argv and f"--node {node} " in argv]
        # (a worker is forked from its agent: the same command line, the agent its parent)
        (agent,) = [p for p in mine if (_stat(p) or ["", ""])[1] not in map(str, mine)]
        workers = [p for p in procs if (_stat(p) or ["", ""])[1] == str(agent)]
        assert workers, f"no worker of {node} in /proc"
        return agent, workers

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads((self.run_dir / "report.json").read_text())
        return out

    def left(self) -> dict[str, Any]:
        """What of the run is still there: processes (pid: argv) and /dev/shm files."""
        return {"processes": tagged(self.tag), "memory": run_memory(self.run_id) if self.run_id else []}

    def clean_up(self) -> None:
        """SIGKILL whatever of the run is still running and unlink its memory (the test's own cleanup)."""
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)
        for _ in range(50):
            procs = tagged(self.tag)
            if not procs:
                break
            for pid in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if self.run_id:
            shm.unlink_segments(self.run_id)
            shm.owner_path(self.run_id).unlink(missing_ok=True)


@pytest.fixture
def tagged_run(tmp_path: Path) -> Iterator[Any]:
    made: list[TaggedRun] = []

    def start(*args: str, at: str = "", env: dict[str, str] | None = None, command: str = "run") -> TaggedRun:
        (tmp_path / at).mkdir(exist_ok=True)
        made.append(TaggedRun(tmp_path / at, *args, env=env, command=command))
        return made[-1]

    yield start
    for r in made:
        r.clean_up()


def _assert_nothing_left(r: TaggedRun) -> None:
    """Within GONE_WITHIN_S of the launcher's exit, no process and no memory of the run is left (the
    test cleans up what it finds, so that a failure leaves nothing behind either)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := r.left())["processes"] or left["memory"]:
        if time.monotonic() > deadline:
            r.clean_up()
            raise AssertionError(f"{GONE_WITHIN_S:g}s after the launcher exited, the run left {left}")
        time.sleep(0.05)


def _kill_and_gone(pids: list[int], within_s: float) -> bool:
    """Whether every one of `pids` is gone (or a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while any((st := _stat(p)) and st[0] not in ("Z", "X") for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_to_the_launcher_leaves_nothing(tagged_run: Any, sig: signal.Signals) -> None:
    """Ctrl-C, a scheduler's SIGTERM, the terminal closed (SIGHUP): the run ends "failed: interrupted",
    keeps what it did up to the signal, and nothing of it is left. (SIGHUP: `phoenixft gc` run meanwhile
    does not touch the live run's memory.)"""
    r = tagged_run("--nodes", "2", "--spares", "1", "--steps", "2000")
    r.wait_training()
    if sig == signal.SIGHUP:
        # (a spare's health probe writes a segment of its own for a moment, and removes it: not compared)
        lasting = {m for m in run_memory(r.run_id) if ".health-" not in m}
        assert lasting, "the live run has no memory to leave alone"
        g = subprocess.run([sys.executable, "-m", "phoenixft", "gc"], capture_output=True, text=True, timeout=60)
        assert g.returncode == 0, g.stderr
        assert r.run_id not in g.stdout and lasting <= set(run_memory(r.run_id)) and r.p.poll() is None
    os.kill(r.p.pid, sig)
    r.p.wait(timeout=60)
    _assert_nothing_left(r)
    rep = r.report()
    assert rep["state"] == "failed: interrupted", rep["state"]
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    # what it did up to the signal is kept (not only the state: its steps and logs too)
    assert rep["steps_completed"] >= 2 and len(rep["loss"]) >= 2 and rep["run_dir"] == str(r.run_dir)
    assert len((r.run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
    assert (r.run_dir / "events.jsonl").read_text().strip()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_ctrl_c_at_a_terminal_keeps_the_report(tagged_run: Any, sig: signal.Signals) -> None:
    """Ctrl-C (or the terminal closed) reaches every process of the launcher's foreground group, the store's front
    among them: the launcher still reads the store through it for its report and teardown."""
    r = tagged_run("--nodes", "2", "--spares", "0", "--steps", "2000")
    r.wait_training()
    os.killpg(r.p.pid, sig)
    r.p.wait(timeout=60)
    _assert_nothing_left(r)
    rep = r.report()
    assert rep["state"] == "failed: interrupted" and "report_error" not in rep, rep
    assert rep["steps_completed"] >= 2 and len(rep["loss"]) >= 2, rep["steps_completed"]


def test_a_clean_end_leaves_nothing(tagged_run: Any) -> None:
    r = tagged_run("--nodes", "2", "--spares", "1", "--steps", "8")
    r.wait_training()
    assert r.p.wait(timeout=120) == 0, r.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(r)
    rep = r.report()
    assert rep["state"] == "done" and rep["steps_completed"] == 8, rep["state"]
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]


def test_sigkill_of_the_launcher_leaves_nothing_with_nobody_to_tear_down(tagged_run: Any) -> None:
    """No teardown runs: the agents follow the launcher (a pidfd on it) and free their nodes' memory, the
    coordinator and the zygote die with it, and the workers with their agents."""
    r = tagged_run("--nodes", "2", "--spares", "1", "--steps", "2000")
    r.wait_training()
    os.kill(r.p.pid, signal.SIGKILL)
    r.p.wait(timeout=30)
    _assert_nothing_left(r)
    assert not (r.run_dir / "report.json").exists()  # (the launcher wrote nothing: no teardown of it ran)


@pytest.mark.parametrize("who", ["agent", "worker"])
def test_sigkill_of_an_agent_or_a_worker_leaves_nothing(tagged_run: Any, who: str) -> None:
    """SIGKILL of n1's agent: its workers die with it by themselves (not killed by the launcher, whose
    teardown record stays empty), the node's memory is freed while the run goes on, a spare takes over.
    SIGKILL of n1's worker: its agent restarts it in place. Either way the run ends done and nothing of it
    is left."""
    # (the suite's micro-batch: what is looked at is processes and memory, and the run's 57 steps after the kill
    # last a quarter as long)
    r = tagged_run("--nodes", "2", "--spares", "1", "--steps", "60", "--micro-batch", "2")
    r.wait_training(step=3)
    agent, workers = r.of_node("n1")
    victim = agent if who == "agent" else workers[0]
    assert r.progress() < 40, "too late: make the run longer"
    os.kill(victim, signal.SIGKILL)
    if who == "agent":  # before the launcher's reaper would kill them (3 s) and record a leak
        assert _kill_and_gone(workers, 3.0), f"the workers {workers} outlived their SIGKILLed agent"
        deadline = time.monotonic() + 10.0  # the node's memory is freed at once, while the run goes on
        while shm.segments(r.run_id, "n1") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert shm.segments(r.run_id, "n1") == [] and r.p.poll() is None, "node n1's memory outlived its agent"
    assert r.p.wait(timeout=120) == 0, r.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(r)
    rep = r.report()
    assert rep["state"] == "done" and rep["steps_completed"] == 60, rep.get("error")
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    (rec,) = rep["recoveries"]  # the kill bit: one recovery of n1
    if who == "agent":
        assert rec["action"] == "hotswap" and rec["dead"] == ["n1"] and rec["promoted"] == ["s0"], rec
    else:
        assert rec["action"] == "inplace" and rec["restarted"] == ["n1.0"] and rec["dead"] == [], rec


# the paced workload (tests/user_workload.py): steps of >= 4 x 0.05 s, asleep, so that a signal falls mid-run
PACED = {"PHOENIXFT_TEST_PACE_S": "0.05",
         "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)}


def _paced_flags(steps: int, ckpt: Path) -> list[str]:
    return ["--nodes", "2", "--spares", "1", "--steps", str(steps), "--model", "nano", "--micro-batch", "2",
            "--microbatches", "4", "--workload", "user_workload:paced_workload", "--persist-every", "1000",
            "--persist-dir", str(ckpt)]


def test_sigterm_to_every_process_saves_the_job_and_it_resumes_bitwise(tagged_run: Any, reference: Any,
                                                                        tmp_path: Path) -> None:
    """A scheduler ending the job with no notice (Slurm at `scancel` or at the time limit: SIGTERM to every process
    of the job at once, SIGKILL KillWait later): with a persistent tier, every process of the run gets SIGTERM at
    the same moment (launcher, zygote, store front, coordinator, agents, workers): the relays keep relaying, the
    nodes stay, the job stops at a step boundary past the step it had reached with that step written to the
    persistent tier (--persist-every alone would have written none), the launcher exits 75 within seconds and
    nothing of the run is left; the same flags with --resume go on from that step and end bitwise equal to the
    failure-free run."""
    steps, ckpt = 40, tmp_path / "ckpt"
    r = tagged_run(*_paced_flags(steps, ckpt), at="first", env=PACED)
    r.wait_training(step=5)
    procs = tagged(r.tag)
    assert any("tlsproxy" in argv for argv in procs.values()), procs  # (the store's front is among them)
    reached = r.progress()
    t0 = time.monotonic()
    for pid in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    code = r.p.wait(timeout=60)
    term_to_exit_s = time.monotonic() - t0
    assert code == 75, r.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(r)
    rep = r.report()
    stopped = rep["stopped"]
    assert rep["state"] == "stopped" and stopped["saved"] is True and stopped["reason"] == "SIGTERM received", stopped
    assert reached <= stopped["step"] < steps and rep["steps_completed"] == stopped["step"], (reached, stopped)
    assert (ckpt / f"step_{stopped['step']:08d}" / "MANIFEST.json").is_file()
    assert rep["teardown"] == {"killed": [], "removed_segments": []}, rep["teardown"]
    assert term_to_exit_s < 25.0, term_to_exit_s  # (within Slurm's default KillWait, 30 s, with its margin)
    print(f"\n[sigterm] reached {reached}, saved {stopped['step']}, notice to stopped "
          f"{stopped['notice_to_stopped_s']}s, SIGTERM to exit {term_to_exit_s:.2f}s")

    again = tagged_run(*_paced_flags(steps, ckpt), "--resume", str(ckpt), at="second", env=PACED)
    assert again.p.wait(timeout=120) == 0, again.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(again)
    rep2 = again.report()
    ref = reference(nodes=2, steps=steps, microbatches=4, workload="user_workload:workload")
    assert rep2["state"] == "done" and rep2["first_step"] == stopped["step"] + 1, (rep2["state"], rep2["first_step"])
    assert rep2["final_state_sha256"] == ref["final_state_sha256"], rep2.get("error")


def test_sigterm_to_one_agent_alone_is_a_lost_node(tagged_run: Any, reference: Any, tmp_path: Path) -> None:
    """SIGTERM to one node's agent only, with a persistent tier: no stop of the job follows (the head got none),
    so after the agent's wait (TERM_DECIDE_S) the node stops as a lost one, the spare takes its slot, and the run
    ends done, bitwise equal to the failure-free run, with nothing left (its workers ignored the SIGTERM: their
    agent decided)."""
    from phoenixft.runtime.agent import TERM_DECIDE_S

    steps, ckpt = 60, tmp_path / "ckpt"
    r = tagged_run(*_paced_flags(steps, ckpt), env=PACED)
    r.wait_training(step=3)
    agent, workers = r.of_node("n1")
    os.kill(agent, signal.SIGTERM)
    for w in workers:
        os.kill(w, signal.SIGTERM)
    t0 = time.monotonic()
    assert not _kill_and_gone([agent], TERM_DECIDE_S - 1.0), "the agent stopped before it waited for the job's stop"
    assert _kill_and_gone([agent, *workers], 10.0), "the agent did not stop its node after its wait"
    assert time.monotonic() - t0 >= TERM_DECIDE_S - 1.0
    assert r.p.wait(timeout=120) == 0, r.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(r)
    rep = r.report()
    (rec,) = rep["recoveries"]
    assert rec["action"] == "hotswap" and rec["dead"] == ["n1"] and rec["promoted"] == ["s0"], rec
    ref = reference(nodes=2, steps=steps, microbatches=4, workload="user_workload:workload")
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")


def test_sigterm_to_every_process_of_a_launched_script_saves_it(tagged_run: Any, tmp_path: Path) -> None:
    """`phoenixft launch` takes the same path: SIGTERM to every process of a launched training script with a
    persistent tier stops it at a step boundary past the step it had reached, that step written to the persistent
    tier, exit 75, nothing left."""
    ckpt = tmp_path / "ckpt"
    script = Path(__file__).resolve().parents[1] / "examples" / "ddp_script_phoenixft.py"
    r = tagged_run("--nodes", "2", "--spares", "1", "--persist-every", "1000", "--persist-dir", str(ckpt), str(script),
                   "--steps", "3000", command="launch")
    r.wait_training(step=3)
    reached = r.progress()
    for pid in tagged(r.tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    assert r.p.wait(timeout=60) == 75, r.log.read_text(errors="replace")[-3000:]
    _assert_nothing_left(r)
    rep = r.report()
    assert rep["state"] == "stopped" and rep["stopped"]["saved"] is True, rep.get("stopped")
    saved = rep["stopped"]["step"]
    assert saved >= reached and (ckpt / f"step_{saved:08d}" / "MANIFEST.json").is_file(), (reached, saved)
