"""Goodput and the live exports end to end: a run with a kill, `--tensorboard` and `--metrics-port 0`,
scraped while it runs, read back with TensorBoard's own event reader and prometheus-client's parser,
against a failure-free run of the same job."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_hotswap, run

pytest.importorskip("tensorboard")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

# tests/user_workload.py's paced workload: `workload`'s arithmetic, each microbatch PACE_S longer asleep, so that
# the endpoint is scraped at steps past the kill on any machine (unpaced, a fast one ran the steps after the
# recovery between two scrapes)
JOB: dict[str, Any] = {"nodes": 2, "steps": 12, "workload": "user_workload:paced_workload"}
KILL_STEP = 6
PACE_S = 0.1


@pytest.fixture
def paced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOENIXFT_TEST_PACE_S", str(PACE_S))


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for x in fam.samples:
            out.setdefault(x.name, []).append((x.labels, x.value))
    return out


def _get(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return _samples(r.read().decode())


def _watch(d: Path, box: dict[str, Any], stop: threading.Event) -> None:
    """While the run goes: metrics.jsonl's length (with no report.json yet) and the endpoint's samples."""
    while not stop.is_set():
        if (d / "report.json").exists():
            return
        if (d / "metrics.jsonl").exists():
            n = len((d / "metrics.jsonl").read_text().splitlines())
            box.setdefault("lines", []).append(n)
        port_file = d / "metrics.port"
        if port_file.exists() and port_file.read_text().strip():
            box["port"] = int(port_file.read_text())
            try:
                box.setdefault("scrapes", []).append(_get(box["port"]))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(0.1)


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    for lab, v in samples.get(name, []):
        if all(lab.get(k) == w for k, w in labels.items()):
            return v
    return None


def test_goodput_tensorboard_prometheus_and_live_metrics(tmp_path: Path, reference: Any, paced: None) -> None:
    clean = reference(**JOB)  # failure-free (and unprotected: its goodput is the higher still)
    d, tb = tmp_path / "kill", tmp_path / "tb"
    box: dict[str, Any] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(d, box, stop), daemon=True)
    watcher.start()
    try:
        rep = run(d, **JOB, spares=1, inject=[f"kill:node=1@step={KILL_STEP}"], tensorboard=str(tb), metrics_port=0)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert_one_hotswap(rep, ["n1"], KILL_STEP)
    assert rep["final_state_sha256"] == clean["final_state_sha256"]

    # goodput in both reports: the kill cost some, and the causes say where it went
    g, g0 = rep["goodput"], clean["goodput"]
    for x in (g, g0):
        assert sum(x["badput_s"].values()) + x["productive_s"] == pytest.approx(x["wall_s"])
        assert 0 < x["goodput"] <= 1 and x["steps_counted"] == JOB["steps"]
    assert g["goodput"] < g0["goodput"], (g, g0)
    assert g["badput_s"]["detection"] > 0 and g["badput_s"]["decide"] > 0
    assert sum(g["badput_s"][k] for k in ("reconfigure", "restore_params", "restore_optimizer", "join")) > 0
    assert all(v == 0 for k, v in g0["badput_s"].items() if k not in ("startup", "overhead")), g0
    (rec,) = rep["recoveries"]
    assert rec["times"]["fault"] < rec["times"]["decided"] < rec["times"]["first_step"]

    # metrics.jsonl grew while the run was alive; at the end it holds each step's last execution once
    lines = box.get("lines", [])
    assert any(n > 0 for n in lines) and max(lines) > min(x for x in lines if x > 0), lines
    metrics = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, JOB["steps"] + 1))
    assert [m["loss"] for m in metrics] == rep["loss"]

    # the Prometheus endpoint, scraped while the run went (its port recorded), consistent with the run
    scrapes = box.get("scrapes", [])
    assert scrapes, "the endpoint never answered during the run"
    steps_seen = [_one(s, "phoenixft_steps_completed") or 0 for s in scrapes]
    assert 1 <= max(steps_seen) <= JOB["steps"]
    # (the kill came in step KILL_STEP's forward pass: a step at or past it completed after the recovery)
    late = [s for s in scrapes if (_one(s, "phoenixft_steps_completed") or 0) >= KILL_STEP]
    assert late, steps_seen
    last = late[-1]
    assert _one(last, "phoenixft_recoveries_total", **{"class": "permanent", "action": "hotswap"}) == 1.0
    step = int(_one(last, "phoenixft_steps_completed") or 0)
    by_step = {m["step"]: m for m in metrics}
    assert _one(last, "phoenixft_loss") == pytest.approx(by_step[step]["loss"])
    assert _one(last, "phoenixft_node_step_seconds", node="n0") == pytest.approx(by_step[step]["dt"])
    assert _one(last, "phoenixft_node_compute_seconds", node="n0") == pytest.approx(by_step[step]["compute_s"])
    own = by_step[step]["nodes_compute_s"]  # every node's own compute of the step before, as the detector reads it
    assert own and all(_one(last, "phoenixft_node_own_compute_seconds", node=n) == pytest.approx(v)
                       for n, v in own.items()), own
    gps = [v for s in scrapes if (v := _one(s, "phoenixft_goodput"))]
    assert gps and all(0 < v <= 1 for v in gps)
    assert _one(last, "phoenixft_badput_seconds", cause="detection") is not None
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the endpoint stopped with the run
        _get(box["port"])

    # the HTML report and `phoenixft report`: the same goodput, its causes in the table
    from phoenixft.observe.html_report import write_report

    page = write_report(d).read_text()
    assert f"goodput <b>{g['goodput'] * 100:.1f}%</b>" in page and "<td>detection</td>" in page

    # TensorBoard's own reader: the per-step scalars equal metrics.jsonl's (the last write of a replayed step)
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/step_time_s", "dt"),
                     ("train/compute_s", "compute_s")):
        last_write = {e.step: e.value for e in acc.Scalars(tag)}
        assert sorted(last_write) == [m["step"] for m in metrics], tag
        assert [last_write[m["step"]] for m in metrics] == pytest.approx([m[key] for m in metrics], rel=1e-6), tag
    assert acc.Scalars("recoveries/total")[-1].value == 1.0
    assert acc.Scalars("goodput/goodput")[-1].value == pytest.approx(g["goodput"], rel=1e-6)
    assert acc.Scalars("goodput/badput_detection_s")[-1].value == pytest.approx(g["badput_s"]["detection"], rel=1e-6)


def test_tensorboard_sink_writes_what_the_reader_reads_back(tmp_path: Path) -> None:
    """Every scalar of a step record (grad norm and validation loss where it has them), the goodput, the
    recoveries; a replayed step's last write is what TensorBoard keeps. No run needed."""
    from phoenixft.observe.sinks import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path))
    recs = [{"step": s, "loss": 5.0 / s, "lr": 1e-3 * s, "dt": 0.01 * s, "t_end": 100.0 + s, "grad_norm": 2.0 + s,
             **({"val_loss": 6.0 / s} if s % 2 == 0 else {})} for s in range(1, 7)]
    for r in [*recs[:4], {**recs[2], "loss": 9.0}, *recs[3:]]:  # step 3 replayed after step 4 (then 4.. again)
        sink.step(r)
    sink.goodput({"goodput": 0.75, "badput_s": {"detection": 0.5}}, 6)
    sink.recovery(1, 6, {"recovery_s": 1.5, "lost_steps": 1})
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("train/grad_norm")}
    assert got == pytest.approx({r["step"]: r["grad_norm"] for r in recs})
    assert {e.step: e.value for e in acc.Scalars("train/loss")}[3] == 9.0
    assert {e.step: e.value for e in acc.Scalars("train/val_loss")} == pytest.approx({2: 3.0, 4: 1.5, 6: 1.0})
    assert acc.Scalars("goodput/goodput")[-1].value == 0.75
    assert acc.Scalars("goodput/badput_detection_s")[-1].value == 0.5
    assert (acc.Scalars("recoveries/total")[-1].value, acc.Scalars("recoveries/recovery_s")[-1].value) == (1.0, 1.5)


def test_export_flags_are_checked_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from phoenixft.config import RunConfig
    from phoenixft.errors import UserError

    (tmp_path / "f").write_text("")
    for kw, words in (({"metrics_port": 65536}, "--metrics-port=65536 is invalid"),
                      ({"metrics_port": -2}, "--metrics-port=-2 is invalid"),
                      ({"tensorboard": str(tmp_path / "f")}, "it is a file"),
                      ({"tensorboard": str(tmp_path / "f" / "sub")}, "cannot write there")):
        with pytest.raises(UserError, match=words):
            RunConfig(**kw).validate()
    RunConfig(metrics_port=0, tensorboard=str(tmp_path / "new" / "tb")).validate()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client"
                        else real(name, *a))
    with pytest.raises(UserError, match=r"--metrics-port needs .*pip install 'phoenixft\[metrics\]'"):
        RunConfig(metrics_port=0).validate()
    RunConfig(tensorboard=str(tmp_path)).validate()  # (tensorboard is there)
