"""Tests of `phoenixft report` / phoenixft.observe.html_report on a real run with two faults.

    .venv/bin/python -m pytest tests/test_html_report.py

One 30-step run (3 nodes, 2 spares, two nodes SIGKILLed) is made once per module; the report is
written from it and checked: the numbers in its tables equal those in report.json, it is
self-contained, and it renders in headless Chromium (skipped where Chromium is absent). Two
failure-free reference runs are made once per session (conftest's `reference`): the same job
unprotected (`--protect none --spares 0`), whose losses and final state the faulted run must
match bit for bit while its timings differ, and a different job (seed 4321), whose difference the
report must show. The reference curves and numbers are checked against the reference's own
report.json / metrics.jsonl / events.jsonl, read here, never against the faulted run's.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS

from phoenixft.errors import UserError
from phoenixft.observe import html_report
from phoenixft.observe.html_report import write_report

FAULTS = ["kill:node=1@step=10,phase=backward", "kill:node=0@step=20,phase=optimizer"]
STEPS = 30
OTHER_STEPS = 12  # the different-seed reference's steps
TIME_KEYS = [
    "detect_s",
    "decide_s",
    "reconfigure_s",
    "restore_params_s",
    "restore_optimizer_s",
    "join_s",
    "first_step_s",
]


class Page(HTMLParser):
    """Collects the tables (rows of data-key -> cell text, by table id), images, scripts and links."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[dict[str, str]]] = {}
        self.kv: dict[str, str] = {}  # summary table: header -> value
        self.imgs: list[str] = []
        self.tags: list[str] = []
        self.urls: list[str] = []
        self._table: str | None = None
        self._row: dict[str, str] | None = None
        self._key: str | None = None
        self._th: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        for k in ("src", "href"):
            if a.get(k):
                self.urls.append(a[k] or "")
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        elif tag == "table":
            self._table = a.get("id") or ""
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self._row = {}
        elif tag in ("td", "th"):
            self._key = a.get("data-key") if tag == "td" else None
            self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        text = "".join(self._text).strip()
        if tag == "th" and self._table == "summary":
            self._th = text
        elif tag == "td":
            if self._table == "summary" and self._th:
                self.kv[self._th] = text
            elif self._row is not None and self._key:
                self._row[self._key] = text
            self._key = None
        elif tag == "tr" and self._table is not None and self._row:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None


def parse(path: Path) -> Page:
    p = Page()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.fixture(scope="module")
def run2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rep") / "run"
    cmd = [
        sys.executable,
        "-m",
        "phoenixft",
        "run",
        "--nodes",
        "3",
        "--spares",
        "2",
        "--steps",
        str(STEPS),
        "--run-dir",
        str(d),
        "--quiet",
        *SUITE_FLAGS,  # (the micro-batch of `ref_clean`, the failure-free run it is compared with)
    ]
    for f in FAULTS:
        cmd += ["--inject", f]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def html(run2: Path) -> Path:
    return write_report(run2)


@pytest.fixture(scope="module")
def report(run2: Path) -> dict[str, Any]:
    return json.loads((run2 / "report.json").read_text())


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def test_default_path_and_self_contained(run2: Path, html: Path) -> None:
    assert html == run2 / "report.html" and html.stat().st_size > 10_000
    text = html.read_text(encoding="utf-8")
    page = parse(html)
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    assert not [u for u in page.urls if not u.startswith("data:")], "every resource must be embedded"
    assert "http://" not in text and "https://" not in text and "url(" not in text
    assert len(page.imgs) == 3  # throughput, loss, recovery breakdown
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def test_recoveries_table_equals_report_json(html: Path, report: dict[str, Any]) -> None:
    page = parse(html)
    recs = report["recoveries"]
    assert [r["fault"] for r in recs] == FAULTS  # both faults were recovered
    what, timings = page.tables["recoveries"], page.tables["recovery-timings"]
    assert len(what) == len(timings) == 2
    for row, trow, r in zip(what, timings, recs, strict=True):
        assert row["fault"] == trow["fault"] == r["fault"]
        assert row["fault_step"] == str(r["fault_step"])
        assert row["class"] == r["class"] and row["action"] == r["action"]
        done = r.get("completed_in_epoch", r["epoch"])
        assert row["epoch"] == str(r["epoch"]) + ("" if done == r["epoch"] else f" (completed in {done})")
        assert row["restarted"] == (", ".join(r.get("restarted") or []) or "-")
        assert row["dead"] == ", ".join(r["dead"]) and row["promoted"] == ", ".join(r["promoted"])
        assert row["lost_steps"] == str(r["lost_steps"]) and row["resumed_step"] == str(r["resumed_step"])
        assert row["bytes_moved"] == f"{r['bytes_moved']:,}"
        for k in ("I1", "I2", "I3", "I4"):
            assert row[k] == ("ok" if r["invariants"][k] else "FAILED")
        assert row["errors"].startswith(str(len(r["errors"])))
        for k in TIME_KEYS:
            assert r["stages"][k] is not None
            assert trow[k] == ms(r["stages"][k]), k
        assert trow["recovery_s"] == ms(r["recovery_s"])


def test_summary_faults_and_events(run2: Path, html: Path, report: dict[str, Any]) -> None:
    page = parse(html)
    kv = page.kv
    assert kv["state"] == "done"
    assert kv["steps completed"] == f"{STEPS} of {STEPS}"
    assert kv["final state sha256"] == report["final_state_sha256"]
    assert kv["median step time"].startswith(f"{ms(report['step_time_s']['median'])} ms")
    assert kv["median throughput"].endswith("tokens/s")
    faults = page.tables["faults"]
    assert [f["spec"] for f in faults] == FAULTS
    assert [f["node"] for f in faults] == ["n1", "n0"]
    events = [json.loads(x) for x in (run2 / "events.jsonl").read_text().splitlines() if x.strip()]
    shown = page.tables["events"]
    assert len(shown) == len(events)
    assert sorted(e["kind"] for e in shown) == sorted(e["kind"] for e in events)
    assert sum(e["kind"] == "fault" for e in shown) == 2


@dataclass
class Rendered:
    """A report rendered with a reference: its page, and the matplotlib figures behind its images."""

    page: Page
    figures: dict[str, Any]  # "throughput" / "loss" -> matplotlib Figure


def render_with_reference(run: Path, ref: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> Rendered:
    """write_report(run, reference=ref), keeping each figure it embeds (and checking it is embedded)."""
    figs: list[tuple[Any, str]] = []
    real_png = html_report._png

    def keep(fig: Any) -> str:
        b64 = real_png(fig)
        figs.append((fig, b64))
        return b64

    monkeypatch.setattr(html_report, "_png", keep)
    assert write_report(run, reference=ref, out=out) == out
    monkeypatch.undo()
    page = parse(out)
    # the images in the page are exactly these figures, in order
    assert page.imgs == [f"data:image/png;base64,{b64}" for _, b64 in figs]
    by_title = {}
    for fig, _ in figs:
        title = fig.axes[0].get_title()
        by_title["throughput" if title.startswith("Throughput") else "loss" if "loss" in title else title] = fig
    return Rendered(page, by_title)


def line(fig: Any, label: str) -> tuple[list[float], list[float]]:
    """(x, y) of the curve labelled `label` in the figure's first axes."""
    found = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ln in fig.axes[0].get_lines()]
    return [float(v) for v in found[0].get_xdata()], [float(v) for v in found[0].get_ydata()]


def own_step_timeline(run_dir: Path) -> tuple[list[float], list[float]]:
    """From a run directory's own files, independently of html_report: the end of each step in
    seconds since its run_start event, and the wall time since the previous step's end (the
    step's own dt for the first)."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    t0 = next(e["t"] for e in events if e["kind"] == "run_start")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics.sort(key=lambda m: m["t_end"])
    ends = [m["t_end"] - t0 for m in metrics]
    spans = [metrics[0]["dt"]] + [b["t_end"] - a["t_end"] for a, b in zip(metrics, metrics[1:], strict=False)]
    return ends, spans


def check_throughput_overlay(fig: Any, run_dir: Path, ref_dir: Path) -> None:
    """The grey reference curve is the reference run's timeline, the blue one this run's."""
    for label, d in (("reference (no failure)", ref_dir), ("this run", run_dir)):
        xs, ys = line(fig, label)
        ends, spans = own_step_timeline(d)
        assert len(xs) == len(ends) > 0 and xs == pytest.approx(ends, abs=1e-9), label
        # rate = tokens per step / span: the product is the same constant for every step of both runs
        tokens = [y * s for y, s in zip(ys, spans, strict=True)]
        assert tokens == pytest.approx([tokens[0]] * len(ends), rel=1e-9), label


@pytest.fixture(scope="module")
def ref_clean(reference: Any) -> Path:
    """Independent reference: a failure-free, unprotected run of the same job (3 nodes, same seed)."""
    return Path(reference(nodes=3, steps=STEPS)["run_dir"])


@pytest.fixture(scope="module")
def ref_other(reference: Any) -> Path:
    """A different job: seed 4321 (on one node with the same global batch of 3 microbatches, which
    keeps it cheap: one worker process instead of three), and shorter than this run: the comparison
    covers the steps both have. One thread: alone in its world, the worker would take one per core, and
    their spin-waits beside the suite's other processes made its steps ten times slower."""
    return Path(reference(nodes=1, microbatches=3, steps=OTHER_STEPS, seed=4321, threads=1)["run_dir"])


@pytest.mark.slow  # (see README, Tests: covered in `make test` by a broader run)
def test_reference_overlay_from_independent_failure_free_run(
    run2: Path, report: dict[str, Any], ref_clean: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = json.loads((ref_clean / "report.json").read_text())
    # the reference really is another run: no faults, no protection, its own timings
    assert ref["faults"] == [] and ref["recoveries"] == [] and ref["config"]["protect"] == "none"
    assert ref["run_id"] != report["run_id"]
    assert ref["step_time_s"]["median"] != report["step_time_s"]["median"]
    # the feature's promise: two recoveries later, the same losses and the same final state, bit for bit
    assert len(report["recoveries"]) == 2
    assert report["loss"] == ref["loss"] and len(ref["loss"]) == STEPS
    assert report["final_state_sha256"] == ref["final_state_sha256"]

    out = tmp_path / "sub" / "with_ref.html"
    r = render_with_reference(run2, ref_clean, out, monkeypatch)
    kv = r.page.kv
    assert kv["reference run"] == str(ref_clean)
    assert kv["final state vs reference"] == "bitwise identical"
    assert kv["loss vs reference"] == f"max |difference| over {STEPS} steps: 0"
    ratio = report["step_time_s"]["median"] / ref["step_time_s"]["median"]
    assert kv["median step time vs reference"] == f"{ratio:.3f}x"
    # loss overlay: the reference's losses (read from its report.json) under this run's
    rx, ry = line(r.figures["loss"], "reference (no failure)")
    assert rx == list(range(1, STEPS + 1)) and ry == ref["loss"]
    assert line(r.figures["loss"], "this run")[1] == report["loss"]
    check_throughput_overlay(r.figures["throughput"], run2, ref_clean)
    # the two timelines differ (the faulted run has two recoveries in it)
    assert line(r.figures["throughput"], "reference (no failure)")[0] != line(r.figures["throughput"], "this run")[0]


def test_reference_from_a_different_seed_shows_the_difference(
    run2: Path, report: dict[str, Any], ref_other: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = json.loads((ref_other / "report.json").read_text())
    assert other["config"]["seed"] != report["config"]["seed"]
    assert other["final_state_sha256"] != report["final_state_sha256"]
    n = min(len(other["loss"]), len(report["loss"]))
    diff = max(abs(a - b) for a, b in zip(report["loss"][:n], other["loss"][:n], strict=True))
    assert n == OTHER_STEPS < len(report["loss"]) and diff > 0

    r = render_with_reference(run2, ref_other, tmp_path / "other.html", monkeypatch)
    kv = r.page.kv
    assert kv["reference run"] == str(ref_other)
    assert kv["final state vs reference"] == f"DIFFERENT (reference {other['final_state_sha256']})"
    assert kv["loss vs reference"] == f"max |difference| over {n} steps: {diff:.3g}"
    ratio = report["step_time_s"]["median"] / other["step_time_s"]["median"]
    assert kv["median step time vs reference"] == f"{ratio:.3f}x"
    _, ry = line(r.figures["loss"], "reference (no failure)")
    assert ry == other["loss"] and ry != report["loss"]
    assert line(r.figures["loss"], "this run")[1] == report["loss"]
    check_throughput_overlay(r.figures["throughput"], run2, ref_other)


def test_cli_and_errors(run2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft.cli import cmd_report

    ap = argparse.ArgumentParser(prog="phoenixft")
    cmd_report.add_parser(ap.add_subparsers(dest="command"))
    out = tmp_path / "r.html"
    args = ap.parse_args(["report", str(run2), "--out", str(out)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.exists()
    with pytest.raises(UserError, match="does not exist"):
        write_report(tmp_path / "missing")
    with pytest.raises(UserError, match="no report.json"):
        write_report(tmp_path)
    with pytest.raises(UserError, match="reference run directory .* does not exist"):
        write_report(run2, reference=tmp_path / "nope", out=tmp_path / "x.html")
    # a run that failed before its first step still gets a report
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "report.json").write_text(
        json.dumps({"state": "failed: did not start", "config": {"steps": 5}})
    )
    text = write_report(failed).read_text()
    assert "failed: did not start" in text and "No step metrics" in text and "No recoveries" in text


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (Debian: apt-get install chromium)"
)
def test_renders_in_headless_chromium(html: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    assert CHROMIUM is not None
    png = tmp_path / "shot.png"
    base: list[str] = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--enable-logging=stderr",
        "--v=0",
    ]
    with tempfile.TemporaryDirectory() as prof:  # (one browser for both: the screenshot and the DOM it built)
        p = subprocess.run(
            [
                *base,
                f"--user-data-dir={prof}",
                f"--screenshot={png}",
                "--window-size=1200,2000",
                "--dump-dom",
                f"file://{html}",
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert p.returncode == 0, p.stderr[-2000:]
    bad = [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln or "net::ERR_" in ln]
    assert not bad, bad
    img = imread(str(png))
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    colours = {tuple(px) for px in (img[::2, ::2, :3] * 255).astype("uint8").reshape(-1, 3).tolist()}
    assert len(colours) > 200, f"screenshot looks blank: {len(colours)} distinct colours"
    dom = Page()
    dom.feed(p.stdout)
    assert len(dom.imgs) == 3 and len(dom.tables["recovery-timings"]) == 2


def test_faults_matched_to_recoveries(run2: Path, report: dict[str, Any], tmp_path: Path) -> None:
    """Each fault names the recovery that answered it; a fault nothing recovered from has none."""
    d = tmp_path / "extra"
    d.mkdir()
    t = report["faults"][0]["t"] + 0.5
    extra = {
        "t": t,
        "kind": "fault",
        "spec": "corrupt:node=2@step=12",
        "index": 2,
        "fault": "corrupt",
        "node": "n2",
        "slot": 2,
        "step": 12,
        "epoch": 1,
    }
    (d / "report.json").write_text(json.dumps({**report, "faults": [*report["faults"], extra]}))
    shutil.copy(run2 / "metrics.jsonl", d / "metrics.jsonl")
    shutil.copy(run2 / "events.jsonl", d / "events.jsonl")
    rows = parse(write_report(d)).tables["faults"]
    assert [r["recovery"] for r in rows] == ["#1 (hotswap)", "#2 (hotswap)", "-"]
    assert [r["kind"] for r in rows] == ["kill", "kill", "corrupt"]


def test_validation_loss_in_the_report_and_the_progress_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--eval-every` records: points on the loss chart, a summary row (a replayed step counts once),
    and `val X.XXXX` on the progress line from the first evaluation on. No run needed."""
    from phoenixft.observe.display import Display

    d = tmp_path / "run"
    d.mkdir()
    metrics = [{"step": s, "loss": 5.0 - 0.1 * s, "dt": 0.1, "t_end": 100.0 + s, "epoch": 0, "world": 2,
                **({"val_loss": 5.5 - 0.1 * s} if s % 3 == 0 else {})} for s in range(1, 10)]
    stale = {**metrics[5], "val_loss": 9.9}
    metrics.insert(5, stale)  # step 6 recorded twice (replayed after a recovery): the last record wins
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "report.json").write_text(json.dumps({"run_id": "v", "state": "done", "steps_completed": 9,
                                               "loss": [m["loss"] for m in metrics if m is not stale],
                                               "config": {"steps": 9}}))
    val = html_report.val_series(html_report.load_run(d))
    assert [s for s, _ in val] == [3, 6, 9] and [v for _, v in val] == pytest.approx([5.2, 4.9, 4.6])
    page = parse(write_report(d))
    assert page.kv["validation loss"] == "4.6000 at step 9 (first 5.2000 at step 3; 3 evaluation(s))"
    assert len(page.imgs) >= 2 and all(i.startswith("data:image/png;base64,") for i in page.imgs)

    disp = Display(steps=9)
    for m in metrics:
        disp.progress(m)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert "val" not in lines[0] and "val 5.2000" in next(x for x in lines if x.startswith("step 3/"))
    assert lines[-1].startswith("step 9/9") and "val 4.6000" in lines[-1]
