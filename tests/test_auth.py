"""The join and the plans without namespaces: admission by HMAC challenge-response (real TCPStore,
the real coordinator's policy), signed topologies, the store listening on the given address only,
an abandoned collective that a late peer can no longer complete, and the flags' clear errors."""

from __future__ import annotations

import contextlib
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

from phoenixft.config import RunConfig
from phoenixft.controlplane import auth, keys, sealed, signed, values
from phoenixft.controlplane.server import serve_store
from phoenixft.errors import RunAborted, UserError
from phoenixft.faults.spec import parse_fault
from phoenixft.runtime.launcher import check_mode

TOKEN = "Qm7x-Rt2v_K9pLw3Zy8N-bH4jD6sFa1Ec5"  # (strong by the token rule: the CLI checks it)
REPO = Path(__file__).resolve().parents[1]


def _client(server: Any) -> Any:
    from phoenixft.distributed.comm import connect_store

    return connect_store(server.addr, 10.0)


def _ask(server: Any, out: dict[str, Any], key: str, name: str, token: str | None, spare: bool = False,
         workers: int = 1, timeout_s: float = 20.0) -> threading.Thread:
    def go() -> None:
        try:
            out[key] = auth.request_admission(_client(server), {"name": name, "spare": spare, "workers": workers,
                                                                "host": "127.0.0.1"}, token, timeout_s, server.addr)
        except UserError as e:
            out[key] = str(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_admission_by_the_coordinators_policy() -> None:
    """Token holders get ids (active slots first, in order; then spares; strict ids as asked); strangers,
    another job's agents, wrong sizes and taken ids are refused with the reason; the verdicts a restarted
    coordinator reads back are only those signed with the token; the token is never in the store."""
    from phoenixft.coordinator import Coordinator

    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    signed.set_signed(store, TOKEN, "run1", keys.CONFIG, RunConfig(nodes=2, spares=0).to_json())
    coord = Coordinator(store, token=TOKEN)
    out: dict[str, Any] = {}

    def settle(*threads: threading.Thread) -> None:
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            coord.admission.admit(force=True)
            time.sleep(0.01)
        assert not any(t.is_alive() for t in threads)

    settle(_ask(server, out, "a", "alpha", TOKEN))
    settle(_ask(server, out, "b", "beta", TOKEN))
    settle(_ask(server, out, "none", "stranger", None), _ask(server, out, "wrong", "other", "b" * 32),
           _ask(server, out, "big", "gamma", TOKEN, workers=2), _ask(server, out, "taken", "n1", TOKEN),
           _ask(server, out, "slot", "n5", TOKEN), _ask(server, out, "c", "gamma", TOKEN))
    assert (out["a"]["node"], out["b"]["node"]) == ("n0", "n1") and out["a"]["run_id"] == "run1"
    assert out["c"]["node"] == "s0" and "every active slot is taken" in out["c"]["note"]
    assert "refused to admit 'stranger'" in out["none"] and "presented no token" in out["none"]
    assert "refused to admit 'other'" in out["wrong"] and "wrong token" in out["wrong"]
    assert "--workers=2 does not match this job's --workers-per-node=1" in out["big"]
    assert "node id n1 is already taken" in out["taken"]
    assert "n5 is not an active slot of this job (--nodes 2: n0..n1)" in out["slot"]
    assert set(coord.state.members) == {"n0", "n1", "s0"} and coord.state.spare_pool == ["s0"]
    assert json.loads(sealed.get(store, keys.MEMBERS) or b"{}")["n0"]["name"] == "alpha"
    # a restarted coordinator rebuilds exactly the signed admissions; a forged verdict does not count
    seq = int(store.add(keys.ADMIT_SEQ, 1))
    for k, v in ((keys.admit_req(seq), json.dumps({"name": "evil"})), (keys.admit_challenge(seq), "00"),
                 (keys.admit_verdict(seq), json.dumps({"ok": True, "node": "s9", "run_id": "run1", "note": "",
                                                        "mac": "f" * 64}))):
        store.set(k, v)
    assert sorted(v["node"] for _, _, v in auth.AdmissionDesk(store, TOKEN).admitted()) == ["n0", "n1", "s0"]
    assert sorted(Coordinator(store, token=TOKEN).state.members) == ["n0", "n1", "s0"]
    top = int(store.add(keys.ADMIT_SEQ, 0))
    for s in range(1, top + 1):
        for k in (keys.admit_req(s), keys.admit_challenge(s), keys.admit_resp(s), keys.admit_verdict(s)):
            if store.check([k]):
                assert TOKEN not in store.get(k).decode()


def _apps(desk: auth.AdmissionDesk, n: int = 1, timeout_s: float = 20.0) -> list[auth.Application]:
    apps: list[auth.Application] = []
    deadline = time.monotonic() + timeout_s
    while len(apps) < n and time.monotonic() < deadline:
        apps += desk.poll(force=True)
        time.sleep(0.01)
    return apps


def _wait_for(store: Any, key: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} never came"
        time.sleep(0.01)


def test_a_response_cannot_be_replayed_and_a_rogue_coordinator_is_noticed() -> None:
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    desk = auth.AdmissionDesk(store, TOKEN)
    assert desk.run_id == "run1"
    out: dict[str, Any] = {}
    t = _ask(server, out, "ok", "alpha", TOKEN)
    (app,) = _apps(desk)
    assert app.proof == "ok"
    # the same request and response under another number: the desk challenges the copy afresh and ignores a
    # response to any nonce but its own; bound to its own nonce, the old MAC does not verify
    resp = json.loads(store.get(keys.admit_resp(app.seq)))
    seq = int(store.add(keys.ADMIT_SEQ, 1))
    store.set(keys.admit_req(seq), store.get(keys.admit_req(app.seq)))
    store.set(keys.admit_resp(seq), json.dumps(resp))
    store.add(keys.ADMIT_POSTED, 1)
    assert desk.poll(force=True) == [] and desk.poll(force=True) == []
    nonce = json.loads(store.get(keys.admit_challenge(seq)))["nonce"]
    assert nonce != resp["nonce"]
    store.set(keys.admit_resp(seq), json.dumps({"nonce": nonce, "mac": resp["mac"]}))
    (replayed,) = _apps(desk)  # (refused once its request stayed as it was for auth.WRONG_GRACE_S)
    assert replayed.seq == seq and replayed.proof == "wrong"
    # a coordinator holding another token cannot admit us: its verdict does not verify with ours
    auth.AdmissionDesk(store, "c" * 32, run_id="run1").answer(app, "n0")
    t.join(timeout=20)
    assert "not signed with this agent's token" in out["ok"], out
    # counters a stranger made non-numbers (an agent's `add` on one loses its connection) are put back (the
    # request counter to the highest number the coordinator knows: a repair opens no numbers, however often a
    # stranger makes one), and a request number bumped by a billion opens no billion requests
    for _ in range(3):
        store.set(keys.ADMIT_SEQ, "garbage")
        store.set(keys.ADMIT_POSTED, "garbage")
        desk.poll()
        assert int(store.get(keys.ADMIT_SEQ)) == seq and int(store.get(keys.ADMIT_POSTED)) >= 0
    store.add(keys.ADMIT_SEQ, 10**9)
    t0 = time.monotonic()
    desk.poll(force=True)
    assert time.monotonic() - t0 < 5.0 and len(desk._pending) <= auth.MAX_OPEN
    t = _ask(server, out, "late", "beta", TOKEN)
    (app,) = _apps(desk)
    desk.answer(app, "s0")
    t.join(timeout=20)
    assert out["late"]["node"] == "s0", out
    # an agent never `add`s: with both counters made non-numbers and the next request number taken by a
    # stranger, it waits for the coordinator to put a number back, claims the next free number, and joins
    top = int(store.get(keys.ADMIT_SEQ))
    store.set(keys.admit_req(top + 1), "a stranger's request")
    store.set(keys.ADMIT_SEQ, "garbage")
    store.set(keys.ADMIT_POSTED, "garbage")
    t = _ask(server, out, "poisoned", "gamma", TOKEN)
    deadline = time.monotonic() + 20  # the agent meets the garbage before the coordinator looks again
    while store.get(keys.ADMIT_POSTED) == b"garbage" and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.is_alive(), out.get("poisoned")  # (an `add` on the garbage would have cut its connection)
    (app,) = _apps(desk)
    assert app.seq > top + 1 and app.request["name"] == "gamma", app  # (past the number the repair put back)
    assert store.get(keys.admit_req(top + 1)) == b"a stranger's request"
    desk.answer(app, "s1")
    t.join(timeout=20)
    assert out["poisoned"]["node"] == "s1", out
    assert int(store.get(keys.ADMIT_SEQ)) >= app.seq and int(store.get(keys.ADMIT_POSTED)) >= 0


def test_planted_challenges_and_deleted_verdicts_admit_no_one() -> None:
    """The coordinator never reuses a challenge it finds in the store, and binds the run id into the MAC it
    checks; a restarted coordinator never answers a request again (its signed record), nor, without the
    record, admits anyone on an old response (a phantom member)."""
    from phoenixft.coordinator import Coordinator

    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    signed.set_signed(store, TOKEN, "run1", keys.CONFIG, RunConfig(nodes=1, spares=1).to_json())
    coord = Coordinator(store, token=TOKEN)
    planted = "ab" * 32
    store.set(keys.admit_challenge(1), json.dumps({"nonce": planted, "run_id": "run1"}))  # before the agent asks
    out: dict[str, Any] = {}
    t = _ask(server, out, "a", "alpha", TOKEN)
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        coord.admission.admit(force=True)
        time.sleep(0.01)
    assert out["a"]["node"] == "n0", out
    issued = json.loads(store.get(keys.admit_challenge(1)))
    assert issued["nonce"] != planted and issued["run_id"] == "run1"
    # an answer bound to another run id does not verify (the MAC binds the run)
    desk = coord.admission.desk
    raw_req = json.dumps({"name": "gamma", "spare": True, "workers": 1})
    seq = int(store.add(keys.ADMIT_SEQ, 1))
    store.set(keys.admit_req(seq), raw_req)
    desk.poll(force=True)
    nonce = json.loads(store.get(keys.admit_challenge(seq)))["nonce"]
    for run_id, proof in (("run0", "wrong"), ("run1", "ok")):
        store.set(keys.admit_resp(seq), json.dumps({"nonce": nonce, "mac": auth._response_mac(TOKEN, run_id, seq,
                                                                                                 nonce, raw_req)}))
        (app,) = _apps(desk)  # (a wrong one: once its request stayed unchanged for auth.WRONG_GRACE_S)
        assert app.proof == proof
        desk._pending[seq] = auth._Pending(t=time.monotonic(), nonce=nonce, raw_req=raw_req)
    desk._pending.clear()
    # the stranger deletes the verdict, the coordinator restarts: the request was answered (signed record)
    assert store.delete_key(keys.admit_verdict(1))
    for gone in ([], [keys.ADMIT_DONE]):  # ... and with the record deleted too: a fresh challenge, no answer
        for k in gone:
            assert store.delete_key(k)
        again = Coordinator(store, token=TOKEN)
        for _ in range(5):
            again.admission.admit(force=True)
            time.sleep(0.02)
        assert again.state.members == {} and not store.check([keys.admit_verdict(1)]), again.state.members
        nonce = json.loads(store.get(keys.admit_challenge(1)))["nonce"]
        assert (nonce == issued["nonce"]) == (not gone)


ESC = "\x1b[2J\x1b]0;pwned\x07"


def test_refusals_are_signed_and_shown_printable() -> None:
    """A refusal planted before the coordinator answers does not stop a join (the agent waits for a signed
    verdict); one with no signed answer after it fails the join in one line that shows none of its text;
    the coordinator's own refusal is shown, control characters stripped."""
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    desk = auth.AdmissionDesk(store, TOKEN)
    forged = json.dumps({"ok": False, "reason": ESC + "go away"})
    out: dict[str, Any] = {}
    t = _ask(server, out, "a", "alpha", TOKEN)
    _wait_for(store, keys.admit_req(1))
    store.set(keys.admit_verdict(1), forged)
    time.sleep(0.3)  # (the agent reads it meanwhile)
    assert t.is_alive()
    (app,) = _apps(desk)
    desk.answer(app, "n0")
    t.join(timeout=20)
    assert out["a"]["node"] == "n0", out
    t = _ask(server, out, "b", "beta", TOKEN, timeout_s=3.0)  # (a planted answer names no challenge it answered:
    _wait_for(store, keys.admit_req(2))                     # it waits, for a signed one, until its deadline)
    store.set(keys.admit_verdict(2), forged)
    t.join(timeout=20)
    assert "did not answer the join request of 'beta' within 3s" in out["b"], out
    assert "the only answer there is not signed with this agent's token" in out["b"] and ESC not in out["b"], out
    assert "go away" not in out["b"] and "\x1b" not in out["b"]
    t = _ask(server, out, "c", "gamma", TOKEN)
    (app,) = _apps(desk)
    desk.answer(app, None, reason="no room for " + ESC + "gamma")
    t.join(timeout=20)
    assert "refused to admit 'gamma'" in out["c"] and "no room for" in out["c"] and "\x1b" not in out["c"], out
    assert "\x07" not in out["c"]


def test_tokens_given_on_a_command_line_are_scrubbed_from_it(tmp_path: Path) -> None:
    """`ps` (/proc/PID/cmdline) of an agent and of a head given `--token` shows stars where the token was,
    once they started (and the processes the head starts never had it there)."""
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.CONFIG, RunConfig(nodes=1).to_json())
    store.set(keys.RUN_ID, "0123abcd45")
    env = {k: v for k, v in os.environ.items() if k != auth.TOKEN_ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "phoenixft", *cmd, "--token", TOKEN], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for cmd in (["agent", "--coordinator", server.addr, "--node", "x", "--join-timeout", "60"],
                         ["coordinator", "--host", "127.0.0.1", "--port", "0", "--nodes", "1", "--join-timeout",
                          "60", "--run-dir", str(tmp_path / "run"), "--quiet"])]
    try:
        deadline = time.monotonic() + 90
        lines: dict[int, bytes] = {}
        while time.monotonic() < deadline:
            lines = {p.pid: Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in procs if p.poll() is None}
            if len(lines) < 2 or all(b"*" * len(TOKEN) in c for c in lines.values()):
                break
            time.sleep(0.05)
        assert len(lines) == 2 and all(b"*" * len(TOKEN) in c for c in lines.values()), lines
        time.sleep(1.0)  # (the head starts its coordinator meanwhile)
        seen = [d.name for d in Path("/proc").glob("[0-9]*") if _has(d / "cmdline", TOKEN.encode())]
        assert seen == [], seen
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _has(path: Path, needle: bytes) -> bool:
    try:
        return needle in path.read_bytes()
    except OSError:
        return False


def test_workers_act_only_on_signed_topologies(monkeypatch: pytest.MonkeyPatch) -> None:
    from phoenixft.distributed.topology import Topology

    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    raw = Topology(epoch=3, nodes=["n0", "s0"], workers_per_node=1, replicas=1, resume_step=7).to_json()
    store.set(keys.topo_sig(3), auth.sign_topology(TOKEN, 3, raw))
    store.set(keys.topo(3), raw)
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    assert auth.verified_topology(store, 3, raw.encode()).nodes == ["n0", "s0"]
    forged = raw.replace('"s0"', '"x9"')
    store.set(keys.topo(3), forged)
    with pytest.raises(RunAborted, match="not signed with this job's token"):
        auth.verified_topology(store, 3, forged.encode(), timeout_s=0.3)
    with pytest.raises(RunAborted, match="not signed"):  # a valid signature of epoch 3 is not one of epoch 4
        store.set(keys.topo(4), raw)
        store.set(keys.topo_sig(4), auth.sign_topology(TOKEN, 3, raw))
        auth.verified_topology(store, 4, raw.encode(), timeout_s=0.3)
    monkeypatch.delenv(auth.TOKEN_ENV)
    with pytest.raises(RunAborted, match="no job token"):
        auth.verified_topology(store, 3, raw.encode(), timeout_s=0.3)
    # the readers that only look (drain, the reports, the end's writer check): a forged topology is no topology
    store.set(keys.topo(3), raw)
    assert auth.read_topology(store, 3, TOKEN).nodes == ["n0", "s0"]
    assert auth.read_topology(store, 3, TOKEN[::-1]) is None
    store.set(keys.topo(3), forged)
    assert auth.read_topology(store, 3, TOKEN) is None and auth.read_topology(store, 4, TOKEN) is None
    assert auth.read_topology(store, 3, None).nodes == ["n0", "x9"]  # (no token: shown unchecked, never acted on)
    store.delete_key(keys.topo_sig(3))
    store.set(keys.topo(3), raw)
    assert auth.read_topology(store, 3, TOKEN) is None


def _end(store: Any, run_id: str, epoch: Any, node: Any, state: str = "done", token: str = TOKEN) -> None:
    """A signed run end as rank 0 writes it (its final-state record first), naming `node` as its writer."""
    rec = {"sha256": "ab" * 32, "step": 9, "epoch": epoch, "path": ""} | ({} if node is None else {"node": node})
    signed.set_signed(store, token, run_id, keys.FINAL, json.dumps(rec))
    signed.set_signed(store, token, run_id, keys.RUN_STATE, state)


def test_a_done_is_believed_only_from_the_node_at_rank_0_of_the_signed_topology(capsys: Any) -> None:
    """Epoch 0 puts n0 at rank 0; n0 died and epoch 1 puts n1 there (s0 joined). A "done" with a final-state
    record signed with the run key, as any holder of the token can write one, ends the run only when the
    record names the node at rank 0 of the signed topology of its epoch: not a member at another rank, not
    the rank 0 of another epoch, not a node of an epoch with no signed topology (or a forged one), not a
    record naming no writer. A failure ends the run whoever of the job writes it."""
    from phoenixft.distributed.topology import Topology

    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    for e, nodes in ((0, ["n0", "n1"]), (1, ["n1", "s0"])):
        raw = Topology(epoch=e, nodes=nodes, workers_per_node=2, replicas=1, resume_step=0).to_json()
        store.set(keys.topo_sig(e), auth.sign_topology(TOKEN, e, raw))
        store.set(keys.topo(e), raw)
    forged = Topology(epoch=2, nodes=["s0", "n1"], workers_per_node=2, replicas=1, resume_step=0).to_json()
    store.set(keys.topo(2), forged)  # (unsigned: what a party without the token can publish)
    store.set(keys.topo_sig(2), auth.sign_topology(TOKEN, 1, forged))
    refused = {(1, "s0"): "its writer 's0' does not hold rank 0 in epoch 1 (n1 does)",
               (0, "n1"): "its writer 'n1' does not hold rank 0 in epoch 0 (n0 does)",
               (1, "n0"): "its writer 'n0' does not hold rank 0 in epoch 1 (n1 does)",
               (2, "s0"): "the store holds no topology of epoch 2 signed with the job token",
               (7, "n1"): "the store holds no topology of epoch 7 signed with the job token",
               (1, None): "it names no writer node and epoch", ("1", "n1"): "it names no writer node and epoch",
               (True, "n1"): "it names no writer node and epoch"}
    for (e, node), why in refused.items():
        values._noted.clear()
        _end(store, "run1", e, node)
        assert signed.run_ended(store, "run1", TOKEN) is None, (e, node)
        assert signed.final_record(store, TOKEN, "run1") is None, (e, node)
        err = capsys.readouterr().err
        assert f"ignored the store value of 'final': not the run's end: {why}" in err, (e, node, err)
        assert "ignored the store value of 'run/state': a 'done' without a final-state record" in err, err
    _end(store, "run1", 1, "n1")
    assert signed.run_ended(store, "run1", TOKEN) == "done"
    assert signed.final_record(store, TOKEN, "run1") == {"sha256": "ab" * 32, "step": 9, "epoch": 1, "path": "",
                                                         "node": "n1"}
    _end(store, "run1", 0, "n0")  # the rank 0 of epoch 0 (n0, before it died): its epoch's rank 0 all the same
    assert signed.run_ended(store, "run1", TOKEN) == "done"
    assert signed.run_ended(store, "run2", TOKEN) is None  # (another run's key)
    assert signed.run_ended(store, "run1", "") is None  # (no token: nothing verifies)
    _end(store, "run1", 1, "s0", state="failed")  # a failure is any process's of the job to report
    assert signed.run_ended(store, "run1", TOKEN) == "failed" and signed.final_record(store, TOKEN, "run1") is None
    values._noted.clear()


def test_rank_0s_end_record_carries_its_signed_topology(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """Rank 0's record (`end_record`) carries the signed topology of its epoch as the store held it: its writer
    is checked against that copy, so an overwrite of `topo/<e>` after the coordinator stopped putting it back
    ends no "done"; a carried topology that is not signed for that epoch with the job token, or that puts
    another node at rank 0, is refused."""
    from phoenixft.distributed.topology import Topology

    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    raws = {e: Topology(epoch=e, nodes=nodes, workers_per_node=1, replicas=1, resume_step=0).to_json()
            for e, nodes in ((0, ["n0", "n1"]), (1, ["n1", "s0"]))}
    for e, raw in raws.items():
        store.set(keys.topo_sig(e), auth.sign_topology(TOKEN, e, raw))
        store.set(keys.topo(e), raw)
    final = json.dumps({"sha256": "cd" * 32, "step": 9, "epoch": 1, "path": ""})
    rec = json.loads(signed.end_record(final, "n1", store))
    assert rec["node"] == "n1" and rec["topology"] == {"raw": raws[1], "sig": auth.sign_topology(TOKEN, 1, raws[1])}

    def publish(r: dict[str, Any]) -> None:
        signed.set_signed(store, TOKEN, "run1", keys.FINAL, json.dumps(r))
        signed.set_signed(store, TOKEN, "run1", keys.RUN_STATE, "done")

    publish(rec)
    for k in (keys.topo(1), keys.topo_sig(1)):  # (a stranger's overwrite, never put back)
        store.set(k, "garbage")
    assert signed.run_ended(store, "run1", TOKEN) == "done" and signed.final_record(store, TOKEN, "run1") == rec
    refused = {"s0": (rec["topology"], "its writer 's0' does not hold rank 0 in epoch 1 (n1 does)"),
               "n0": ({"raw": raws[0], "sig": auth.sign_topology(TOKEN, 0, raws[0])},  # epoch 0's, as epoch 1's
                      "the topology it carries is not one of epoch 1 signed with the job token"),
               "n1": ({"raw": raws[1].replace('"s0"', '"x9"'), "sig": rec["topology"]["sig"]},
                      "the topology it carries is not one of epoch 1 signed with the job token")}
    for node, (topo, why) in refused.items():
        values._noted.clear()
        publish({**rec, "node": node, "topology": topo})
        assert signed.run_ended(store, "run1", TOKEN) is None, node
        assert f"not the run's end: {why}" in capsys.readouterr().err, node
    values._noted.clear()
    # without a copy that verifies in time, the record carries none (readers then look at the store's)
    t0 = time.monotonic()
    assert "topology" not in json.loads(signed.end_record(final, "n1", store, timeout_s=0.3))
    assert 0.3 <= time.monotonic() - t0 < 5


def test_the_store_listens_on_the_given_address_only() -> None:
    server = serve_store("127.0.0.2", 0)
    want = f"0200007F:{server.port:04X}"  # /proc/net/tcp: little-endian IPv4, state 0A = LISTEN
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and line.split()[1].endswith(f":{server.port:04X}")]
    assert listening == [want], listening
    listening6 = [line.split()[1] for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]
                  if line.split()[3] == "0A" and line.split()[1].endswith(f":{server.port:04X}")]
    assert listening6 == []
    with pytest.raises(UserError, match="cannot listen there"):
        serve_store("192.0.2.77", 0)  # TEST-NET-1: not an address of this machine


_LATE_PEER = r'''
import sys, time, torch, torch.distributed as dist
from phoenixft.distributed.comm import EpochComm
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
comm = EpochComm(store, 0, 1, 2, 30.0)
buf = torch.full((1 << 18,), 1.0)
time.sleep(2.0)                         # the late peer (a healed partition) completes the old collective
try:
    comm.train.allreduce([buf]).wait()
    print("R1 completed", flush=True)
except Exception as e:
    print("R1 failed", str(e)[:80], flush=True)
'''


def test_an_abandoned_collective_cannot_be_completed_by_a_late_peer(tmp_path: Path) -> None:
    """A peer that comes back after its epoch was retired (a healed partition) must not complete the old
    all-reduce into the survivor's reused buffer (without the severing in EpochComm.retire it does: 8.0)."""
    import torch
    import torch.distributed as dist

    from phoenixft.distributed.comm import EpochComm

    script = tmp_path / "late_peer.py"
    script.write_text(_LATE_PEER)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    peer = subprocess.Popen([sys.executable, str(script), str(server.port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        comm = EpochComm(dist.TCPStore("127.0.0.1", server.port, is_master=False), 0, 0, 2, 30.0)
        buf = torch.full((1 << 18,), 0.0)
        work = comm.train.allreduce([buf])  # rank 1 is "cut off": it joins 2 s later
        time.sleep(0.5)
        comm.retire()  # what Worker.recover() does
        buf.fill_(7.0)  # the buffer is reused by the next epoch
        out = peer.communicate(timeout=120)[0]
        time.sleep(0.5)
        assert (float(buf.min()), float(buf.max())) == (7.0, 7.0), "a retired collective wrote into a reused buffer"
        assert "R1 failed" in out, out
        assert work.is_completed()  # failed, not pending forever
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=10)


def test_partition_faults_and_mode_errors_name_the_flag() -> None:
    f = parse_fault("partition:node=2@step=9,for=8,wait=60")
    assert (f.kind, f.nodes, f.step, f.duration, f.wait) == ("partition", (2,), 9, 8.0, 60.0)
    for bad, why in (("partition:node=1,2@step=3", "expected"), ("partition:node=1@step=3,for=0", "> 0 seconds"),
                     ("kill:node=1@step=3,for=2", "only for partition")):
        with pytest.raises(UserError, match=why):
            parse_fault(bad)
    with pytest.raises(UserError, match="a partition needs hosts with their own addresses"):
        check_mode(RunConfig(nodes=3, inject=["partition:node=1@step=3"]), local=True)
    with pytest.raises(UserError, match="the workers that fire it sit on other hosts"):
        check_mode(RunConfig(nodes=3, inject=["kill:coordinator@step=3"]), local=False)
    with pytest.raises(UserError, match="--repair-after=5 is invalid here"):
        check_mode(RunConfig(nodes=3, repair_after=5.0), local=False)
    with pytest.raises(UserError, match=r"--token is invalid: a job token needs at least 16 characters"):
        auth.check_token("short", "--token")
    from phoenixft.runtime.agent import main as agent_main

    with pytest.raises(UserError, match="--node='bad name' is invalid"):
        agent_main(["--coordinator", "127.0.0.1:1", "--node", "bad name"])
    with pytest.raises(UserError, match="--node=n1 --spare is contradictory"):
        agent_main(["--coordinator", "127.0.0.1:1", "--node", "n1", "--spare"])


@pytest.mark.slow
def test_a_local_run_refuses_an_agent_without_the_token(tmp_path: Path) -> None:
    """`phoenixft run` admits only its own agents (the launcher gives them its token): one started by hand
    without the token is refused with one line, exit code 2, and the run is unaffected."""
    from conftest import run

    out: dict[str, Any] = {}

    def stranger() -> None:
        deadline = time.monotonic() + 120
        while not (tmp_path / "coordinator.port").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = (tmp_path / "coordinator.port").read_text()
        env = {k: v for k, v in os.environ.items() if k != auth.TOKEN_ENV}
        env["PYTHONPATH"] = str(REPO / "src")
        out["p"] = subprocess.run([sys.executable, "-m", "phoenixft", "agent", "--coordinator", f"127.0.0.1:{port}",
                                   "--node", "s7", "--join-timeout", "60"], capture_output=True, text=True,
                                  timeout=120, env=env)

    t = threading.Thread(target=stranger, daemon=True)
    t.start()
    rep = run(tmp_path, nodes=2, spares=0, steps=80, model="tiny")  # (tiny: it outlasts the stranger's start-up)
    t.join(timeout=120)
    p = out["p"]
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "refused to admit 's7'" in p.stderr and "presented no token" in p.stderr, p.stderr
    assert rep["state"] == "done" and "s7" not in rep.get("members", {})


def test_an_agent_waiting_for_admission_stops_when_the_run_ends() -> None:
    # a run stopped (Ctrl-C, SIGTERM) while its agents were joining: they must not wait out --join-timeout
    # (forked from the warm zygote they reach the store before the coordinator admits anyone)
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    store.set(keys.RUN_STATE, "aborted")  # not signed: not the run's end
    with pytest.raises(UserError, match=r"did not answer the join request of 'n0' within 1s"):
        auth.request_admission(store, {"name": "n0", "host": "127.0.0.1"}, TOKEN, 1.0, "127.0.0.1:1")
    signed.set_signed(store, TOKEN, "run1", keys.RUN_STATE, "aborted")
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"ended \(aborted\) before 'n0' was admitted"):
        auth.request_admission(store, {"name": "n0", "host": "127.0.0.1"}, TOKEN, 60.0, "127.0.0.1:1")
    assert time.monotonic() - t0 < 5.0


def test_an_agent_for_another_run_is_refused_before_it_asks_to_join() -> None:
    """--run-id was checked only once admitted, so a refused agent held an active slot and the job
    waited for it until --join-timeout ("only 2 of 2 node(s) joined")."""
    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "0123abcd45")
    signed.set_signed(store, TOKEN, "0123abcd45", keys.CONFIG, RunConfig(nodes=2).to_json())
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "phoenixft", "agent", "--coordinator", server.addr, "--node", "x",
                        "--workers", "1", "--run-id", "ffff", "--join-timeout", "60"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PHOENIXFT_TOKEN=TOKEN))
    assert p.returncode == 2, p.stderr
    assert "--run-id=ffff is not the run of the coordinator" in p.stderr and "(0123abcd45)" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30.0  # refused at once, not after waiting to be admitted
    assert not store.check([keys.ADMIT_SEQ])  # it never asked


def test_a_planner_that_raises_fails_the_run_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovery planner is pure: an exception in it would come back at every restart of the coordinator
    (the launcher restarts it, until "the coordinator keeps exiting"). The coordinator fails the run in one
    line that names the exception instead."""
    from phoenixft import coordinator as coord_mod
    from phoenixft.coordinator import decide as decide_mod
    from phoenixft.distributed.topology import Topology
    from phoenixft.recovery.planner import Descriptor

    server = serve_store("127.0.0.1", 0)
    store = _client(server)
    store.set(keys.RUN_ID, "run1")
    signed.set_signed(store, TOKEN, "run1", keys.CONFIG, RunConfig(nodes=2, spares=0).to_json())
    coord = coord_mod.Coordinator(store, token=TOKEN)
    old = Topology(epoch=0, nodes=["n0", "n1"], workers_per_node=1, replicas=1, resume_step=0)
    coord.state.topo = old
    sealed.put(store, keys.desc(0, "n0.0"), json.dumps(Descriptor(wid="n0.0", params=[3]).to_json()))

    def broken(pi: Any) -> Any:
        raise KeyError("pp0.tp0.dp0of3")

    monkeypatch.setattr(decide_mod, "plan_recovery", broken)
    coord.decider.decide(old, time.time(), {"n1"}, set(), set())
    assert store.get(keys.RUN_STATE) == b"failed"
    err = sealed.get(store, keys.RUN_ERROR).decode()
    assert "\n" not in err and "the recovery planner failed (KeyError: 'pp0.tp0.dp0of3')" in err, err
