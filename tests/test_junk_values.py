"""Junk in every key of a live run: nested JSON, a huge value, bytes that are not UTF-8, a value of the wrong
type, a truncated value and a valid value of another key, written by a stranger into every key the job uses
(enumerated from `controlplane/keys.py`, so a key added there is covered at once, and every key the store
holds at that moment) during start-up, training, a recovery and the end. Every reader of those values is
total: the run ends with exit 0, the final hash of a failure-free run and a report, with no traceback."""

from __future__ import annotations

import datetime
import inspect
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS, on_pythonpath

from phoenixft.controlplane import keys, sealed

REPO = Path(__file__).resolve().parents[1]
KINDS = ("huge", "nested", "non_utf8", "wrong_type", "truncated", "other_key")  # (the slowest pass first)
PHASES = ("start-up", "training", "recovery", "end")
NESTED = b"[" * 200_000
HUGE = 256 << 10  # (the fast test's "huge": into every key at once; the slow one writes 8 MiB)
END_STEPS = 10  # "the end": the last steps of the run, the final state's publication and the shutdown
_ABSENT = b"\x00no key holds this\x00"
WRONG_TYPE = json.dumps({"nodes": 7, "epoch": "x", "step": [], "ok": "yes", "t": "now", "sha256": 5, "node": {},
                         "workers": "2", "reason": [1], "after_step": "x", "nonce": 5, "mac": 7, "ranges": "x",
                         "run_id": 3, "resume_step": "0", "dt": "fast", "loss": None, "kind": 5}).encode()

# the ids each parameter of a key function of `controlplane/keys.py` takes, from what the run holds now
_ARG_IDS = {"epoch": "epochs", "wid": "wids", "node": "nodes", "s": "steps", "step": "steps", "index": "faults",
            "who": "who", "seq": "seqs", "rank": "ranks", "slot": "slots", "what": "what"}


def key_functions() -> dict[str, Any]:
    """Every key name and key function of `controlplane/keys.py` (public, defined there)."""
    out: dict[str, Any] = {}
    for name, v in vars(keys).items():
        if name.startswith("_"):
            continue
        if isinstance(v, str) or (inspect.isfunction(v) and v.__module__ == keys.__name__):
            out[name] = v
    return out


def job_keys(ids: dict[str, list[Any]]) -> list[str]:
    """Every key of `controlplane/keys.py`, each function called with every combination of the run's ids."""
    names: list[str] = []
    for fname, f in key_functions().items():
        if isinstance(f, str):
            names.append(f)
            continue
        params = list(inspect.signature(f).parameters)
        unknown = [p for p in params if p not in _ARG_IDS]
        assert not unknown, f"keys.{fname} takes {unknown}: teach this test the ids of that parameter (_ARG_IDS)"
        for combo in itertools.product(*(ids[_ARG_IDS[p]] for p in params)):
            names.append(f(*combo))
        if "rank" in params and len(params) == 2:  # evidence(epoch, rank=None): the whole table too
            names += [f(e) for e in ids["epochs"]]
    return sorted(set(names))


def test_the_key_enumeration_covers_every_key_function() -> None:
    ids = {"epochs": [0, 1], "wids": ["n0.0"], "nodes": ["n0"], "steps": [3], "faults": [0], "who": ["n0", 0],
           "seqs": [1], "ranks": [0], "slots": [0], "what": ["x"]}
    names = job_keys(ids)
    fns = key_functions()
    assert len(fns) > 60 and all(isinstance(v, str) or callable(v) for v in fns.values())
    for must in ("config", "admit/1/req", "topo/1/sig", "desc/0/n0.0", "evidence/1", "evidence/1/0", "drain/0",
                 "persist/0/3/rank/0", "sdc/log", "run/stop_claim", "coordinator/leader", "failflag/0/by-worker"):
        assert must in names, must


def _peel(st: Any, key: str) -> bytes | None:
    return sealed.peel(bytes(st.get(key))) if st.check([key]) else None


def _int(st: Any, key: str, default: int = -1) -> int:
    try:
        return int(_peel(st, key) or default)
    except ValueError:
        return default


class Stranger:
    """A plain store client without the token, writing junk of each kind into every key in turn (each pass: the
    job's keys and the keys the store holds, then, after a short dwell, each value that was there put back if the
    junk is still in its place), recording which (phase, kind) passes it completed. The phase is read from the
    store before each pass, leaving out what the stranger itself left there."""

    def __init__(self, run_dir: Path, launcher: subprocess.Popen[str], nodes: int, spares: int, steps: int,
                 kill_step: int, faults: int, huge: int) -> None:
        self.run_dir, self.launcher = run_dir, launcher
        self.nodes, self.spares, self.steps, self.kill_step, self.faults = nodes, spares, steps, kill_step, faults
        self.huge = huge
        self.done: Counter[tuple[str, str]] = Counter()
        self.keys_seen: set[str] = set()
        self.error: str | None = None
        self.mine: dict[str, bytes] = {}  # junk left in keys that held nothing (until the job writes them)
        self.pass_s: dict[str, list[float]] = {k: [] for k in KINDS}  # how long each pass took
        self.trace: list[tuple[float, str, int]] = []  # (when, phase, progress) at each change of phase
        self.errors: list[str] = []
        self.st: Any = None

    def connect(self, deadline: float) -> bool:
        import torch.distributed as dist

        f = self.run_dir / "coordinator.port"
        while time.monotonic() < deadline and self.launcher.poll() is None:
            if f.exists() and f.read_text().strip():
                try:
                    self.st = dist.TCPStore("127.0.0.1", int(f.read_text()), is_master=False, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=10))
                    return True
                except Exception:  # noqa: BLE001 - not up yet, or going away with the run
                    pass
            time.sleep(0.05)
        return False

    def read(self, key: str) -> bytes | None:
        """A key's value, None if it is not there, without blocking (a `get` waits for a key the job deleted
        since a `check`): a compare-and-set of a value no key holds answers the value, or that value if none."""
        got = bytes(self.st.compare_set(key, _ABSENT, _ABSENT))
        return None if got == _ABSENT else got

    def _job_value(self, key: str) -> bytes | None:
        """A key's value as the job left it (None: absent, or the junk this stranger left there)."""
        raw = self.read(key)
        return None if raw is None or raw == self.mine.get(key) else sealed.peel(raw)

    def _int(self, key: str) -> int:
        try:
            return int(self._job_value(key) or b"-1")
        except ValueError:
            return -1

    def ids(self) -> dict[str, list[Any]]:
        e, p = max(0, self._int(keys.EPOCH)), max(0, self._int(keys.PROGRESS))
        n = self.nodes + self.spares + 1  # (the join requests the job makes, and the next number)
        nodes = [f"n{i}" for i in range(self.nodes)] + [f"s{i}" for i in range(self.spares)]
        return {"epochs": list(range(e + 2)), "wids": [f"{x}.0" for x in nodes], "nodes": nodes,
                "steps": sorted({1, max(1, p), p + 1, self.kill_step}), "faults": list(range(self.faults + 1)),
                "who": [*nodes, *range(self.nodes)], "seqs": list(range(1, n + 1)), "ranks": list(range(self.nodes)),
                "slots": list(range(self.nodes)), "what": ["x"]}

    def phase(self) -> str:
        p, e = self._int(keys.PROGRESS), self._int(keys.EPOCH)
        if p >= self.steps - END_STEPS or self._job_value(keys.RUN_STATE) is not None:  # (its last steps, its end)
            return "end"
        if self._job_value(keys.failflag(0)) == b"1" and self._job_value(keys.first_step(1)) is None:
            return "recovery"
        if p < 1:
            return "start-up"
        return "training" if e == 0 and p < self.kill_step - 1 else "after"

    def names(self) -> list[str]:
        names = set(job_keys(self.ids()))
        try:
            names |= {k for k in self.st.list_keys() if k}
        except (AttributeError, RuntimeError):
            pass
        self.keys_seen |= names
        return sorted(names)

    def junk(self, kind: str, name: str, current: bytes | None, other: bytes | None) -> bytes:
        if kind == "nested":
            return NESTED
        if kind == "huge":
            return b"{" + b"x" * self.huge
        if kind == "non_utf8":
            return b"\xff\xfe\xfd" + b"\x80" * 64 + b'{"a": "\xc3'
        if kind == "wrong_type":
            return WRONG_TYPE
        if kind == "truncated":
            return current[: len(current) // 2] if current else b'{"epoch": 1, "nodes": ["n0"'
        return other or b"pf1:" + b"0" * 64 + b":1"

    def one_pass(self, kind: str) -> str:
        st = self.st
        phase = self.phase()
        names = self.names()
        before: dict[str, bytes | None] = {}
        for name in names:
            raw = self.read(name)
            before[name] = None if raw == self.mine.get(name) else raw
        held = [v for v in before.values() if v]
        written: dict[str, bytes] = {}
        for i, name in enumerate(names):
            v = self.junk(kind, name, before[name], held[(i + 1) % len(held)] if held else None)
            st.set(name, v)
            written[name] = v
        st.queue_push(keys.EVENTS_QUEUE, self.junk(kind, keys.EVENTS_QUEUE, None, held[0] if held else None))
        time.sleep(0.05)  # (readers poll every 10-250 ms: some of them read the junk)
        for name, v in written.items():
            if before[name] is not None:
                st.compare_set(name, v, before[name])  # (put back only where the junk is still in place)
                self.mine.pop(name, None)
            else:
                self.mine[name] = v
        return phase

    def run(self) -> None:
        try:
            if not self.connect(time.monotonic() + 120):
                return
            while self.launcher.poll() is None:
                try:  # the kinds this phase still lacks first
                    now = self.phase()
                    todo = [k for k in KINDS if not self.done[(now, k)]] if now in PHASES else []
                    if not todo:  # (each kind once per phase: junk, not a flood that keeps every key away)
                        time.sleep(0.05)
                        continue
                    kind = todo[0]
                    t0 = time.monotonic()
                    phase = self.one_pass(kind)
                    if not self.trace or self.trace[-1][1] != phase:
                        self.trace.append((round(t0, 2), phase, self._int(keys.PROGRESS)))
                    self.pass_s[kind].append(round(time.monotonic() - t0, 2))
                except Exception as e:  # noqa: BLE001 - the store is gone (the run ended) or dropped this client
                    self.errors.append(repr(e)[:200])
                    if not self.connect(time.monotonic() + 30):
                        return
                    continue
                self.done[(phase, kind)] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)


def _junk_run(tmp_path: Path, reference: Any, monkeypatch: pytest.MonkeyPatch, steps: int, kill_step: int,
              huge: int, pace: str) -> tuple[Stranger, subprocess.Popen[str], str, str, str]:
    on_pythonpath(str(REPO / "tests"), monkeypatch)
    ref = reference(nodes=2, steps=steps, workload="user_workload:workload")["final_state_sha256"]
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]),
           "PHOENIXFT_TEST_PACE_S": pace}
    env.pop("PHOENIXFT_TOKEN", None)
    # the spare is checked just before its promotion, by a check that takes 2 s: the recovery lasts that long, which
    # the stranger spends writing junk (into the spare's health records among the rest)
    p = subprocess.Popen([sys.executable, "-m", "phoenixft", "run", "--nodes", "2", "--spares", "1", "--steps",
                          str(steps), *SUITE_FLAGS, "--workload", "user_workload:paced_workload", "--run-dir",
                          str(run_dir), "--timeout", "300", "--health-check", "sleep 2", "--health-max-age", "0",
                          "--health-recheck-every", "0", "--inject", f"kill:node=1@step={kill_step},wait=60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stranger = Stranger(run_dir, p, nodes=2, spares=1, steps=steps, kill_step=kill_step, faults=1, huge=huge)
    t = threading.Thread(target=stranger.run, daemon=True)
    t.start()
    try:
        out, err = p.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    t.join(timeout=30)
    (tmp_path / "stranger.json").write_text(json.dumps({"done": [[*k, v] for k, v in stranger.done.items()],
                                                        "pass_s": stranger.pass_s, "trace": stranger.trace,
                                                        "errors": stranger.errors}))
    return stranger, p, out, err, ref


def _check(stranger: Stranger, p: subprocess.Popen[str], out: str, err: str, ref: str, run_dir: Path) -> None:
    logs = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.log"))
    assert stranger.error is None, stranger.error
    assert "Traceback" not in err + logs, (err + logs)[-4000:]
    assert p.returncode == 0, err[-4000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref, (rep["state"], err[-3000:])
    assert rep["faults_not_fired"] == [] and rep["recoveries"], rep["recoveries"]
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    missing = [(ph, k) for ph in PHASES for k in KINDS if not stranger.done[(ph, k)]]
    assert not missing, (missing, dict(stranger.done), stranger.pass_s, stranger.trace, stranger.errors[-5:])
    for k in ("config", "admit/1/req", "topo/1", "topo/1/sig", "final", "run/state", "failflag/0", "desc/1/n0.0"):
        assert k in stranger.keys_seen, k


def test_junk_in_every_key_ends_no_run(tmp_path: Path, reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind of junk in every key, in each phase (start-up, training, a hot-swap recovery, the end): exit 0,
    the failure-free hash, a report, no traceback in any process's output."""
    stranger, p, out, err, ref = _junk_run(tmp_path, reference, monkeypatch, steps=35, kill_step=15, huge=HUGE,
                                           pace="0.2")
    _check(stranger, p, out, err, ref, tmp_path / "run")
