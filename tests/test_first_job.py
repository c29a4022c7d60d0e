"""What a user meets on a first job outside the demo: `phoenixft --version`, `phoenixft status --run-dir`, and
one-line errors for a TLS mismatch either way (naming the --tls-* flags) and for a refused token (naming the
address the user gave, not this host's TLS forwarder)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import processes_with

from phoenixft.cli.cmd_certs import make_certs
from phoenixft.cli.main import main
from phoenixft.config import RunConfig

PY = sys.executable


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from phoenixft import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"phoenixft {__version__}\n"


def test_status_finds_a_run_by_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`phoenixft status --run-dir DIR` reaches the run that DIR belongs to (as `phoenixft drain` does); a run
    that has ended is said so, naming its report."""
    from phoenixft.controlplane import keys
    from phoenixft.controlplane.server import serve_store
    from phoenixft.distributed.comm import connect_store

    server = serve_store("127.0.0.1", 0)
    store = connect_store(server.addr)
    store.set(keys.CONFIG, RunConfig(nodes=3, steps=40).to_json())
    store.set(keys.PROGRESS, "11")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "coordinator.port").write_text(str(server.port))
    assert main(["status", "--run-dir", str(run_dir), "--json", "--events", "0"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["coordinator"] == server.addr and js["config"]["nodes"] == 3 and js["progress"]["step"] == 11, js
    # the run has ended: its store no longer answers, its report is there
    (run_dir / "coordinator.port").write_text("1")
    (run_dir / "report.json").write_text("{}")
    assert main(["status", "--run-dir", str(run_dir), "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"phoenixft status: error: --run-dir={run_dir}: its run does not answer at 127.0.0.1:1; "
                          f"it has ended: its report is {run_dir}/report.json"), err
    assert main(["status", "--run-dir", str(tmp_path / "nothing")]) == 2
    assert "not the directory of a running `phoenixft run`" in capsys.readouterr().err


def _agent(addr: str, token: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "phoenixft", "agent", "--coordinator", addr, "--node", "x", "--join-timeout",
                           "20", *flags], env=dict(os.environ, PHOENIXFT_TOKEN=token), capture_output=True,
                          text=True, timeout=120)


def test_tls_mismatch_either_way_and_a_refused_token_are_one_line(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    make_certs(d, ["job"], [])
    tls = ["--tls-cert", str(d / "job.crt"), "--tls-key", str(d / "job.key"), "--tls-ca", str(d / "ca.crt")]
    token = secrets.token_hex(16)
    heads = []
    try:
        for name, flags in (("tls", tls), ("plain", [])):
            run_dir = tmp_path / name
            with open(tmp_path / f"{name}.log", "wb") as out:
                heads.append(subprocess.Popen(
                    [PY, "-m", "phoenixft", "coordinator", "--host", "127.0.0.1", "--port", "0", "--nodes", "2",
                     "--join-timeout", "120", "--run-dir", str(run_dir), "--quiet", *flags],
                    env=dict(os.environ, PHOENIXFT_TOKEN=token), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True))
        addrs = {}
        deadline = time.monotonic() + 90
        while len(addrs) < 2 and time.monotonic() < deadline:
            for name in ("tls", "plain"):
                m = re.search(r"serving at (\S+?)[ ,]", (tmp_path / f"{name}.log").read_text())
                if m:
                    addrs[name] = m.group(1)
            time.sleep(0.1)
        assert len(addrs) == 2, [(tmp_path / f"{n}.log").read_text() for n in ("tls", "plain")]
        # a plain agent at a TLS head: at once, naming the flags (it waited ~20 s and said "not a reachable store")
        t = time.monotonic()
        p = _agent(addrs["tls"], token)
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
            f"phoenixft agent: error: --coordinator={addrs['tls']}: the coordinator there speaks TLS (it was started "
            "with --tls-cert, --tls-key and --tls-ca): give this agent --tls-cert, --tls-key and --tls-ca too (a "
            "certificate of this host signed by the job's CA, and that CA; `phoenixft certs` makes them)"), p.stderr
        assert "TCPStore.cpp" not in p.stderr and time.monotonic() - t < 15
        # a TLS agent at a plain head
        p = _agent(addrs["plain"], token, *tls)
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
            f"phoenixft agent: error: --coordinator={addrs['plain']}: the coordinator there does not speak TLS (it "
            "was started without --tls-cert, --tls-key and --tls-ca): leave those flags out here, or start the "
            "coordinator with them"), p.stderr
        # a wrong token, through this host's TLS forwarder: the refusal names the address the user gave
        p = _agent(addrs["tls"], secrets.token_hex(16), *tls)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith(
            f"phoenixft agent: error: the coordinator at {addrs['tls']} refused to admit 'x'"), p.stderr
    finally:
        for h in heads:
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGINT)
        for h in heads:
            try:
                h.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(h.pid, signal.SIGKILL)
                h.wait(timeout=30)
        for pid in processes_with(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
