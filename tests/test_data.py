"""Real data: token files (`--data`), their sampling rule, `phoenixft prepare-data`, validation, one training run."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run

from phoenixft.cli.main import main
from phoenixft.data import _mix
from phoenixft.workload import Workload, WorkloadContext, load_workload

BLOCK = 64  # the tiny preset's block_size: windows of 65 tokens


def gpt(data: str, *, micro_batch: int = 4, microbatches: int = 2, seed: int = 7, dtype: str = "uint16") -> Workload:
    ctx = WorkloadContext(seed=seed, micro_batch=micro_batch, model="tiny", microbatches=microbatches, data=data,
                          data_dtype=dtype)
    return load_workload("phoenixft.gpt:workload", ctx)


def digest(b: tuple[torch.Tensor, torch.Tensor]) -> str:
    return hashlib.sha256(b[0].numpy().tobytes() + b[1].numpy().tobytes()).hexdigest()


@pytest.fixture(autouse=True)
def _private_vocab_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test computes (and caches) vocabularies on its own; the stdlib corpus cache stays shared."""
    import phoenixft.data as data

    monkeypatch.setattr(data, "_vocab_memo", {})
    monkeypatch.setattr(data, "_vocab_cache_dir", lambda: tmp_path / "vocab-cache")


def windowed(tmp: Path, n_windows: int, extra: int = 7, base: int = 70_000) -> Path:
    """A directory (nanoGPT layout, uint32, no sidecar) whose train token at offset i is base + i."""
    d = tmp / "ids"
    d.mkdir()
    (np.arange(n_windows * (BLOCK + 1) + extra, dtype=np.uint32) + base).tofile(d / "train.bin")
    np.arange(3 * (BLOCK + 1), dtype=np.uint32).tofile(d / "val.bin")
    return d


def window_of(row: torch.Tensor, base: int = 70_000) -> int:
    off = int(row[0]) - base
    assert off % (BLOCK + 1) == 0, "rows start on window boundaries"
    return off // (BLOCK + 1)


# ------------------------------------------------------------------------------------ sampling
def test_every_window_exactly_once_per_epoch_and_epochs_differ(tmp_path: Path) -> None:
    n = 40
    d = windowed(tmp_path, n)
    micro_batch, microbatches = 3, 2  # 40 is no multiple of 3: one microbatch straddles each epoch boundary
    wl = gpt(str(d), micro_batch=micro_batch, microbatches=microbatches, dtype="uint32")
    seen: list[int] = []  # in global sample order g
    for step in range(1, 16):
        for index in range(microbatches):
            x, y = wl.batch(step, index)
            assert x.shape == y.shape == (micro_batch, BLOCK) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen += [window_of(r) for r in x]
    epochs = [seen[e * n : (e + 1) * n] for e in range(2)]
    for order in epochs:
        assert sorted(order) == list(range(n)), "every window exactly once per epoch"
    assert epochs[0] != epochs[1], "each epoch has its own order"
    assert len(set(seen[2 * n :])) == len(seen[2 * n :]), "epoch 2 begins without repeats"


def test_same_seed_step_index_same_batch_also_in_a_fresh_process(tmp_path: Path) -> None:
    d = windowed(tmp_path, 50)
    keys = [(1, 0), (1, 1), (9, 1), (30, 0)]
    here = [digest(gpt(str(d), dtype="uint32").batch(s, i)) for s, i in keys]
    assert here == [digest(gpt(str(d), dtype="uint32").batch(s, i)) for s, i in keys]  # a fresh workload
    assert len(set(here)) == len(here)
    code = (
        "import hashlib, sys\n"
        "from phoenixft.workload import WorkloadContext, load_workload\n"
        f"wl = load_workload('phoenixft.gpt:workload', WorkloadContext(seed=7, micro_batch=4, model='tiny', "
        f"microbatches=2, data={str(d)!r}, data_dtype='uint32'))\n"
        f"for s, i in {keys!r}:\n"
        "    x, y = wl.batch(s, i)\n"
        "    print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == here
    assert digest(gpt(str(d), seed=8, dtype="uint32").batch(1, 0)) != here[0], "the seed matters"


def test_uint32_single_file_vocab_follows_the_data(tmp_path: Path) -> None:
    f = tmp_path / "big.bin"
    ids = np.random.default_rng(0).integers(0, 70_000, size=20 * (BLOCK + 1), dtype=np.uint32)
    ids[5] = 69_999
    ids.tofile(f)
    wl = gpt(str(f), dtype="uint32")
    model = wl.build_model()
    assert model.wte.weight.shape[0] == 70_000  # max token id + 1
    x, y = wl.batch(3, 1)
    assert int(x.max()) < 70_000 and wl.loss(model, (x, y)).isfinite()
    train_end = int(len(ids) * 0.95)  # one file: the last 5% is held out
    ex, _ = wl.eval_batch(0)
    held = set(ids[train_end:].tolist())
    assert set(ex.flatten().tolist()) <= held
    # read as uint16 the same bytes are another (valid, even-sized) file; the sidecar JSON decides instead
    (tmp_path / "big.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 80_000}))
    assert gpt(str(f), dtype="uint16").build_model().wte.weight.shape[0] == 80_000


def test_directory_layout_with_meta_json(tmp_path: Path) -> None:
    d = tmp_path / "owt"
    d.mkdir()
    rng = np.random.default_rng(1)
    rng.integers(0, 300, size=10 * (BLOCK + 1), dtype=np.uint16).tofile(d / "train.bin")
    val = rng.integers(0, 300, size=4 * (BLOCK + 1) + 3, dtype=np.uint16)
    val.tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 512}))
    wl = gpt(str(d), micro_batch=3)
    assert wl.build_model().wte.weight.shape[0] == 512
    windows = val[: 4 * (BLOCK + 1)].reshape(4, BLOCK + 1).astype(np.int64)
    x, y = wl.eval_batch(1)  # consecutive held-out windows 3, 4 -> 0 (wrapping), 1 ... as a pure function of index
    assert x.tolist() == windows[[3, 0, 1], :-1].tolist() and y.tolist() == windows[[3, 0, 1], 1:].tolist()
    assert digest(wl.eval_batch(1)) == digest(gpt(str(d), micro_batch=3, seed=99).eval_batch(1))


def test_builtin_corpus_has_eval_batches() -> None:
    wl = load_workload("phoenixft.gpt:workload", WorkloadContext(seed=1, micro_batch=2, model="tiny"))
    assert wl.eval_batch is not None
    a, b = wl.eval_batch(0), wl.eval_batch(0)
    assert a[0].shape == (2, BLOCK) and digest(a) == digest(b) and digest(a) != digest(wl.eval_batch(1))


# ------------------------------------------------------------------------------------ prepare-data
def texts(tmp: Path) -> list[Path]:
    a, b = tmp / "a.txt", tmp / "b.txt"
    a.write_bytes("héllo wörld\n".encode() * 50)
    b.write_bytes(bytes(range(256)) * 4)
    return [a, b]


def test_prepare_data_single_file_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = texts(tmp_path)
    out = tmp_path / "out" / "text.bin"
    out.parent.mkdir()
    assert main(["prepare-data", *map(str, src), "--out", str(out)]) == 0
    raw = b"".join(p.read_bytes() for p in src)
    tokens = np.fromfile(out, dtype=np.uint16)
    assert tokens.astype(np.uint8).tobytes() == raw and int(tokens.max()) == 255
    meta = json.loads((tmp_path / "out" / "text.bin.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["tokens"] == len(raw)
    assert meta["sha256"] == hashlib.sha256(raw).hexdigest() and len(meta["sources"]) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["text.bin", "text.bin.json"], "no temporary left"
    assert "tokens" in capsys.readouterr().out


def test_prepare_data_single_file_creates_its_directory(tmp_path: Path) -> None:
    """README's `prepare-data notes/*.txt --out data/notes.bin` where data/ does not exist yet (a DIR output
    was created, a .bin one failed: "--out=... is not writable: No such file or directory")."""
    out = tmp_path / "data" / "deeper" / "notes.bin"
    assert main(["prepare-data", *map(str, texts(tmp_path)), "--out", str(out)]) == 0
    assert out.is_file() and (out.parent / "notes.bin.json").is_file()


def test_prepare_data_directory_layout(tmp_path: Path) -> None:
    src = texts(tmp_path)
    out = tmp_path / "ds"
    assert main(["prepare-data", *map(str, src), "--out", str(out), "--val-fraction", "0.1"]) == 0
    raw = b"".join(p.read_bytes() for p in src)
    train = np.fromfile(out / "train.bin", dtype=np.uint16).astype(np.uint8).tobytes()
    val = np.fromfile(out / "val.bin", dtype=np.uint16).astype(np.uint8).tobytes()
    assert train + val == raw and len(val) == len(raw) - int(len(raw) * 0.9)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (len(train), len(val), 256)
    wl = gpt(str(out))
    assert wl.build_model().wte.weight.shape[0] == 256
    assert bytes(wl.eval_batch(0)[0][0].tolist()) == val[:BLOCK]


def test_prepare_data_shows_progress_on_large_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import phoenixft.train.prepare_data as pd

    monkeypatch.setattr(pd, "PROGRESS_MIN_BYTES", 1)
    src = texts(tmp_path)
    assert main(["prepare-data", *map(str, src), "--out", str(tmp_path / "t.bin")]) == 0
    total = sum(p.stat().st_size for p in src)
    assert f"/ {total / (1 << 20):.1f} MiB (100%)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "input 'TMP/nope.txt' does not exist"),
        ("empty", "the input is empty (0 bytes in 1 file(s))"),
        ("unwritable", "is not writable: Not a directory"),
        ("fraction", "--val-fraction=1.5 is invalid: must be > 0 and < 1"),
    ],
)
def test_prepare_data_bad_input_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  case: str, needle: str) -> None:
    good = texts(tmp_path)[0]
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "afile").write_text("x")
    args = {
        "missing": [str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o.bin")],
        "empty": [str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o.bin")],
        "unwritable": [str(good), "--out", str(tmp_path / "afile" / "o.bin")],
        "fraction": [str(good), "--out", str(tmp_path / "o"), "--val-fraction", "1.5"],
    }[case]
    assert main(["prepare-data", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle.replace("TMP", str(tmp_path)) in lines[0], err
    assert not list(tmp_path.glob("**/.*.tmp*")) and not (tmp_path / "o.bin").exists()


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "--data='TMP/nope.bin' is invalid: no such file or directory"),
        ("empty", "--data='TMP/empty.bin' is invalid: empty.bin is empty"),
        ("odd", "--data='TMP/odd.bin' is invalid: odd.bin has 131 bytes, not a multiple of 2 (uint16 token ids)"),
        ("short", "its train split has 32 tokens, shorter than one window of block_size+1 = 65 tokens"),
        ("nodir", "--data='TMP' is invalid: the directory has no train.bin"),
        ("dtype", "--data-dtype='int8' is invalid: one of uint16, uint32"),
        # a sidecar's vocab_size below a token id: the first batch failed with "IndexError: index out of range"
        ("vocab", "--data='TMP/v' is invalid: its metadata TMP/v/meta.json says vocab_size 100, but the data holds "
                  "token id 255: vocab_size must be larger than every token id (256 or more)"),
    ],
)
def test_bad_data_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                    needle: str) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"x" * 131)
    np.zeros(34, dtype=np.uint32).tofile(tmp_path / "short.bin")  # 34 tokens: 32 of them train
    (tmp_path / "v").mkdir()
    for name in ("train.bin", "val.bin"):
        (np.arange(1000) % 256).astype(np.uint16).tofile(tmp_path / "v" / name)
    (tmp_path / "v" / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 100}')
    args = {
        "missing": ["--data", str(tmp_path / "nope.bin")],
        "empty": ["--data", str(tmp_path / "empty.bin")],
        "odd": ["--data", str(tmp_path / "odd.bin")],
        "short": ["--data", str(tmp_path / "short.bin"), "--data-dtype", "uint32"],
        "nodir": ["--data", str(tmp_path)],
        "dtype": ["--data-dtype", "int8"],
        "vocab": ["--data", str(tmp_path / "v")],
    }[case]
    assert main(["run", "--nodes", "2", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle.replace("TMP", str(tmp_path)) in lines[0], err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------ end to end
def stdlib_text(tmp: Path, size: int = 300_000) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.glob("*.py")):
        out.append(p)
        total += p.stat().st_size
        if total >= size:
            break
    return out


def test_training_on_a_prepared_token_file(tmp_path: Path) -> None:
    data = tmp_path / "stdlib.bin"
    assert main(["prepare-data", *map(str, stdlib_text(tmp_path)), "--out", str(data)]) == 0
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=30, model="tiny", data=str(data))
    assert rep["state"] == "done", rep
    loss = rep["loss"]
    assert len(loss) == 30 and sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.5, loss
    # the workers trained on this file: step 1's loss is the one computed here on its first two microbatches
    wl = gpt(str(data), micro_batch=rep["config"]["micro_batch"], microbatches=2, seed=1234)
    torch.manual_seed(1234)
    model = wl.build_model()
    first = 0.0
    with torch.no_grad():
        for mb in range(2):
            torch.manual_seed(_mix(1234, 1, mb))
            first += float(wl.loss(model, wl.batch(1, mb))) / 2
    assert abs(loss[0] - first) <= 1e-5 * first, (loss[0], first)
