"""A stranger with a plain TCPStore client and no token, writing garbage and forgeries into a live run's
store: no process of the job dies of it, and the run ends with its true final state."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS, on_pythonpath, processes_with

from phoenixft.controlplane import LogReader, keys, signed, values
from phoenixft.controlplane.etcd_cluster import etcd_binary
from phoenixft.controlplane.server import serve_store
from phoenixft.distributed.comm import connect_store

REPO = Path(__file__).resolve().parents[1]
ESC = "\x1b[2J\x1b]0;pwned\x07"


def test_readers_ignore_values_that_do_not_parse(capsys: Any) -> None:
    values._noted.clear()  # (the notes are capped per key and process: other tests in this process noted keys too)
    assert values.parse_lines(b'{"kind": "a"}\nnot json' + ESC.encode() + b'\n[1, 2]\n{"kind": "b"}\n', "events") \
        == [{"kind": "a"}, {"kind": "b"}]
    assert values.parse_int(b"12", "k") == 12 and values.parse_int(b"1e9x", "k", -1) == -1
    assert values.parse_json(b'{"a": 1}', "j") == {"a": 1} and values.parse_json(b"[]", "j", "d") == "d"
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and err.count("\n") == 3, err  # once per key
    assert "ignored the store value of 'events': not JSON" in err


def test_json_readers_are_total_over_generated_junk(capsys: Any) -> None:
    """Whatever the bytes (nested a million deep, longer than a reader parses, not UTF-8, lone surrogates,
    NaN and 1e999, numbers of 5,000 digits, generated noise), a reader returns its default or a value of the
    asked type, never raises, and logs each key once, its value cut short and printable."""
    import random

    values._noted.clear()
    rng = random.Random(20240613)
    fixed = [b"[" * 200_000, b"{" * 100_000, b'{"a":' * 50_000, b"x" * (values.MAX_PARSE_BYTES + 1),
             b'[' + b'1,' * 2_000_000 + b'1]', b"\xff\xfe\xfd", b'"\\ud800"', b'{"a": "\\udfff"}', b"NaN",
             b'{"a": Infinity}', b"1e999", b'{"t": -1e999}', b"9" * 5000, b"", b"  ", b"\x00", ESC.encode(),
             b'{"a": [' * 40 + b']}' * 40, b'"' + b"[" * 100_000 + b'"']
    noise = [bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 64, 300]))) for _ in range(2000)]
    for i, raw in enumerate(fixed + noise):
        for kind in (dict, list, (int, float), object):
            v = values.parse_json(raw, f"k{i}", "default", kind)
            assert v == "default" or isinstance(v, kind), (raw[:40], v)
        assert isinstance(values.parse_int(raw, f"i{i}", -7), int)
        assert isinstance(values.clean(raw), str) and len(values.clean(raw)) <= 123
    assert values.parse_json(b'"\\ud800"', "s", None, str) == "\ud800"  # (a lone surrogate is a string: kept)
    assert values.parse_json(b'{"a": [[1]]}', "ok") == {"a": [[1]]}  # within the bounds: parsed
    assert values.parse_json(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "in-string") is not None
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert all(line.startswith("phoenixft: ignored the store value of ") for line in lines), lines[:3]
    assert len(lines) == len({line.split("'")[1] for line in lines}), "a key logged twice"
    assert "nested deeper than 32 levels" in err and "too long to parse" in err and "not JSON" in err
    values._noted.clear()


def test_numbers_a_value_of_the_job_cannot_hold_are_refused() -> None:
    """A number that is not finite once parsed (1e999 overflows to infinity; NaN and Infinity are not JSON)
    makes the whole value refused: a drain deadline, a timestamp or a step of infinity reaches no reader."""
    for raw in (b"1e999", b'{"deadline": 1e999}', b'{"t": -1e999}', b'{"a": [1, 2e400]}', b"NaN",
                b'{"a": Infinity}', b'{"a": -Infinity}'):
        assert values.json_problem(raw)[0] != "", raw
        assert values.parse_json(raw, "finite", "default", object) == "default", raw
    assert values.parse_drain_request(b'{"reason": "x", "source": "y", "deadline": 1e999}', "drain/0") is None
    assert values.parse_json(b'{"deadline": 1e300, "t": -2.5}', "finite") == {"deadline": 1e300, "t": -2.5}
    values._noted.clear()


def test_signed_values_verify_only_with_the_run_key() -> None:
    server = serve_store("127.0.0.1", 0)
    st = connect_store(server.addr)
    tok = "x" * 8 + "Aq3-Zt9_pL0wYv2s"
    signed.set_signed(st, tok, "run1", keys.RUN_STATE, "failed")
    assert signed.run_ended(st, "run1", tok) == "failed"
    assert signed.run_ended(st, "run2", tok) is None  # another run's signature is not this run's
    assert signed.run_ended(st, "run1", tok[::-1]) is None
    st.set(keys.RUN_STATE, "aborted")  # overwritten by someone without the key
    assert signed.run_ended(st, "run1", tok) is None
    # a signature binds its key's name: `failed` signed for `final` (copied, with its signature, under run/state)
    # is no run end
    signed.set_signed(st, tok, "run1", keys.FINAL, "failed")
    st.multi_set([signed.sig_key(keys.RUN_STATE), keys.RUN_STATE], [st.get(signed.sig_key(keys.FINAL)), b"failed"])
    assert signed.run_ended(st, "run1", tok) is None and signed.verified(st, tok, "run1", keys.FINAL) == b"failed"
    # a reader without a token believes nothing: not even a value signed with the run key of the empty token,
    # which anyone can compute
    signed.set_signed(st, "", "run1", keys.RUN_STATE, "failed")
    assert signed.verified(st, "", "run1", keys.RUN_STATE, note=False) is None and signed.run_ended(st, "run1", "") \
        is None


def test_sealed_values_verify_only_under_their_run_key_and_name(capsys: Any) -> None:
    """The envelope over generated names and values (bytes that are not UTF-8, separators, empty): a value
    opens only under the run key (token and run id) and the key name it was sealed for; any byte changed,
    any truncation, any other run, key or token, a value never sealed: None, logged in one line, no raise."""
    import random

    from phoenixft.controlplane import sealed

    rng = random.Random(20240613)
    tok, other_tok = "Aq3-Zt9_pL0wYv2s" * 2, "Bq3-Zt9_pL0wYv2s" * 2
    for i in range(300):
        name = rng.choice(["exit/n1", "fence/n0", "failflag/3", "coordinator/journal", "config", "events", "x"]) \
            + ("" if i % 3 else f"/{rng.randrange(10**6)}")
        value = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 64, 300])))
        if i % 5 == 0:
            value = b"pf1:" + value + b":\n\xff"  # (what looks like an envelope inside one)
        sealed.bind(tok, "run1")
        box = sealed.seal(name, value)
        assert sealed.unseal(name, box) == value and sealed.peel(box) == value
        cut = rng.randrange(len(box))
        flip = bytearray(box)
        at = rng.randrange(len(flip))
        flip[at] ^= 1 << rng.randrange(8)
        for bad in (box[:cut], bytes(flip), value, box + b"x", b"", name.encode() + box):
            assert sealed.unseal(name, bad) is None, (name, bad)
        assert sealed.unseal(name + "/", box) is None and sealed.unseal(name[:-1], box) is None  # another key
        sealed.bind(tok, "run2")  # another run of the same token
        assert sealed.unseal(name, box) is None
        sealed.bind(other_tok, "run1")  # another token
        assert sealed.unseal(name, box) is None
    sealed.unbind()
    assert sealed.unseal("unbound/key", b"pf1:" + b"0" * 64 + b":v") is None  # nothing bound: nothing verifies
    err = capsys.readouterr().err
    assert "not sealed with this run's key" in err and "no run key here" in err and "Traceback" not in err
    assert all(line.startswith("phoenixft: ignored the store value of ") for line in err.splitlines()), err[:2000]
    values._noted.clear()


def test_sealed_logs_claims_and_hints_survive_garbage_on_a_real_store() -> None:
    """On a live TCPStore: an appended log keeps its sealed lines in order, each once (a copied line is
    dropped), and drops garbage, lines of another run and bytes that are not UTF-8; a claim is won once, also
    over a stranger's holder; hints and claims on keys a stranger made non-numbers never cut the connection."""
    from phoenixft.controlplane import sealed

    server = serve_store("127.0.0.1", 0)
    st = connect_store(server.addr)
    sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run1")
    recs = [{"kind": "epoch", "n": i} for i in range(5)]
    log = LogReader(st, keys.EVENTS)  # (the events: a queue the launcher takes them from; the host history: a key)
    for name, read in ((keys.EVENTS, log.read_bytes), (keys.HOST_HISTORY, lambda: st.get(keys.HOST_HISTORY))):
        got = b""
        for r in recs[:3]:
            sealed.append(st, name, r)
        got += read()
        first = got.split(b"\n")[0]
        junk = b"not json\n\xff\xfe garbage " + ESC.encode() + b"\n" + first + b"\n"  # + a copy
        st.log_push(name, junk) if name == keys.EVENTS else st.append(name, junk)
        sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run2")
        sealed.append(st, name, {"kind": "of another run"})
        sealed.bind("Aq3-Zt9_pL0wYv2s" * 2, "run1")
        for r in recs[3:]:
            sealed.append(st, name, r)
        got = got + read() if name == keys.EVENTS else read()
        assert sealed.records(name, got) == recs, name
    for k in (keys.EXITS, keys.WORKER_EXITS, keys.START_FAILS, keys.desc_posted(0), "run/stop_claim", "c"):
        st.set(k, "garbage" + ESC)
    sealed.hint(st, keys.WORKER_EXITS)  # (never an `add`: the connection stays up)
    assert sealed.claim(st, "run/stop_claim") and not sealed.claim(st, "run/stop_claim")
    assert sealed.claim(st, "fresh") and not sealed.claim(st, "fresh")
    hint = sealed.Hint(keys.EXITS, every_s=3600.0)
    assert hint.moved(st) and not hint.moved(st)
    sealed.hint(st, keys.EXITS)
    assert hint.moved(st) and not hint.moved(st)
    st.set(keys.fence("n0"), "1")  # a stranger's fence: not there for the job
    sealed.put(st, keys.fence("n1"), "1")
    assert sealed.present(st, [keys.fence("n0"), keys.fence("n1"), keys.fence("n2")]) == [False, True, False]
    assert st.check([keys.HOST_HISTORY])  # the same connection still answers
    values._noted.clear()


STEPS = 80  # (long enough for the stranger's forgeries, checks and the coordinator's restart mid-run)


def _cli(run_dir: Path, backend: str) -> subprocess.Popen[str]:
    # tests/user_workload.py's paced workload: `workload`'s arithmetic, each step 0.1 s longer asleep (the run
    # lasts while the stranger works without training flat out on the CPU the suite's other tests need)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]),
           "PHOENIXFT_TEST_PACE_S": "0.1"}
    env.pop("PHOENIXFT_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "phoenixft", "run", "--nodes", "2", "--spares", "0",
                             "--steps", str(STEPS), *SUITE_FLAGS, "--workload", "user_workload:paced_workload",
                             "--run-dir", str(run_dir), "--timeout", "200", "--control-plane", backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _connect(run_dir: Path, backend: str, deadline: float) -> Any:
    """A client of the run's store without the token: a plain TCPStore client (or an etcd client)."""
    import torch.distributed as dist

    from phoenixft.controlplane import connect

    f = run_dir / ("coordinator.port" if backend == "tcpstore" else "control_plane")
    while not (f.exists() and f.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if backend == "tcpstore":
        return dist.TCPStore("127.0.0.1", int(f.read_text()), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
    return connect(f.read_text().strip(), 10.0)


def _peeled(st: Any, key: str) -> bytes | None:
    """A value as a stranger reads it (the job's values are readable: their MAC left off)."""
    from phoenixft.controlplane import sealed

    return sealed.peel(bytes(st.get(key))) if st.check([key]) else None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "(Z)" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:4]


def _forgeries(e: int, evil: Path, cfg: bytes) -> dict[str, str]:
    """What the stranger writes at once: every key the job acts on, forged or made garbage."""
    forged_cfg = {**json.loads(cfg), "lr": 1.0, "persist_dir": str(evil)}
    return {keys.node_exit("n1"): str(time.time()), keys.EXITS: "garbage" + ESC,  # a healthy node "exited"
            keys.fence("n0"): str(time.time()),  # ... or fenced
            keys.failflag(e): "1", keys.failflag(e) + "/by-worker": "1",  # a needless recovery
            keys.desc_posted(e): "garbage", keys.WORKER_EXITS: "x", keys.START_FAILS: "x",  # counters poisoned
            "run/stop_claim": "x", keys.ADMIT_POSTED: "x", keys.drain_notice(e): '{"after_step": 0}',
            keys.drain_abort(e): "1", keys.drain_key(0): json.dumps({"reason": "evil", "source": "stranger"}),
            keys.CONFIG: json.dumps(forged_cfg), keys.CONFIG_SIG: "0" * 64, keys.RUN_DIR: str(evil),
            keys.RUN_ID: "evil", keys.PROGRESS: "999", keys.step(999): "{}", keys.MEMBERS: "garbage"}


def _push_events(st: Any, data: bytes) -> None:
    """`data` where the launcher reads the events: on a TCPStore the queue it takes them from (it keeps them
    under `events`), on etcd the `events` log itself (phoenixft's etcd client, whose `log_push` appends)."""
    if hasattr(st, "log_push"):
        st.log_push(keys.EVENTS, data)
    else:
        st.queue_push(keys.EVENTS_QUEUE, data)


def _stranger(st: Any, run_dir: Path, evil: Path, launcher: subprocess.Popen[str], did: dict[str, Any]) -> None:
    """Once training runs: forgeries of every key the job acts on, checked to change nothing; a forged
    journal, then the coordinator's restart (SIGKILL, as a crash would); then garbage and forged ends in a
    loop until the run is over."""
    from phoenixft.controlplane import sealed

    deadline = time.monotonic() + 150
    while int(_peeled(st, keys.PROGRESS) or 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    run_id, e = st.get(keys.RUN_ID).decode(), int(_peeled(st, keys.EPOCH) or 0)
    coord = int(_peeled(st, keys.COORDINATOR_PID) or 0)
    agents = [p for p in processes_with(run_id) if b"runtime.agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
    cfg, run_dir_value, genuine = st.get(keys.CONFIG), st.get(keys.RUN_DIR), st.get(keys.EVENTS).split(b"\n")[0]
    for k, v in _forgeries(e, evil, cfg).items():
        st.set(k, v)
    # junk and copies where the launcher reads the events: on a TCPStore the queue it takes them from (it keeps
    # them under `events`), on etcd the `events` log itself (phoenixft's etcd client: `log_push` appends)
    _push_events(st, b"not json " + ESC.encode() + b"\n\xff\xfe\n" + (genuine + b"\n") * 3)
    st.append(keys.HOST_HISTORY, json.dumps({"kind": "quarantine", "host": "anything", "t": time.time()}) + "\n")
    st.append(f"sdc/accused/{e}", json.dumps({"node": "n1", "step": 3, "verdict": "forged"}) + "\n")
    did["forged"] = True
    t0 = time.monotonic()  # the launcher puts back what it wrote once (within a second or so)
    while (st.get(keys.CONFIG) != cfg or st.get(keys.RUN_DIR) != run_dir_value) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    did["put_back"] = st.get(keys.CONFIG) == cfg and st.get(keys.RUN_DIR) == run_dir_value
    time.sleep(1.5)  # (the detector looks at exits and flags every 0.25 s)
    did["unmoved"] = (int(_peeled(st, keys.EPOCH) or -1), not st.check([keys.recovery(e + 1)]),
                      all(_alive(p) for p in [coord, *agents]))
    forged_journal = {"topo": {"epoch": e, "nodes": ["n0"], "workers_per_node": 1, "replicas": 1,
                               "resume_step": 0}, "spare_pool": [], "dead": ["n1"]}
    st.set(keys.JOURNAL, json.dumps(forged_journal))
    os.kill(coord, signal.SIGKILL)  # the coordinator restarts (as after a crash) and reloads its journal
    while _peeled(st, keys.COORDINATOR_PID) in (None, str(coord).encode()) and time.monotonic() < deadline:
        time.sleep(0.05)
    did["restarted"] = time.monotonic() < deadline
    while launcher.poll() is None and time.monotonic() < deadline:
        try:
            _push_events(st, ("not json " + ESC + "\n{\"kind\": \"fault\"}\n[1]\n").encode())
            for k in (keys.EXITS, keys.MEMBERS, keys.WORKER_EXITS, keys.START_FAILS, keys.ADMIT_POSTED, "step/999"):
                st.set(k, "garbage" + ESC)
            st.set(keys.fence("n0"), "1")
            st.set(keys.FINAL, json.dumps({"sha256": "deadbeef" * 8, "step": 999999, "epoch": 0, "path": ""}))
            st.set(keys.RUN_STATE, "done")
            did["rounds"] = did.get("rounds", 0) + 1
        except Exception:  # noqa: BLE001 - the store is gone: the run ended
            break
        time.sleep(0.2)
    sealed.unbind()


def _finish(p: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.communicate()


def _argv_watch(token_file: Path, launcher: subprocess.Popen[str], seen: dict[str, Any]) -> None:
    """Reads every process's command line (what `ps` shows) while the run lasts, looking for the token."""
    while not token_file.exists() and launcher.poll() is None:
        time.sleep(0.02)
    time.sleep(0.1)
    token = token_file.read_text().strip() if token_file.exists() else ""
    seen["token"], seen["with_token"], seen["looks"] = token, [], 0
    while token and launcher.poll() is None:
        for d in Path("/proc").glob("[0-9]*"):
            try:
                argv = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if token in argv:
                seen["with_token"].append(argv.replace("\0", " "))
        seen["looks"] += 1
        time.sleep(0.1)


@pytest.mark.parametrize("backend", ["tcpstore", pytest.param("etcd", marks=[  # (a minute: a cluster, an election)
    pytest.mark.slow, pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary")])])
def test_a_stranger_cannot_crash_fake_or_steer_a_run(tmp_path: Path, reference: Any, backend: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A live `phoenixft run` and a stranger with a plain store client and no token. It forges every key
    the job acts on (a healthy node's exit and fence, the failure flag, poisoned counters, the config, the
    run directory, drain requests and notices, accusations, host history, events) and nothing moves: no
    recovery, every process alive, what the launcher wrote once put back. It forges the journal and the
    coordinator restarts: the journal is not believed (rebuilt from what is signed). It writes garbage and
    forged ends until the run is over: exit 0, the final hash of a failure-free run, no traceback, no
    needless recovery, no node fenced, every refusal logged in one line. The token stays in a 0600 file:
    on no command line, in no output, log, report or other file of the run."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))  # (the reference runs in this process: it imports user_workload)
    on_pythonpath(str(REPO / "tests"), monkeypatch)
    ref_hash = reference(nodes=2, steps=STEPS, workload="user_workload:workload")["final_state_sha256"]
    run_dir, evil = tmp_path / "run", tmp_path / "evil"
    p = _cli(run_dir, backend)
    seen: dict[str, Any] = {}
    watch = threading.Thread(target=_argv_watch, args=(run_dir / "token", p, seen), daemon=True)
    watch.start()
    did: dict[str, Any] = {}
    st = _connect(run_dir, backend, time.monotonic() + 120)
    t = threading.Thread(target=_stranger, args=(st, run_dir, evil, p, did), daemon=True)
    t.start()
    out, err = _finish(p)
    t.join(timeout=30)
    watch.join(timeout=30)
    logs = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.log"))
    assert did.get("forged") and did.get("put_back"), (did, err[-3000:])
    assert did["unmoved"] == (0, True, True), (did, err[-3000:])  # no recovery, the coordinator and agents alive
    assert did.get("restarted") and did.get("rounds", 0) >= 3, did  # (and it wrote, for a while, while it trained)
    assert "Traceback" not in err + logs and "sha256 deadbeef" not in out + err, (err + logs)[-3000:]
    assert p.returncode == 0, err[-3000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["state"] == "done" and rep["steps_completed"] == STEPS
    assert rep["final_state_sha256"] == ref_hash and ref_hash[:12] in out + err
    assert rep["recoveries"] == [], rep["recoveries"]  # no needless recovery: nobody dead, fenced, drained
    assert [ev["kind"] for ev in rep["control_plane"]].count("coordinator_exited") <= 1, rep["control_plane"]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [ev["kind"] for ev in events]
    assert kinds.count("coordinator_exited") == 1 and "coordinator_restarted" in kinds, kinds
    restored = [ev for ev in events if ev["kind"] == "journal_restored"]
    assert len(restored) == 1 and "not sealed" in restored[0]["why"], restored
    assert events.count(events[0]) == 1 and "fault" not in kinds, kinds  # a copied line counts once; none forged
    assert not evil.exists() and (run_dir / "final" / "model.safetensors").exists()
    assert "fenced by the control plane" not in logs
    for key in ("fence/n0", "exit/n1", "failflag/0", "config", "run/dir", "coordinator/journal", "events", "drain/0"):
        assert f"ignored the store value of {key!r}" in err + logs, key  # (logged, one line each)
    assert "\x1b" not in err
    # the generated token: in a file of the run directory readable by its owner only, never on a command line
    # of the job's processes, never printed, never in a log, the report or another file of the run
    assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
    token = seen["token"]
    assert len(token) >= 22 and seen["looks"] >= 3 and seen["with_token"] == [], seen
    assert token not in out + err
    for f in run_dir.rglob("*"):
        if f.is_file() and f.name != "token" and f.stat().st_size < 50_000_000:
            assert token.encode() not in f.read_bytes(), f


INSIDER_STEPS = 30


def _insider(st: Any, run_dir: Path, launcher: subprocess.Popen[str], did: dict[str, Any]) -> None:
    """A process that holds the job token (read from the run's token file) but not rank 0: from step 2 until
    the run is over it writes run ends signed with the run key, each with a final-state record of a made-up
    hash that names a writer other than the node at rank 0 of the signed topology: the member at rank 1
    (n1), the rank 0 of an epoch that was never published, and no writer at all."""
    deadline = time.monotonic() + 150
    while not (run_dir / "token").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    token = (run_dir / "token").read_text().strip()
    while int(_peeled(st, keys.PROGRESS) or 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    run_id, e = st.get(keys.RUN_ID).decode(), int(_peeled(st, keys.EPOCH) or 0)
    forged = [{"epoch": e, "node": "n1"}, {"epoch": e + 7, "node": "n0"}, {"epoch": e}]
    while launcher.poll() is None and time.monotonic() < deadline:
        try:
            for who in forged:
                rec = {"sha256": "deadbeef" * 8, "step": INSIDER_STEPS, "path": "", **who}
                signed.set_signed(st, token, run_id, keys.FINAL, json.dumps(rec))
                signed.set_signed(st, token, run_id, keys.RUN_STATE, "done")
                did["ends"] = did.get("ends", 0) + 1
                did.setdefault("first_at", int(_peeled(st, keys.PROGRESS) or 0))
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store is gone: the run ended
            break


def test_a_run_ends_done_only_by_the_node_at_rank_0(tmp_path: Path, reference: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A live `phoenixft run` and a party that holds the job token but is not rank 0's node: the run ends it
    signs ("done", with a final-state record of a made-up hash naming another writer) end nothing. The run
    trains every step, ends rc 0 with the hash of a failure-free run, its report and final line say so, and
    every forged end is refused in one logged line."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    on_pythonpath(str(REPO / "tests"), monkeypatch)
    ref_hash = reference(nodes=2, steps=INSIDER_STEPS, workload="user_workload:workload")["final_state_sha256"]
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]),
           "PHOENIXFT_TEST_PACE_S": "0.1"}
    env.pop("PHOENIXFT_TOKEN", None)
    p = subprocess.Popen([sys.executable, "-m", "phoenixft", "run", "--nodes", "2", "--spares", "0",
                          "--steps", str(INSIDER_STEPS), *SUITE_FLAGS, "--workload", "user_workload:paced_workload",
                          "--run-dir", str(run_dir), "--timeout", "200"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    did: dict[str, Any] = {}
    try:
        st = _connect(run_dir, "tcpstore", time.monotonic() + 120)
        t = threading.Thread(target=_insider, args=(st, run_dir, p, did), daemon=True)
        t.start()
        out, err = _finish(p)
        t.join(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    logs = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.log"))
    # (it wrote forged ends while the run trained: at least one of each kind, mid-run)
    assert did.get("ends", 0) >= 6 and 2 <= did.get("first_at", 0) < INSIDER_STEPS - 10, did
    assert p.returncode == 0, err[-3000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["state"] == "done" and rep["steps_completed"] == INSIDER_STEPS and rep["recoveries"] == []
    assert rep["final_state_sha256"] == ref_hash and ref_hash[:12] in out + err and "sha256 deadbeef" not in out + err
    assert "Traceback" not in err + logs, (err + logs)[-3000:]
    said = err + logs
    assert "not the run's end: its writer 'n1' does not hold rank 0 in epoch 0 (n0 does)" in said, said[-3000:]
    assert "a 'done' without a final-state record of rank 0's node beside it" in said, said[-3000:]


def test_token_files_must_be_private_and_tokens_strong(tmp_path: Path) -> None:
    import secrets

    from phoenixft.controlplane import auth
    from phoenixft.errors import UserError

    f = tmp_path / "tok"
    f.write_text(secrets.token_urlsafe(32) + "\n")
    f.chmod(0o644)
    with pytest.raises(UserError, match=r"^--token-file=.*/tok: mode 0644 lets other users read the job token; "
                                        r"run `chmod 600 .*/tok`"):
        auth.read_token_file(str(f))
    f.chmod(0o600)
    assert auth.resolve_token("", str(f)) == f.read_text().strip()
    if os.geteuid() == 0:  # a private file of another user (root can make one): that user controls the token
        os.chown(f, 65534, 65534)
        with pytest.raises(UserError, match=r"^--token-file=.*/tok: the file belongs to uid 65534, not to this "
                                            r"user \(uid 0\)"):
            auth.read_token_file(str(f))
        os.chown(f, 0, 0)
    for weak in ("a" * 16, "a" * 40, "abcdefgh" * 4, "Password12345678", "Password123!Password123?",
                 "correcthorsebatterystaple1", "CorrectHorseBatteryStaple1!", "Summer2024!Summer2024!xyz"):
        with pytest.raises(UserError, match=r"--token is too weak \(.*\): a job token needs 128 bits"):
            auth.check_token(weak, "--token")
    for _ in range(200):  # random tokens as people make them pass (urlsafe 32: what `generate_token` makes)
        for strong in (secrets.token_urlsafe(32), secrets.token_urlsafe(24), secrets.token_hex(32)):
            assert auth.check_token(strong, "--token") == strong
    # every MAC is keyed with the token stretched by scrypt (16 MiB): a guess costs that, not one HMAC
    from phoenixft.controlplane import tokens

    assert tokens.SCRYPT_N * tokens.SCRYPT_R * 128 >= 16 << 20
    assert tokens.stretched("x" * 20) != tokens.stretched("x" * 21) and len(tokens.stretched("y" * 20)) == 32
    f.chmod(0o640)  # the command line: one line naming the flag, exit code 2, before anything starts
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for cmd in (["agent", "--coordinator", "127.0.0.1:1", "--node", "x"], ["run", "--steps", "2"],
                ["coordinator", "--host", "127.0.0.1", "--port", "0"]):
        p = subprocess.run([sys.executable, "-m", "phoenixft", *cmd, "--token-file", str(f)], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (cmd, p.stderr)
        assert "--token-file=" in p.stderr and "mode 0640" in p.stderr and "chmod 600" in p.stderr, p.stderr
