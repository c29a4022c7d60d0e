"""The persistent tier: DCP checkpoints off the critical path, fallback when replicas are lost, resume."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run

from phoenixft.controlplane import keys
from phoenixft.protect import persist
from phoenixft.protect.persist import Persister, latest_manifest


def test_owner_and_replica_lost_falls_back_to_persistent_tier(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference(nodes=4, steps=12)
    ckpt = tmp_path / "ckpt"
    rep = run(tmp_path / "run", nodes=4, spares=2, replicas=1, steps=12, persist_every=4, persist_dir=str(ckpt),
              inject=["kill:node=0,1@step=10,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    assert rec["action"] == "persistent"
    # the newest checkpoint complete when the decision was made: 8, or 4 if 8's write was still running
    assert rec["persistent_step"] in (4, 8) and rec["resumed_step"] == rec["persistent_step"]
    assert rec["replayed_steps"] == 9 - rec["persistent_step"]  # only the steps since the checkpoint
    assert rep["final_state_sha256"] == ref["final_state_sha256"]
    man = latest_manifest(ckpt)
    assert man is not None and man["step"] == 12 and man["shards"] == 4  # still written after the fallback


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`phoenixft export ARGS` in this process (its exit code, its stderr): a new interpreter would spend
    seconds importing torch first. (test_export_to_a_path_that_cannot_be_written_is_one_line runs the command.)"""
    from phoenixft.cli.main import main

    capsys.readouterr()
    rc = main(["export", *args])
    return rc, capsys.readouterr().err


def test_torn_checkpoint_is_never_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    rep = run(tmp_path / "a", nodes=2, spares=0, steps=8, persist_every=4, persist_dir=str(ckpt))
    assert latest_manifest(ckpt)["step"] == 8  # type: ignore[index]
    assert rep["persist_problems"] == []
    (ckpt / "step_00000008" / "MANIFEST.json").unlink()  # as if the write of step 8 had been torn
    assert latest_manifest(ckpt)["step"] == 4  # type: ignore[index]
    # a shard file lost from a complete checkpoint: exporting it is one line naming the file, exit 2
    (ckpt / "step_00000004" / "rank1" / ".metadata").unlink()
    rc, err = _export(capsys, str(ckpt), "--out", str(tmp_path / "m.pt"), "--format", "pt")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert f"{ckpt / 'step_00000004' / 'rank1' / '.metadata'} is missing" in err, err


def test_a_checkpoint_that_cannot_be_written_is_in_the_report(tmp_path: Path) -> None:
    """The disk refuses step 4's checkpoint (a file where its directory goes): the run goes on, step 8's
    checkpoint completes, and the report names step 4 for every rank (persist_problems)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_00000004").write_text("not a directory")
    rep = run(tmp_path / "a", nodes=2, spares=0, steps=8, persist_every=4, persist_dir=str(ckpt))
    assert rep["state"] == "done", rep.get("error")
    assert latest_manifest(ckpt)["step"] == 8  # type: ignore[index]
    assert sorted((p["kind"], p["step"], p["rank"]) for p in rep["persist_problems"]) == [
        ("persist_failed", 4, 0), ("persist_failed", 4, 1)], rep["persist_problems"]


def _flip(f: Path) -> None:
    """Two bytes in the middle of `f` inverted (what a bad disk or a stray write leaves)."""
    b = bytearray(f.read_bytes())
    i = len(b) // 2
    b[i] ^= 0xFF
    b[i + 1] ^= 0xFF
    f.write_bytes(b)


def _damage(f: Path, how: str) -> str:
    """Damage a checkpoint file; returns what the skip line must say about it."""
    if how == "flipped":
        _flip(f)
        return "does not match the checksum written with it"
    if how == "truncated":
        os.truncate(f, 1000)
        return "is truncated (1000 bytes"
    f.unlink()
    return "is missing"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints of steps 4 and 8 of a failure-free 2-node run (copied by each test that damages them)."""
    base = tmp_path_factory.mktemp("ckpt")
    rep = run(base / "run", nodes=2, spares=0, steps=8, persist_every=4, persist_dir=str(base / "ckpt"))
    assert rep["state"] == "done", rep.get("error")
    assert sorted(p.parent.name for p in (base / "ckpt").glob("step_*/MANIFEST.json")) == [
        "step_00000004", "step_00000008"]
    return base / "ckpt"


def _skip_events(run_dir: Path) -> list[dict[str, Any]]:
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in evs if e["kind"] == "checkpoint_skipped"]


@pytest.mark.parametrize("how", ["flipped", "truncated",
                                 pytest.param("missing", marks=pytest.mark.slow)])  # (suite time)
def test_resume_skips_a_damaged_checkpoint_for_the_newest_that_verifies(  # type: ignore[no-untyped-def]
        tmp_path: Path, checkpoints: Path, reference, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The newest checkpoint's shard file has flipped bytes, is truncated or is missing: --resume never
    loads it, says so in one line (step, file, why; also an event), resumes from the older one that
    verifies, and ends bitwise where the failure-free run of the same steps ends."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints, ckpt)
    bad = ckpt / "step_00000008" / "rank1" / "__0_0.distcp"
    why = _damage(bad, how)
    capsys.readouterr()
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=10, resume=str(ckpt))
    err = capsys.readouterr().err
    assert rep["state"] == "done", rep.get("error")
    assert rep["first_step"] == 5  # from step 4: step 8 was skipped
    assert rep["final_state_sha256"] == reference(nodes=2, steps=10)["final_state_sha256"]
    assert rep["recoveries"] == []  # nothing was installed and then thrown away
    lines = [x for x in err.splitlines() if "skipped" in x]
    assert len(lines) == 1 and "step 8" in lines[0] and str(bad) in lines[0] and why in lines[0] \
        and "using step 4" in lines[0], err
    (ev,) = _skip_events(tmp_path / "run")
    assert (ev["step"], ev["file"], ev["using"]) == (8, str(bad), 4) and why in ev["why"], ev


def test_resume_fails_in_one_line_when_no_checkpoint_verifies(tmp_path: Path, checkpoints: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints, ckpt)
    newest = ckpt / "step_00000008" / "rank0" / "__0_0.distcp"
    whole = newest.stat().st_size
    _damage(newest, "truncated")
    _flip(ckpt / "step_00000004" / "rank1" / "__0_0.distcp")
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=10, resume=str(ckpt))
    assert rep["state"] == "failed"
    err = rep["error"]
    assert "\n" not in err and "in-memory state lost" not in err, err
    assert err == (f"--resume {ckpt}: no checkpoint verifies (the newest, step 8: {newest} is truncated "
                   f"(1000 bytes, {whole} expected))"), err
    assert [(e["step"], e["using"]) for e in _skip_events(tmp_path / "run")] == [(8, None), (4, None)]


def test_export_never_writes_a_checkpoint_that_does_not_verify(tmp_path: Path, checkpoints: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Flipped bytes in the newest checkpoint's rank-0 file (which also holds the model's buffers, not
    covered by the shard's checksum): `phoenixft export` refuses it in one line naming the file and the
    newest checkpoint that verifies, and exports that one when asked for it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints, ckpt)
    bad = ckpt / "step_00000008" / "rank0" / "__0_0.distcp"
    _flip(bad)
    out = tmp_path / "m.safetensors"
    rc, err = _export(capsys, str(ckpt), "--out", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and not out.exists(), err[-2000:]
    assert f"{bad} does not match the checksum written with it" in err and "(--step 4)" in err, err
    rc, err = _export(capsys, str(ckpt), "--out", str(out), "--step", "4")
    assert rc == 0 and out.exists(), err[-2000:]


def test_fallback_skips_a_corrupt_checkpoint(tmp_path: Path, checkpoints: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """In-run fallback (both nodes lost with their replicas): the newest complete checkpoint in
    --persist-dir does not verify (flipped bytes); the fallback skips it for the newest that does."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # a complete checkpoint newer than any this run will have written by the fallback, with bad bytes
    fake = ckpt / "step_00000009"
    shutil.copytree(checkpoints / "step_00000008", fake)
    man = json.loads((fake / "MANIFEST.json").read_text())
    (fake / "MANIFEST.json").write_text(json.dumps({**man, "step": 9}))
    _flip(fake / "rank0" / "__0_0.distcp")
    rep = run(tmp_path / "run", nodes=2, spares=2, replicas=1, steps=12, persist_every=4, persist_dir=str(ckpt),
              inject=["kill:node=0,1@step=10,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    rec, *later = rep["recoveries"]
    assert rec["action"] == "persistent" and rec["persistent_step"] in (4, 8), rec
    # (a spare still starting when the fallback is decided joins by a grow right after it)
    assert all(r["action"] == "grow" and not r["dead"] for r in later), later
    assert rep["final_state_sha256"] == reference(nodes=2, steps=12)["final_state_sha256"]
    (ev,) = _skip_events(tmp_path / "run")
    assert (ev["step"], ev["file"]) == (9, str(fake / "rank0" / "__0_0.distcp")) and "checksum" in ev["why"], ev


def test_a_resumed_run_falls_back_to_the_checkpoint_it_resumed_from(tmp_path: Path, checkpoints: Path,  # type: ignore[no-untyped-def]
                                                                    reference) -> None:
    """Resumed from step 8, both nodes (every copy of both shards) lost at step 10, before --persist-dir
    holds a checkpoint of this run: the newest state on disk is the one --resume loaded, and the run falls
    back to it. With --persist-dir alone as the persistent tier the run would be lost ("in-memory state
    lost ... and no complete persistent checkpoint"); without --persist-every, too."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints, ckpt)
    rep = run(tmp_path / "run", nodes=2, spares=2, steps=12, resume=str(ckpt), persist_every=5,
              persist_dir=str(tmp_path / "new"), inject=["kill:node=0,1@step=10,phase=backward"])
    assert rep["state"] == "done", rep.get("error")
    (rec,) = rep["recoveries"]
    assert rec["action"] == "persistent" and rec["persistent_step"] == 8 and rec["resumed_step"] == 8, rec
    assert rep["final_state_sha256"] == reference(nodes=2, steps=12)["final_state_sha256"]


@pytest.mark.slow  # (a 3D checkpoint resumed data-parallel: tests/test_mesh.py covers a resume on another layout)
def test_resume_onto_a_different_node_count(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    # the global batch must be the same on both sides: 12 microbatches split over 4, then over 3 ranks
    first = run(tmp_path / "a", nodes=4, spares=0, steps=6, microbatches=12, persist_every=6, persist_dir=str(ckpt))
    assert first["state"] == "done"
    ref = reference(nodes=4, steps=8, microbatches=12)
    resumed = run(tmp_path / "b", nodes=3, spares=0, steps=8, microbatches=12, resume=str(ckpt))
    assert resumed["state"] == "done", resumed.get("error")
    assert resumed["first_step"] == 7
    a, b = resumed["loss"][0], ref["loss"][6]
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["nodes"] == 3


_META = {"rank": 0, "shards": 1, "numel": 4, "shard_numel": 64, "epoch": 0, "seed": 1}


def _persister(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: object) -> tuple[Persister, Any]:
    """A Persister of one rank writing every step through `disk` (DCP's `save`), on a real TCPStore."""
    from phoenixft.controlplane import TcpStore, sealed

    monkeypatch.setattr(persist, "_dcp", lambda: disk)
    raw = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    sealed.bind("t" * 32, "rid")  # (what a worker writes is sealed with its run's key)
    store = TcpStore(raw, "127.0.0.1", raw.port, 10.0)
    return Persister(str(tmp_path), 1, store), store


_TAKEN: dict[int, list[dict[str, Any]]] = {}  # the events taken from each store's queue so far


def _records(store: Any) -> list[dict[str, Any]]:
    """The events so far (taken from the store's queue, as a launcher does: kept here)."""
    from phoenixft.controlplane import LogReader, sealed

    taken = _TAKEN.setdefault(id(store), [])
    taken += sealed.records(keys.EVENTS, LogReader(store, keys.EVENTS).read_bytes())
    return taken


def _events(store: Any) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in _records(store)]


def _until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_skipped_and_failed_checkpoints_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint staged while the writer is still busy with two is skipped, and one whose write
    raises never completes: each becomes an event the report lists (never silent), and the ones
    written complete."""
    gate, saved = threading.Event(), []

    class SlowDisk:
        def save(self, sd: dict[str, Any], checkpoint_id: str, no_dist: bool) -> None:
            assert gate.wait(30)
            if "step_00000003" in checkpoint_id:
                raise OSError("No space left on device")
            Path(checkpoint_id).mkdir(parents=True)
            saved.append(checkpoint_id)

    p, store = _persister(tmp_path, monkeypatch, SlowDisk())
    try:
        p.stage(1, torch.zeros(3, 64), _META)
        _until(p._q.empty)  # the writer took step 1 and waits on the disk
        for step in (2, 3, 4):  # 2 and 3 wait in the queue, 4 finds it full
            p.stage(step, torch.zeros(3, 64), _META)
    finally:
        gate.set()
        p.close(timeout_s=30)
    assert _events(store) == [("persist_skipped", 4), ("persist_failed", 3)]
    why = [e["why"] for e in _records(store)]
    assert "slower than --persist-every" in why[0] and "No space left" in why[1]
    assert len(saved) == 2 and latest_manifest(tmp_path)["step"] == 2  # type: ignore[index]


def test_the_writer_outlives_a_failed_checkpoint_and_close_is_bounded(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An error after the shard was saved (here: its directory is gone when the manifest is written)
    costs that checkpoint only: the writer goes on with the next one. And `close` returns within its
    timeout even when a write never ends."""
    stuck = threading.Event()

    class Disk:
        def save(self, sd: dict[str, Any], checkpoint_id: str, no_dist: bool) -> None:
            if "step_00000003" in checkpoint_id:
                assert not stuck.wait(60)  # a write that never ends (until the test lets it go)
            elif "step_00000002" in checkpoint_id:
                Path(checkpoint_id).mkdir(parents=True)
            # step 1: nothing created, so writing its manifest fails after the save

    p, store = _persister(tmp_path, monkeypatch, Disk())
    try:
        for step in (1, 2):
            p.stage(step, torch.zeros(3, 64), _META)
        _until(lambda: latest_manifest(tmp_path) is not None)
        assert latest_manifest(tmp_path)["step"] == 2  # type: ignore[index]
        assert _events(store) == [("persist_failed", 1)]
        for step in (3, 4, 5):  # the queue holds 4 and 5 while 3 never ends
            p.stage(step, torch.zeros(3, 64), _META)
        closer = threading.Thread(target=p.close, kwargs={"timeout_s": 1.0}, daemon=True)  # a hang fails, not hangs
        t = time.monotonic()
        closer.start()
        closer.join(10)
        assert not closer.is_alive() and time.monotonic() - t < 5.0
    finally:
        stuck.set()
        p._q.put(None, timeout=10)  # let the writer end (close gave up on it)
        p._t.join(timeout=10)


def test_export_to_a_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """--out naming a directory, a path under a file or an unwritable place is one line, not a traceback
    (IsADirectoryError, FileExistsError, safetensors' SerializeError); --step on a run directory (it applies
    to checkpoint directories) is one line naming --step."""
    from safetensors.torch import save_file

    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    save_file({"w": torch.zeros(3)}, str(run_dir / "final" / "model.safetensors"))
    (tmp_path / "afile").write_text("")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cases = [(["--out", str(tmp_path)], "is a directory"),
             (["--out", str(tmp_path / "afile" / "m.safetensors")], "afile is not a directory"),
             (["--out", "/proc/m.safetensors"], "cannot create a file there"),
             (["--out", str(tmp_path / "m.safetensors"), "--step", "3"], "--step=3 is invalid")]
    for args, why in cases:
        p = subprocess.run([sys.executable, "-m", "phoenixft", "export", str(run_dir), *args], capture_output=True,
                           text=True, timeout=120, env=env)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and why in lines[0], p.stderr[-2000:]
    out = tmp_path / "new" / "dir" / "m.safetensors"  # a missing directory is created
    p = subprocess.run([sys.executable, "-m", "phoenixft", "export", str(run_dir), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and out.exists(), p.stderr[-2000:]


def test_resume_with_another_precision_than_the_buffers_were_saved_in(tmp_path: Path, checkpoints: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint holds the model's buffers as bytes in the precision that trained them (floating buffers
    follow the parameters into bf16). Resumed with the other --precision they were read as garbage and the
    run failed a step later with "the loss of step 5 is inf (numerical error in the training itself)" (or
    a traceback, bf16 into fp32). Refused in one line; a model without buffers (the GPT) still may switch."""
    from phoenixft.cli.main import main

    bn = {"workload": "user_workload:bn_workload", "micro_batch": 16, "nodes": 2}
    rep = run(tmp_path / "a", spares=0, steps=2, persist_every=2, persist_dir=str(tmp_path / "ckpt"), **bn)
    assert rep["state"] == "done", rep.get("error")
    capsys.readouterr()
    assert main(["run", "--workload", bn["workload"], "--micro-batch", "16", "--nodes", "2", "--steps", "4",
                 "--precision", "bf16", "--resume", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"phoenixft run: error: --precision='bf16' is invalid: with --resume={tmp_path / 'ckpt'}: its "
                   "checkpoint of step 2 was written with --precision fp32 and holds the model's buffers in it; "
                   "resume it with --precision fp32"), err
    gpt = run(tmp_path / "b", nodes=2, spares=0, steps=10, precision="bf16", resume=str(checkpoints))
    assert gpt["state"] == "done" and gpt["first_step"] == 9, gpt.get("error")


def test_the_store_holds_the_records_of_checkpoints_in_flight_only(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks write 30 checkpoints (rank 1 skips one, which never completes): each manifest written deletes
    the store records of the checkpoints before it, so the store holds the newest one's only, however many
    were written."""
    from phoenixft.controlplane import keys

    class Disk:
        def save(self, sd: dict[str, Any], checkpoint_id: str, no_dist: bool) -> None:
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)

    p0, store = _persister(tmp_path, monkeypatch, Disk())
    p1 = Persister(str(tmp_path), 1, store)
    two = {**_META, "shards": 2}
    try:
        for step in range(1, 31):
            p0.stage(step, torch.zeros(3, 64), two, wait_s=10.0)
            busy = p1._q
            if step == 10:  # rank 1's writer still busy with two: it skips this one
                p1._q = queue.Queue(maxsize=1)
                p1._q.put(None)
            p1.stage(step, torch.zeros(3, 64), {**two, "rank": 1}, wait_s=0.0 if step == 10 else 10.0)
            p1._q = busy
        _until(lambda: (latest_manifest(tmp_path) or {}).get("step") == 30, timeout_s=30.0)
        assert latest_manifest(tmp_path)["step"] == 30  # type: ignore[index]
        names = [n for s in range(1, 31) for n in (keys.persist_rank(0, s, 0), keys.persist_rank(0, s, 1),
                                                   keys.persist_manifest(0, s))]
        held = [n for n in names if store.check([n])]
        assert held == [keys.persist_rank(0, 30, 0), keys.persist_rank(0, 30, 1), keys.persist_manifest(0, 30)]
    finally:
        p0.close(timeout_s=5.0)
        p1.close(timeout_s=5.0)
