"""The persistent tier: periodic torch.distributed.checkpoint (DCP) checkpoints, off the critical path.

Every `--persist-every K` steps each rank saves its optimizer shard (rows: param, exp_avg,
exp_avg_sq) as it was *committed* in memory: the replication thread copies the committed half
(which stays untouched until that thread finishes), and a persist thread writes it with
`dcp.save` to `DIR/step_<s>/rank<i>`. The last rank to finish writes `DIR/step_<s>/MANIFEST.json`
(atomically, last), so a torn checkpoint is never loaded: only directories with a manifest count.
The manifest also carries the CRC-32 of every file each rank wrote (`files`) and the checksum of
each rank's shard (`crc`): `verified_manifest` returns the newest checkpoint whose files are all
there, whole and matching them, and says which newer ones it skipped and why (`check`).
A checkpoint that is skipped (the previous ones are still being written) or fails to write is never
silent: it is printed to the node's log and recorded as a `persist_skipped` / `persist_failed`
event, which the run's report lists under `persist_problems`.

Loading reassembles the full parameter and optimizer vectors in logical order from every shard
file, so a checkpoint written by D ranks loads onto any other number (resharding). Under 3D
parallelism a rank's shard is a slice of its (pp, tp) stage: the stage's data-parallel rank 0 also
saves the stage's map onto the full model (parallel/logical.py), and loading puts every stage back
into the full model, so a checkpoint written by one layout loads onto any other.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from phoenixft.config.protection import PERSIST_CLOSE_S
from phoenixft.controlplane import Store, keys, sealed
from phoenixft.errors import NOT_INSTALLED
from phoenixft.parallel.layout import Layout
from phoenixft.parallel.logical import to_full
from phoenixft.protect.snapshot import checksum

__all__ = ["NOT_INSTALLED", "Persister", "latest_manifest", "verified_manifest", "check", "load_full", "load_into"]

KEEP = 2  # complete checkpoints kept on disk
STAGED_KEPT = 64  # checkpoints a rank remembers until a later manifest lets it delete their store records


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use: it costs ~1 s of CPU at import, which
    every worker and coordinator start would otherwise pay even without a persistent tier."""
    import torch.distributed.checkpoint as dcp

    return dcp


class _DcpLogFilter(logging.Filter):
    """Drops the records torch.distributed.checkpoint logs (on the root logger) while phoenixft calls it."""

    active = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and "distributed/checkpoint" in record.pathname.replace("\\", "/"))


_DCP_LOG = _DcpLogFilter()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP's warnings and its logged tracebacks (a missing metadata file is logged twice, with its
    traceback, before the error is raised) silenced while phoenixft calls it: its failures reach the
    user as one line (the caller's)."""
    root = logging.getLogger()
    if _DCP_LOG not in root.filters:
        root.addFilter(_DCP_LOG)
    _DcpLogFilter.active += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _DcpLogFilter.active -= 1


def _reason(e: BaseException) -> str:
    """One line for a DCP failure: its type and the last line of its message (DCP's CheckpointException
    carries each rank's traceback)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _load(sd: dict[str, torch.Tensor], path: str) -> None:
    """`dcp.load` into `sd`; a failure as an OSError naming the shard file (DCP raises CheckpointException,
    a BaseException, which `except Exception` handlers would let through)."""
    try:
        with _quiet():
            _dcp().load(sd, checkpoint_id=path, no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - see above
        raise OSError(f"checkpoint shard {path} could not be read: {_reason(e)}") from None


def load_into(sd: dict[str, torch.Tensor], path: str) -> None:
    """The tensors of `sd` (by name, with their shapes) read from one rank's checkpoint directory `path`; an
    OSError naming it when it cannot be read."""
    _load(sd, path)


def latest_manifest(root: str | os.PathLike[str], max_step: int | None = None) -> dict[str, Any] | None:
    """The newest complete checkpoint under `root` (optionally at or before `max_step`), not verified
    (`verified_manifest` reads its files)."""
    mans = _manifests(root, max_step)
    return mans[0] if mans else None


def _manifests(root: str | os.PathLike[str], max_step: int | None = None) -> list[dict[str, Any]]:
    """Every complete checkpoint under `root` (optionally at or before `max_step`), newest first."""
    out = []
    for m in Path(root).glob("step_*/MANIFEST.json"):
        try:
            man = json.loads(m.read_text())
            step = int(man["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if max_step is not None and step > max_step:
            continue
        man["path"] = str(m.parent)
        out.append(man)
    return sorted(out, key=lambda x: int(x["step"]), reverse=True)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_crcs(d: Path) -> dict[str, int]:
    """CRC-32 of every file one rank's save wrote (its data files and DCP's `.metadata`)."""
    return {p.name: _crc32(p) for p in sorted(d.iterdir()) if p.is_file()}


def _template(man: dict[str, Any], r: int) -> dict[str, torch.Tensor]:
    """The state dict rank r of this checkpoint saved (empty tensors of its shapes)."""
    nrows = int(man.get("rows", 3))
    if int(man.get("tp", 1)) * int(man.get("pp", 1)) > 1:
        _numel, shard_numel, nsegs = man["ranks"][str(r)]
        sd = {"shard": torch.empty(nrows, shard_numel)}
        if nsegs:
            sd["segments"] = torch.empty(nsegs * 3, dtype=torch.int64)
        return sd
    sd = {"shard": torch.empty(nrows, man["shard_numel"])}
    if r == 0 and man.get("buffer_bytes"):
        sd["buffers"] = torch.empty(int(man["buffer_bytes"]), dtype=torch.uint8)
    return sd


def check(man: dict[str, Any]) -> tuple[str, str] | None:
    """The first reason not to load this complete checkpoint, as (file, why), or None when it verifies:
    a rank's files must all be there and whole (the sizes DCP's metadata gives them), and match the
    checksums written with them (the CRC-32 of each file; a manifest without them: each shard is read and
    compared with its writer's checksum)."""
    root = Path(man["path"])
    files = {k: int(v) for k, v in man.get("files", {}).items()}
    crcs = man.get("crc", {})
    for r in range(int(man["shards"])):
        d = root / f"rank{r}"
        meta_file = d / ".metadata"
        if not meta_file.is_file():
            return str(meta_file), "is missing"
        try:
            with _quiet():
                meta = _dcp().FileSystemReader(str(d)).read_metadata()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            return str(meta_file), f"cannot be read ({_reason(e)[:200]})"
        shard_file = None
        for idx, info in meta.storage_data.items():
            f = d / info.relative_path
            if getattr(idx, "fqn", "") == "shard":
                shard_file = f
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                return str(f), "is missing"
            except OSError as e:
                return str(f), f"cannot be read ({e.strerror or e})"
            if size < info.offset + info.length:
                return str(f), f"is truncated ({size} bytes, {info.offset + info.length} expected)"
        mine = {k.split("/", 1)[1]: v for k, v in files.items() if k.startswith(f"rank{r}/")}
        for name, want in sorted(mine.items()):
            f = d / name
            try:
                got = _crc32(f)
            except FileNotFoundError:
                return str(f), "is missing"
            except OSError as e:
                return str(f), f"cannot be read ({e.strerror or e})"
            if got != want:
                return str(f), "does not match the checksum written with it (its bytes changed)"
        if mine:
            continue
        sd = _template(man, r)  # a checkpoint written before file checksums: read the shard, compare
        try:
            _load(sd, str(d))
        except OSError as e:
            return str(shard_file or d), f"cannot be read ({str(e).split(': ', 1)[-1][:200]})"
        if str(r) in crcs and checksum(sd["shard"]) != int(crcs[str(r)]):
            return str(shard_file or d), "does not match the checksum written with it (its bytes changed)"
    return None


def verified_manifest(root: str | os.PathLike[str], max_step: int | None = None,
                      exclude: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The newest complete checkpoint under `root` that verifies (`check`), and the newer complete ones
    skipped on the way: [{"step", "path", "file", "why"}], newest first. `exclude`: checkpoint paths not to
    use, with the reason (one the workers could not load)."""
    skipped: list[dict[str, Any]] = []
    for man in _manifests(root, max_step):
        bad = (man["path"], exclude[man["path"]]) if exclude and man["path"] in exclude else check(man)
        if bad is None:
            return man, skipped
        skipped.append({"step": int(man["step"]), "path": man["path"], "file": bad[0], "why": bad[1]})
    return None, skipped


def skipped_line(s: dict[str, Any]) -> str:
    """One line for a checkpoint `verified_manifest` skipped."""
    return f"the persistent checkpoint of step {s['step']} is skipped: {s['file']} {s['why']}"


def load_full(man: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """The full state in logical order: rows (master weights, optimizer state...) x numel from
    every shard file, the model's buffers (bytes, written by rank 0; None if the model has none),
    and the shards whose data does not match the checksum their writer committed in the manifest."""
    if int(man.get("tp", 1)) * int(man.get("pp", 1)) > 1:
        return _load_mesh(man)
    rows = []
    bad = []
    crcs = man.get("crc", {})
    nrows = int(man.get("rows", 3))
    buffers = None
    for r in range(man["shards"]):
        sd: dict[str, torch.Tensor] = {"shard": torch.empty(nrows, man["shard_numel"])}
        if r == 0 and man.get("buffer_bytes"):
            sd["buffers"] = torch.empty(int(man["buffer_bytes"]), dtype=torch.uint8)
        _load(sd, os.path.join(man["path"], f"rank{r}"))
        if str(r) in crcs and checksum(sd["shard"]) != int(crcs[str(r)]):
            bad.append(r)
        rows.append(sd["shard"])
        if "buffers" in sd:
            buffers = sd["buffers"]
    return torch.cat(rows, dim=1)[:, : man["numel"]].contiguous(), buffers, bad


def _load_mesh(man: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """A 3D checkpoint: each stage's shards concatenated, then mapped into the full model."""
    lay = Layout(int(man["shards"]), int(man["tp"]), int(man["pp"]))
    nrows, crcs, info = int(man.get("rows", 3)), man.get("crc", {}), man["ranks"]
    full = torch.zeros(nrows, int(man["numel"]))
    bad: list[int] = []
    for p in range(lay.pp):
        for t in range(lay.tp):
            parts, segs = [], None
            for r in lay.dp_group(lay.rank(p, 0, t)):
                numel, shard_numel, nsegs = info[str(r)]
                sd: dict[str, torch.Tensor] = {"shard": torch.empty(nrows, shard_numel)}
                if nsegs:
                    sd["segments"] = torch.empty(nsegs * 3, dtype=torch.int64)
                _load(sd, os.path.join(man["path"], f"rank{r}"))
                if str(r) in crcs and checksum(sd["shard"]) != int(crcs[str(r)]):
                    bad.append(r)
                parts.append(sd["shard"])
                if "segments" in sd:
                    segs = [tuple(x) for x in sd["segments"].view(-1, 3).tolist()]
            if segs is None:
                raise ValueError(f"checkpoint {man['path']}: stage pp{p}.tp{t} has no map onto the full model")
            to_full(torch.cat(parts, dim=1)[:, :numel], segs, full)
    return full, None, bad


class Persister:
    """Background DCP writer for one rank."""

    def __init__(self, root: str, every: int, store: Store, fenced: Callable[[], bool] = lambda: False) -> None:
        self.root, self.every, self.store = Path(root), every, store
        self._fenced = fenced
        self.root.mkdir(parents=True, exist_ok=True)
        # imported now, on the caller's thread: imported by the writer thread instead it took seconds while
        # training held the GIL, and the checkpoints staged meanwhile were dropped (the queue was full)
        _dcp()
        self._q: queue.Queue[tuple[int, torch.Tensor, dict[str, Any]] | None] = queue.Queue(maxsize=2)
        self.saved: list[float] = []
        # the checkpoints staged or skipped (epoch, step, ranks): their store records are deleted by whichever
        # rank writes a later manifest (every rank of its epoch has then finished them)
        self._staged: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=STAGED_KEPT)
        self._t = threading.Thread(target=self._run, name="phoenixft-persist", daemon=True)
        self._t.start()

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def stage(self, step: int, committed_half: torch.Tensor, meta: dict[str, Any],
              buffers: torch.Tensor | None = None, wait_s: float = 0.0) -> None:
        """Copy the committed snapshot now (caller guarantees it is stable), write it later. Rank 0
        also passes the model's buffers of that step (every rank holds the same). `wait_s`: how long to wait
        for a place in the queue behind the checkpoints still being written (0: skip this one instead)."""
        self._staged.append((int(meta["epoch"]), step, int(meta["shards"])))
        if buffers is not None and buffers.numel():
            meta = {**meta, "buffers": buffers.clone()}
        try:
            if wait_s > 0:
                self._q.put((step, committed_half.clone(), meta), timeout=wait_s)
            else:
                self._q.put_nowait((step, committed_half.clone(), meta))
        except queue.Full:  # the disk is slower than K steps: skip this one rather than stall training
            self._problem("persist_skipped", step, meta.get("rank"),
                          "the previous checkpoints are still being written (the disk is slower than "
                          "--persist-every steps)")

    def _problem(self, kind: str, step: int, rank: Any, why: str) -> None:
        """Say that the checkpoint of `step` will not complete: in the node's log and as a run event."""
        print(f"phoenixft persist: checkpoint of step {step} (rank {rank}) "
              f"{'skipped' if kind == 'persist_skipped' else 'not written'}: {why}", flush=True)
        try:
            sealed.append(self.store, keys.EVENTS, {"t": time.time(), "kind": kind, "step": step, "rank": rank,
                                                    "why": why})
        except Exception:  # noqa: BLE001 - the control plane is gone: the log line is all there is
            pass

    def close(self, timeout_s: float = PERSIST_CLOSE_S) -> None:
        """Finish the writes already staged (at most `timeout_s`), then stop."""
        deadline = time.monotonic() + timeout_s
        try:
            if self._t.is_alive():
                self._q.put(None, timeout=timeout_s)
        except queue.Full:
            print(f"phoenixft persist: the checkpoint writer did not finish within {timeout_s:g}s; the "
                  "checkpoints still queued are not written", flush=True)
            return
        self._t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            step, data, meta = job
            try:  # whatever goes wrong with one checkpoint, the writer lives on for the next ones
                self._write(step, data, meta)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                self._problem("persist_failed", step, meta.get("rank"), _reason(e)[:300])

    def _write(self, step: int, data: torch.Tensor, meta: dict[str, Any]) -> None:
        if self._fenced():  # a fenced node never writes into the job's checkpoints again
            return
        t0 = time.perf_counter()
        d = self.root / f"step_{step:08d}"
        sd: dict[str, torch.Tensor] = {"shard": data}
        sd.update({k: meta[k] for k in ("buffers", "segments") if k in meta})
        rank_dir = d / f"rank{meta['rank']}"
        with _quiet():
            _dcp().save(sd, checkpoint_id=str(rank_dir), no_dist=True)
        self.saved.append(time.perf_counter() - t0)
        # the CRC-32 of every file written (read back from the page cache, off the critical path): a
        # checkpoint whose bytes change on disk is never loaded (`check`)
        files = _file_crcs(rank_dir) if rank_dir.is_dir() else {}
        nsegs = int(meta["segments"].numel() // 3) if "segments" in meta else 0
        sealed.put(self.store, keys.persist_rank(meta["epoch"], step, meta["rank"]), json.dumps(
            {"crc": checksum(data), "files": files, "info": [meta["numel"], meta["shard_numel"], nsegs]}))
        names = [keys.persist_rank(meta["epoch"], step, r) for r in range(meta["shards"])]
        # the one that finds every rank's record there writes the manifest (a claim: no counter to poison)
        manifest = keys.persist_manifest(meta["epoch"], step)
        if sealed.all_present(self.store, names) and sealed.claim(self.store, manifest) and not self._fenced():
            recs = [json.loads(v or b"{}") for v in sealed.get_many(self.store, names)]
            crcs = {str(r): int(recs[r]["crc"]) for r in range(meta["shards"])}
            man = {"step": step, "shards": meta["shards"], "numel": meta.get("full_numel", meta["numel"]),
                   "shard_numel": meta["shard_numel"], "epoch": meta["epoch"], "seed": meta["seed"],
                   "rows": int(data.shape[0]), "buffer_bytes": meta.get("buffer_bytes", 0), "crc": crcs,
                   "config": meta.get("config"), "tp": meta.get("tp", 1), "pp": meta.get("pp", 1)}
            man["files"] = {f"rank{r}/{name}": crc for r in range(meta["shards"])
                            for name, crc in recs[r]["files"].items()}
            if man["tp"] * man["pp"] > 1:
                man["ranks"] = {str(r): recs[r]["info"] for r in range(meta["shards"])}
            tmp = d / "MANIFEST.json.tmp"
            tmp.write_text(json.dumps(man))
            os.replace(tmp, d / "MANIFEST.json")
            done = sorted(p.parent for p in self.root.glob("step_*/MANIFEST.json"))
            for old in done[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
            self._forget_before(step)

    def _forget_before(self, step: int) -> None:
        """Delete the store records of the checkpoints staged before `step` (complete, skipped or failed): a
        manifest of `step` means every rank of its epoch wrote `step`, so each finished the earlier ones (one
        writer per rank, in order); the store then holds the records of the checkpoints in flight only."""
        for e, s, n in [x for x in list(self._staged) if x[1] < step]:
            for name in [keys.persist_rank(e, s, r) for r in range(n)] + [keys.persist_manifest(e, s)]:
                self.store.delete_key(name)
            with contextlib.suppress(ValueError):
                self._staged.remove((e, s, n))
