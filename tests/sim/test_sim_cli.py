"""``phoenixft simulate`` command tests: tables, JSON, PNG, and one-line errors with status 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from closed_forms import best_k

from phoenixft.sim.cli import add_parser, main

DATA = Path(__file__).parent / "data" / "bench_example.json"
FAST = ["--trajectories", "30", "--steps", "2000"]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_worked_example_prints_review_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "we.json"
    assert main(["worked-example", *FAST, "--json", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "0.404" in text and "0.964" in text and "1595" in text
    res = _json(out)["result"]
    assert round(res["analytic"]["checkpoint_restart"]["eta"], 3) == 0.404
    assert len(res["exact_model"]["rows"]) == 3
    assert not (tmp_path / "we.png").exists()


def test_shard_loss_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sl.json"
    assert main(["shard-loss", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1.28e-10" in text and "1.28e-05" in text and "0.128" in text
    png = tmp_path / "sl.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _json(out)["result"]["rows"]
    assert rows[0]["per_step"] == pytest.approx(1.28e-10)


def test_paper_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["paper-scenario", "--trajectories", "200", "--json", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "84.27x" in text and "18.80x" in text and "5258.72" in text
    mc = _json(out)["result"]["monte_carlo"]
    assert mc["time_to_resume_hotswap_s"]["mean"] == pytest.approx(31.2 + 1.04, rel=0.02)


def test_scale_sweep_with_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sw.json"
    png = tmp_path / "plots" / "sweep.png"
    rc = main(
        [
            "scale-sweep",
            "--gpus-list",
            "512,131072",
            *FAST,
            "--calibrate",
            str(DATA),
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "log2" in text and "power" in text and "residuals" in text and "extrapolated" in text
    res = _json(out)["result"]
    assert [r["gpus"] for r in res["rows"]] == [512, 131072]
    assert res["calibration"]["overhead_ratio"] == pytest.approx(1.04)
    assert png.exists()
    for r in res["rows"]:
        cr = r["policies"]["checkpoint-restart"]
        # the interval checkpoint-restart ran at is the exhaustive argmax of Daly's segment model
        # (closed_forms.best_k) for the row's MTTF and restart cost, 20 s steps, 8.9 s writes
        expected = best_k(20.0, 8.9, r["restart_s"], r["system_mttf_s"], 2000)
        assert cr["ckpt_every"] == cr["interval_choice"]["exact"] == expected


def test_run_all_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    rc = main(
        [
            "run",
            "--gpus",
            "4096",
            *FAST,
            "--transient-frac",
            "0.3",
            "--domain-mttf-s",
            "1e8",
            "--json",
            str(out),
            "--no-plot",
        ]
    )
    assert rc == 0
    res = _json(out)["result"]
    assert set(res["policies"]) == {"checkpoint-restart", "phoenix", "inplace", "shrink"}
    for p in res["policies"].values():
        assert 0 < p["ettr"]["mean"] <= 1
        assert "restart" in p["lost_per_failure_s"]
    assert "lost per failure by cause" in capsys.readouterr().out


@pytest.mark.parametrize("gpus", ["1", "8", "64"])
def test_small_jobs_simulate(gpus: str, tmp_path: Path) -> None:
    """Below the restart fit's smallest point (256 GPUs) its log2 line went negative: a traceback."""
    out = tmp_path / "small.json"
    assert main(["run", "--gpus", gpus, "--gpus-per-node", "1", *FAST, "--json", str(out), "--no-plot"]) == 0
    res = _json(out)["result"]
    for p in res["policies"].values():
        assert 0 < p["ettr"]["mean"] <= 1


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", "--step-s", "-1"], "--step-s"),
        (["run", "--step-s", "abc"], "--step-s"),
        (["run", "--transient-frac", "1.5"], "--transient-frac"),
        (["run", "--overhead-ratio", "0.9"], "--overhead-ratio"),
        (["run", "--gpus", "0"], "--gpus"),
        (["run", "--policies", "cr,bogus"], "--policies"),
        (["run", "--arrival", "gamma"], "--arrival"),
        (["run", "--domain-mttf-s", "nan"], "--domain-mttf-s"),
        (["scale-sweep", "--gpus-list", "512,x"], "--gpus-list"),
        (["shard-loss", "--p", "2"], "--p"),
        (["worked-example", "--phi", "1"], "--phi"),
        (["worked-example", "--mttf-s", "inf"], "--mttf-s"),
        (["run", "--calibrate", "/nonexistent/bench.json"], "--calibrate"),
    ],
)
def test_bad_values_one_line_status_2(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc: object
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert flag in err
    assert "Traceback" not in err


def test_calibrate_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "b.json"
    bad.write_text("nope")
    assert main(["scale-sweep", "--calibrate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--calibrate" in err


def test_add_parser_into_a_host_cli(capsys: pytest.CaptureFixture[str]) -> None:
    root = argparse.ArgumentParser(prog="phoenixft")
    sub = root.add_subparsers(dest="command")
    add_parser(sub)
    args = root.parse_args(["simulate", "shard-loss", "--k-max", "2"])
    assert args.func(args) == 0
    assert "independent" in capsys.readouterr().out
    args = root.parse_args(["simulate"])
    assert args.func(args) == 2


def test_module_entry_accepts_simulate_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "shard-loss", "--k-max", "1"]) == 0
    assert "correlated" in capsys.readouterr().out


def test_warns_when_the_spare_pool_cannot_keep_up(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "run",
            "--gpus",
            "131072",
            "--policies",
            "cr",
            "--spares",
            "1",
            "--provision-s",
            "36000",
            "--trajectories",
            "5",
            "--steps",
            "300",
            "--no-plot",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "warning: 131072 GPUs: the spare pool (1) is below" in out
