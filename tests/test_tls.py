"""TLS for the control plane (controlplane/tls.py): a job across hosts (tests/netns.py namespaces) whose
store listens on the head's loopback only, every agent reaching it through mutually authenticated TLS.

Checked on a live job: a node killed is hot-swapped and the run ends bitwise equal to a failure-free
run; strangers on the network (a plain TCPStore client, a TLS client with a certificate of another
CA, a TLS client with no certificate, a plain connection to the store's own port, an agent holding
the job's token but another CA's certificate) neither read nor write a key nor join; another user
of an agent's host cannot use that host's forwarder. Without namespaces: `phoenixft certs`, the
flags' one-line errors, a store that listens on loopback only, etcd with client certificates.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Hosts, unavailable

from phoenixft.cli.cmd_certs import make_certs
from phoenixft.config import RunConfig
from phoenixft.controlplane.tls import TlsFiles, handshake_problem
from phoenixft.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PORT = 29500


def _env(token: str) -> dict[str, str]:
    env = dict(os.environ, PHOENIXFT_TOKEN=token)
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(REPO / "src"), str(REPO / "tests"),
                                                    os.environ.get("PYTHONPATH", "")] if x)
    return env


def _tls_args(d: Path, name: str = "job") -> list[str]:
    return ["--tls-cert", str(d / f"{name}.crt"), "--tls-key", str(d / f"{name}.key"), "--tls-ca", str(d / "ca.crt")]


def _wait(what: str, cond: Any, timeout_s: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-1500:]}" for p in sorted(log.parent.glob("*.log")))
            pytest.fail(f"timed out waiting for {what}:\n{logs}")
        time.sleep(0.1)


def _listening_on(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the listening sockets on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[1].endswith(f":{port:04X}"):
                    out.append(cols[1].rsplit(":", 1)[0])
    return out


def test_certs_flags_and_a_loopback_store(tmp_path: Path) -> None:
    """`phoenixft certs` writes a CA and per-host certificates (keys 0600) that verify against it and not
    against another job's CA; each flag's error is one line naming it; the store listens on loopback only."""
    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["a", "b"], ["10.0.0.9"])
    make_certs(other, ["job"], [])
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in d.iterdir()} == {
        "ca.crt": "0o644", "ca.key": "0o600", "a.crt": "0o644", "a.key": "0o600", "b.crt": "0o644", "b.key": "0o600"}
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(UserError, match="already holds a CA"):
        make_certs(d, ["c"], [])
    from phoenixft.cli.main import main

    assert main(["certs", str(tmp_path / "cli"), "--hosts", "h1,h2", "--san", "10.0.0.9", "--days", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["ca.crt", "ca.key", "h1.crt", "h1.key", "h2.crt",
                                                                    "h2.key"]
    assert main(["certs", str(tmp_path / "bad"), "--hosts", "ca"]) == 2 and not (tmp_path / "bad").exists()
    a = TlsFiles(str(d / "a.crt"), str(d / "a.key"), str(d / "ca.crt"))
    b = TlsFiles(str(d / "b.crt"), str(d / "b.key"), str(d / "ca.crt"))
    stranger = TlsFiles(str(other / "job.crt"), str(other / "job.key"), str(d / "ca.crt"))  # trusts our CA
    assert handshake_problem(a, b) is None and handshake_problem(b, a) is None
    assert handshake_problem(a, stranger) is not None  # its certificate is not of our CA: refused by the server
    assert handshake_problem(stranger, a) is not None  # ... and as a server, refused by our client

    def err(**kw: str) -> str:
        with pytest.raises(UserError) as e:
            RunConfig(**kw).validate()
        assert "\n" not in str(e.value)
        return str(e.value)

    good = {"tls_cert": str(d / "a.crt"), "tls_key": str(d / "a.key"), "tls_ca": str(d / "ca.crt")}
    RunConfig(**good).validate()
    assert "--tls-ca missing" in err(tls_cert=good["tls_cert"], tls_key=good["tls_key"])
    assert "--tls-cert=/nonexistent.crt: cannot read it" in err(**{**good, "tls_cert": "/nonexistent.crt"})
    os.chmod(d / "b.key", 0o644)
    msg = err(**{**good, "tls_key": str(d / "b.key")})
    assert "--tls-key=" in msg and "mode 0644" in msg and "chmod 600" in msg, msg
    os.chmod(d / "b.key", 0o600)
    msg = err(**{**good, "tls_key": str(d / "b.key")})  # b's key with a's certificate
    assert "--tls-cert=" in msg and "its matching key" in msg, msg
    msg = err(**{**good, "tls_cert": str(other / "job.crt"), "tls_key": str(other / "job.key")})
    assert "does not verify against --tls-ca" in msg, msg
    # the store a local run (and the head, with TLS) serves listens on loopback only
    from phoenixft.controlplane.server import StoreServer

    srv = StoreServer("127.0.0.1", 0)
    assert _listening_on(srv.port) == ["0100007F"], _listening_on(srv.port)


def _stranger_attempts(H: Hosts, head: str, store_port: int, other: Path, d: Path) -> dict[str, str]:
    """From host x1: every way in that lacks a certificate of the job CA; what each got."""
    from phoenixft.controlplane.store import tcp_client

    got: dict[str, str] = {}
    with H.inside("x1"):
        try:  # a plain TCPStore client at the gateway
            c = tcp_client(head, PORT, timeout_s=3.0)
            c.set("stranger/plain", "x")
            got["plain"] = "wrote"
        except Exception as e:  # noqa: BLE001
            got["plain"] = f"refused: {str(e).splitlines()[0][:80]}"
        for name, files in (("other-ca", TlsFiles(str(other / "job.crt"), str(other / "job.key"), str(d / "ca.crt"))),
                            ("no-cert", None)):
            ctx = files.client_context() if files else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            if files is None:
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            try:
                with socket.create_connection((head, PORT), timeout=3) as raw, ctx.wrap_socket(raw) as s:
                    s.sendall(b"\x00" * 64)  # whatever it is, it must never reach the store
                    got[name] = "answered" if s.recv(1) else "closed"
            except (ssl.SSLError, OSError) as e:
                got[name] = f"refused: {e}"
        try:  # the store's own port, from another host: loopback only
            socket.create_connection((head, store_port), timeout=3).close()
            got["store-port"] = "connected"
        except OSError as e:
            got["store-port"] = f"refused: {e.strerror}"
    return got


def _other_user_at_forwarder(H: Hosts, host: str, port: int) -> str:
    """Another user (uid 65534) of `host` connects to its agent's forwarder and sends a TCPStore ping."""
    with H.inside(host):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                    s.sendall(b"\x00" * 16)
                    code = 1 if s.recv(1) else 0  # 0: closed without a word (refused)
            except TimeoutError:
                code = 2  # kept open: relayed
            except OSError:
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "refused", 1: "answered", 2: "relayed", 3: "error"}.get(os.waitstatus_to_exitcode(status), "?")


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_job_across_hosts_over_tls_recovers_and_keeps_strangers_out(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """Head + 2 nodes + 1 spare on their own hosts, all with --tls-*: node 1 SIGKILLed at step 6 is
    hot-swapped, final hash equal to a failure-free run; strangers on a 5th host get nothing."""
    steps = 12
    ref = reference(nodes=2, steps=steps)
    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["job"], [])
    make_certs(other, ["job"], [])
    token = os.urandom(16).hex()
    with Hosts(["head", "h1", "h2", "h3", "x1"]) as H:
        head_addr = H.addr["head"]
        log = tmp_path / "head.log"
        H.run("head", [PY, "-m", "phoenixft", "coordinator", "--host", head_addr, "--port", str(PORT),
                       "--nodes", "2", "--spares", "1", "--steps", str(steps), "--failure-timeout", "2", "--quiet",
                       "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "report.json"),
                       "--inject", "kill:node=1@step=6,wait=60", *_tls_args(d)], log=log, env=_env(token))
        agents = {h: H.run(h, [PY, "-m", "phoenixft", "agent", "--coordinator", f"{head_addr}:{PORT}", "--node", h,
                               *(["--spare"] if h == "h3" else []), *_tls_args(d)], log=tmp_path / f"{h}.log",
                           env=_env(token)) for h in ("h1", "h2", "h3")}
        intruder = H.run("x1", [PY, "-m", "phoenixft", "agent", "--coordinator", f"{head_addr}:{PORT}", "--node",
                                "intruder", "--spare", "--tls-cert", str(other / "job.crt"), "--tls-key",
                                str(other / "job.key"), "--tls-ca", str(other / "ca.crt")],
                         log=tmp_path / "intruder.log", env=_env(token))  # the job's token, another job's CA
        port_file = tmp_path / "run" / "coordinator.port"
        store_port = int(_wait("the store", lambda: port_file.exists() and port_file.read_text().strip(), 60, log))
        mine = H.connect("head", f"127.0.0.1:{store_port}", 10)  # the head's own loopback: the store itself
        got = _stranger_attempts(H, head_addr, store_port, other, d)
        fwd = _wait("h1's forwarder", lambda: [ln.rsplit(":", 1)[-1].rstrip(")") for ln in
                                               (tmp_path / "h1.log").read_text().splitlines()
                                               if "forwarder at" in ln], 60, log)
        other_user = _other_user_at_forwarder(H, "h1", int(fwd[0]))
        assert not mine.check(["stranger/plain"]) and not mine.check(["stranger"])
        assert all(v.startswith("refused") or v == "closed" for v in got.values()), got
        assert got["store-port"].startswith("refused"), got
        assert other_user == "refused", other_user
        assert intruder.wait(timeout=60) == 2
        head_rc = subprocess.Popen.wait(H.procs[0], timeout=240)
        for a in agents.values():
            a.wait(timeout=30)
    head_log = log.read_text()
    assert head_rc == 0, head_log[-3000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    assert [r["action"] for r in rep["recoveries"]] == ["hotswap"], rep["recoveries"]
    assert rep["recoveries"][0]["promoted"] == ["s0"], rep["recoveries"][0]
    assert "serving at" in head_log and "(TLS, store on 127.0.0.1:" in head_log, head_log[-2000:]
    assert head_log.count("phoenixft tls: refused a connection") >= 2, head_log[-2000:]  # the strangers, logged
    h1 = (tmp_path / "h1.log").read_text()
    assert "refused a local connection of uid 65534" in h1, h1[-2000:]
    assert "Traceback" not in head_log + h1
    text = (tmp_path / "intruder.log").read_text()
    assert "phoenixft agent: error: --coordinator=" in text and "no TLS channel to the coordinator" in text, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert not any(m["name"] == "intruder" for m in rep["members"].values()), rep["members"]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")
def test_etcd_over_https_admits_only_clients_of_the_job_ca(tmp_path: Path) -> None:
    """A local etcd started with the job's certificates (as `--control-plane etcd --tls-*` starts it)
    serves HTTPS only: a client with a certificate of the job CA reads and writes; plain HTTP, TLS without
    a client certificate and TLS with another CA's certificate are all refused, and write nothing."""
    from phoenixft.controlplane.etcd_cluster import EtcdCluster
    from phoenixft.controlplane.etcd_store import EtcdStore

    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["job"], [])
    make_certs(other, ["job"], [])
    files = TlsFiles(str(d / "job.crt"), str(d / "job.key"), str(d / "ca.crt"))
    with EtcdCluster(1, tls=files, base_dir=str(tmp_path / "etcd")) as c:
        eps = [(c.host, p) for p in c.client_ports]
        ours = EtcdStore(eps, "/job", 5.0, files.client_context())
        ours.set("k", "v")
        assert ours.get("k") == b"v"
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname = False
        no_cert.load_verify_locations(files.ca)
        foreign = TlsFiles(str(other / "job.crt"), str(other / "job.key"), str(d / "ca.crt")).client_context()
        for name, ctx in (("plain http", None), ("no client certificate", no_cert), ("another CA", foreign)):
            st = EtcdStore(eps, "/job", 1.0, ctx)
            with pytest.raises(Exception, match="no answer"):
                st.set("stranger", name)
            with pytest.raises(Exception, match="no answer"):
                st.get_nowait("k")
        assert not ours.check(["stranger"])
