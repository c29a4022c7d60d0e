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

import contextlib
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
from conftest import SUITE_FLAGS
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
            except ConnectionRefusedError:
                code = 4  # nothing listens: the forwarder is gone, the test proves nothing
            except OSError:
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "refused", 1: "answered", 2: "relayed", 3: "error", 4: "no forwarder"}.get(
        os.waitstatus_to_exitcode(status), "?")


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_job_across_hosts_over_tls_recovers_and_keeps_strangers_out(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """Head + 2 nodes + 1 spare on their own hosts, all with --tls-*: node 1 SIGKILLed at step 6 is
    hot-swapped, final hash equal to a failure-free run; strangers on a 5th host get nothing.

    The strangers try before any node joins (the run cannot end while they do), and the run trains the paced
    workload (each step at least half a second): the check at a node's forwarder, made once the nodes joined,
    finds the run still on."""
    steps = 12
    ref = reference(nodes=2, steps=steps, workload="user_workload:workload")
    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["job"], [])
    make_certs(other, ["job"], [])
    token = os.urandom(16).hex()
    env = dict(_env(token), PHOENIXFT_TEST_PACE_S="0.5")  # each microbatch half a second longer
    with Hosts(["head", "h1", "h2", "h3", "x1"]) as H:
        head_addr = H.addr["head"]
        log = tmp_path / "head.log"
        H.run("head", [PY, "-m", "phoenixft", "coordinator", "--host", head_addr, "--port", str(PORT),
                       "--nodes", "2", "--spares", "1", "--steps", str(steps), "--failure-timeout", "2", "--quiet",
                       *SUITE_FLAGS, "--workload", "user_workload:paced_workload", "--run-dir", str(tmp_path / "run"),
                       "--report", str(tmp_path / "report.json"), "--inject", "kill:node=1@step=6,wait=60",
                       *_tls_args(d)], log=log, env=env)
        intruder = H.run("x1", [PY, "-m", "phoenixft", "agent", "--coordinator", f"{head_addr}:{PORT}", "--node",
                                "intruder", "--spare", "--tls-cert", str(other / "job.crt"), "--tls-key",
                                str(other / "job.key"), "--tls-ca", str(other / "ca.crt")],
                         log=tmp_path / "intruder.log", env=env)  # the job's token, another job's CA
        port_file = tmp_path / "run" / "coordinator.port"
        store_port = int(_wait("the store", lambda: port_file.exists() and port_file.read_text().strip(), 60, log))
        mine = H.connect("head", f"127.0.0.1:{store_port}", 10)  # the head's own loopback: the store itself
        got = _stranger_attempts(H, head_addr, store_port, other, d)
        wrote = [k for k in ("stranger/plain", "stranger") if mine.check([k])]
        agents = {h: H.run(h, [PY, "-m", "phoenixft", "agent", "--coordinator", f"{head_addr}:{PORT}", "--node", h,
                               *(["--spare"] if h == "h3" else []), *_tls_args(d)], log=tmp_path / f"{h}.log",
                           env=env) for h in ("h1", "h2", "h3")}
        # the forwarder of the node in slot 0, which the kill of slot 1 spares: it lives until the run's end
        n0 = _wait("the node in slot 0", lambda: [h for h in ("h1", "h2") if " as n0," in
                                                  (tmp_path / f"{h}.log").read_text()], 60, log)[0]
        fwd = _wait(f"{n0}'s forwarder", lambda: [ln.rsplit(":", 1)[-1].rstrip(")") for ln in
                                                   (tmp_path / f"{n0}.log").read_text().splitlines()
                                                   if "forwarder at" in ln], 60, log)
        other_user = _other_user_at_forwarder(H, n0, int(fwd[0]))
        assert not wrote, wrote
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
    # (the fault's record, written just before the kill, got through the killed node's forwarder)
    assert rep["recoveries"][0].get("fault") == "kill:node=1@step=6,wait=60", rep["recoveries"][0]
    assert "serving at" in head_log and "(TLS, store on 127.0.0.1:" in head_log, head_log[-2000:]
    assert head_log.count("phoenixft tls: refused a connection") >= 2, head_log[-2000:]  # the strangers, logged
    h0 = (tmp_path / f"{n0}.log").read_text()
    assert "refused a local connection of uid 65534" in h0, h0[-2000:]
    assert "Traceback" not in head_log + h0
    text = (tmp_path / "intruder.log").read_text()
    assert "phoenixft agent: error: --coordinator=" in text and "no TLS channel to the coordinator" in text, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert not any(m["name"] == "intruder" for m in rep["members"].values()), rep["members"]


def _cert_with_a_common_name(d: Path, name: str) -> TlsFiles:
    """A certificate of the CA in `d` whose subject is a Common Name (as openssl makes them by default)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    ca_key: Any = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    key: Any = serialization.load_pem_private_key((d / "job.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(str(d / f"{name}.crt"), str(d / "job.key"), str(d / "ca.crt"))


def test_status_reaches_a_tls_head_through_its_gateway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`phoenixft status --tls-*` at a head's TLS gateway reads the store behind it (through a forwarder of its
    own, stopped when it is done); with another CA's certificate it is one line naming --coordinator."""
    from phoenixft.cli.main import main
    from phoenixft.controlplane import keys
    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits
    from phoenixft.distributed.comm import connect_store
    from phoenixft.observe import status as status_mod

    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["job"], [])
    make_certs(other, ["job"], [])
    front = serve_job_store("127.0.0.1", 0, TlsFiles(*(_tls_args(d)[1::2])).env(), Limits())
    gw_addr = front.public_addr  # (the TLS gateway's address)
    store = connect_store(front.local_addr)
    store.set(keys.CONFIG, RunConfig(nodes=2, steps=50).to_json())
    store.set(keys.PROGRESS, "7")
    try:
        assert main(["status", "--coordinator", gw_addr, "--json", "--events", "0", *_tls_args(d)]) == 0
        js = json.loads(capsys.readouterr().out)
        assert js["config"]["nodes"] == 2 and js["progress"]["step"] == 7, js
        assert status_mod._RELAYS == []
        assert main(["status", "--coordinator", gw_addr, "--timeout", "3", "--tls-cert", str(other / "job.crt"),
                     "--tls-key", str(other / "job.key"), "--tls-ca", str(other / "ca.crt")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--coordinator={gw_addr}: no TLS channel" in err, err
    finally:
        front.stop()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")
def test_etcd_over_https_admits_only_the_job_and_only_to_its_prefix(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A local etcd started with the job's certificates (as `--control-plane etcd --tls-*` starts it)
    serves HTTPS only: a client with a certificate of the job CA reads and writes; plain HTTP, TLS without
    a client certificate and TLS with another CA's certificate are all refused, and write nothing. With its
    users on (what `--control-plane etcd` does given the job token), the job's user reads and writes its
    prefix only; a client of the same CA without the job token, with another job's token, or with a
    certificate that has a Common Name is refused; `phoenixft status` reads it with the token."""
    from phoenixft.cli.main import main
    from phoenixft.controlplane import address, connect
    from phoenixft.controlplane.auth import TOKEN_ENV, generate_token
    from phoenixft.controlplane.etcd_cluster import EtcdCluster
    from phoenixft.controlplane.etcd_store import EtcdError, EtcdStore, job_credentials

    d, other = tmp_path / "pki", tmp_path / "other"
    make_certs(d, ["job"], [])
    make_certs(other, ["job"], [])
    files = TlsFiles(str(d / "job.crt"), str(d / "job.key"), str(d / "ca.crt"))
    named = _cert_with_a_common_name(d, "job-cn")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
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
        # the users on: the job's (its password derived from the token) may use /phoenixft/run1 only
        token, prefix = generate_token(), "/phoenixft/run1"
        notes: list[str] = []
        address._restrict(c, named, prefix, token, notes.append)  # a Common Name: left as it is, and said so
        assert len(notes) == 1 and "not limited to the job's prefix" in notes[0] and "(job-cn)" in notes[0], notes
        address._restrict(c, files, prefix, token, notes.append)
        url = f"{c.url}{prefix}"
        job = connect(url, 5.0, files, token)
        job.set("config", RunConfig(nodes=3).to_json())
        assert job.get("config") and job.num_keys() == 1
        import threading

        threading.Timer(0.3, lambda: connect(url, 5.0, files, token).set("later", "x")).start()
        assert job.get("later") == b"x"  # (a watch, authenticated too)
        creds = job_credentials(prefix, token)
        for name, st in (("no token", connect(url, 2.0, files)), ("another job's token",
                                                                   connect(url, 2.0, files, generate_token())),
                         ("outside its prefix", EtcdStore(eps, "/phoenixft/run2", 2.0, files.client_context(), creds)),
                         ("a Common Name", EtcdStore(eps, prefix, 2.0, named.client_context(), creds))):
            with pytest.raises(EtcdError) as e:
                st.set("stranger", name)
            assert any(w in str(e.value) for w in ("permission denied", "could not authenticate", "CommonName")), \
                (name, e.value)
        assert job.num_keys() == 2 and not job.check(["stranger"])
        assert main(["status", "--coordinator", url, "--json", "--events", "0", "--timeout", "3", *_tls_args(d)]) == 2
        assert "permission denied" in capsys.readouterr().err  # (without the job token)
        monkeypatch.setenv(TOKEN_ENV, token)
        assert main(["status", "--coordinator", url, "--json", "--events", "0", *_tls_args(d)]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["nodes"] == 3
        monkeypatch.setenv("PHOENIXFT_ETCD_USER", "someone")
        monkeypatch.setenv("PHOENIXFT_ETCD_PASSWORD", "secret")
        assert job_credentials(prefix, token) == ("someone", "secret")  # (a cluster of the user's own)


@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")
def test_a_run_on_a_local_etcd_with_tls_keeps_to_its_prefix(tmp_path: Path, reference: Any) -> None:
    """`phoenixft run --control-plane etcd --tls-*`: the local cluster's users are on, and the whole job (its
    launcher, coordinator, agents and workers: leases, watches, the election) works as the job's user, to the
    final hash of a failure-free run; meanwhile a client of the job CA without the token is refused and one
    with the (generated) token reads the job's status."""
    import threading

    from conftest import run

    from phoenixft.controlplane import connect
    from phoenixft.controlplane.etcd_store import EtcdError
    from phoenixft.observe.status import collect_status

    ref = reference(nodes=2, steps=12)
    d = tmp_path / "pki"
    make_certs(d, ["job"], [])
    files = TlsFiles(str(d / "job.crt"), str(d / "job.key"), str(d / "ca.crt"))
    seen: dict[str, Any] = {}

    def look() -> None:
        deadline = time.monotonic() + 120
        cp, tok = tmp_path / "run" / "control_plane", tmp_path / "run" / "token"
        while not (cp.exists() and tok.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        url, token = cp.read_text().strip(), tok.read_text().strip()
        try:
            connect(url, 2.0, files).check(["config"])
            seen["stranger"] = "let in"
        except EtcdError as e:
            seen["stranger"] = str(e)
        job = connect(url, 5.0, files, token)
        while time.monotonic() < deadline and "progress" not in seen:
            with contextlib.suppress(Exception):
                st = collect_status(job, events=0)
                if st.get("progress"):
                    seen["progress"] = st["progress"]["step"]
            time.sleep(0.1)

    t = threading.Thread(target=look, daemon=True)
    t.start()
    rep = run(tmp_path / "run", nodes=2, spares=0, steps=12, control_plane="etcd", tls_cert=files.cert,
              tls_key=files.key, tls_ca=files.ca)
    t.join(timeout=60)
    assert rep["state"] == "done" and rep["final_state_sha256"] == ref["final_state_sha256"], rep.get("error")
    assert "permission denied" in seen.get("stranger", ""), seen
    assert seen.get("progress", 0) >= 1, seen


def test_the_record_a_node_writes_just_before_it_dies_gets_through_its_forwarder(tmp_path: Path,
                                                                                    reference: Any) -> None:
    """A node reaches the store through a forwarder of its own, which dies with it. A fault's record is
    written just before its kill: the injector makes a round trip first (a `set` is not answered), so the
    record is in the store before the node, its forwarder with it, is gone. Without that round trip about
    half of such runs lost the record, and the report named the recovery's cause "failure"."""
    from conftest import run

    make_certs(tmp_path / "pki", ["job"], [])
    tls = {"tls_cert": str(tmp_path / "pki/job.crt"), "tls_key": str(tmp_path / "pki/job.key"),
           "tls_ca": str(tmp_path / "pki/ca.crt")}
    ref = reference(nodes=2, steps=10)
    for i in range(3):
        rep = run(tmp_path / f"run{i}", nodes=2, spares=1, steps=10, inject=["kill:node=1@step=6"], **tls)
        assert rep["final_state_sha256"] == ref["final_state_sha256"]
        (rec,) = rep["recoveries"]
        assert rec.get("fault") == "kill:node=1@step=6,wait=60", rec
        assert [f["spec"] for f in rep["faults"]] == ["kill:node=1@step=6,wait=60"], rep["faults"]


def test_the_gateway_caps_idle_connections_and_times_them_out(tmp_path: Path) -> None:
    """1,100 connections that never complete a TLS handshake, from one address: the gateway holds at most its
    per-address cap of them (the rest closed at once: its open files are never exhausted), closes each held one
    after its handshake timeout, and serves a client of the job CA from another address throughout."""
    import datetime
    import resource

    import torch.distributed as dist

    from phoenixft.controlplane import tlsproxy
    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits
    from phoenixft.controlplane.tls import start_forwarder

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # (this test holds 1,100)
    make_certs(tmp_path, ["job"], [])
    files = TlsFiles(str(tmp_path / "job.crt"), str(tmp_path / "job.key"), str(tmp_path / "ca.crt"))
    front = serve_job_store("127.0.0.2", 0, files.env(), Limits())  # (the idle ones come from 127.0.0.1)
    host, port = front.public_addr.rsplit(":", 1)
    idle: list[socket.socket] = []
    fwd = None
    try:
        for _ in range(1100):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.connect((host, int(port)))
            idle.append(s)
        time.sleep(1.0)
        held = sum(1 for s in idle if _open(s))
        assert held <= tlsproxy.MAX_PER_ADDRESS < len(idle), held
        fwd = start_forwarder(front.public_addr, files)  # (from 127.0.0.2: another address)
        ours = dist.TCPStore("127.0.0.1", fwd.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
        ours.set("still", b"served")
        assert ours.get("still") == b"served"
        time.sleep(tlsproxy.HANDSHAKE_TIMEOUT_S + 1.0)
        assert sum(1 for s in idle if _open(s)) == 0  # every idle one closed after its handshake timeout
    finally:
        for s in idle:
            s.close()
        if fwd is not None:
            fwd.stop()
        front.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open(s: socket.socket) -> bool:
    """The peer has not closed `s` (nothing to read, no EOF)."""
    s.setblocking(False)
    try:
        return bool(s.recv(1, socket.MSG_PEEK)) or False
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_the_gateway_refuses_a_client_without_a_certificate_of_the_job_ca(tmp_path: Path) -> None:
    """The store's TLS gateway: a client of the job CA is let in; a TLS client presenting no certificate, one
    of another CA, and a plain TCPStore client are refused before a byte reaches the store (nothing written)."""
    import datetime

    import torch.distributed as dist

    from phoenixft.controlplane import tls
    from phoenixft.controlplane.front import serve_job_store
    from phoenixft.controlplane.storewire import Limits

    make_certs(tmp_path / "pki", ["job"], [])
    make_certs(tmp_path / "other", ["job"], [])
    files = TlsFiles(str(tmp_path / "pki/job.crt"), str(tmp_path / "pki/job.key"), str(tmp_path / "pki/ca.crt"))
    other = TlsFiles(str(tmp_path / "other/job.crt"), str(tmp_path / "other/job.key"), files.ca)
    front = serve_job_store("127.0.0.2", 0, files.env(), Limits())
    host, port = front.public_addr.rsplit(":", 1)
    try:
        assert tls.probe(host, int(port), files) is None
        assert tls.probe(host, int(port), other) is not None
        bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            try:
                with bare.wrap_socket(raw) as s:
                    s.settimeout(2)
                    s.sendall(b"\x00\xce\xf7\x85<\x01\x06\x00\x00\x00\x00\x00\x00\x00/stray\x01\x00\x00\x00\x00"
                              b"\x00\x00\x00x")  # (a TCPStore hello and a set, sent in the clear of TLS)
                    got = s.recv(1)
            except (ssl.SSLError, OSError):
                got = b""
        assert got == b"", "a client without a certificate got an answer"
        with pytest.raises(Exception):  # noqa: B017 - (a plain TCPStore client: its hello is no TLS handshake)
            dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=3))
        ours = dist.TCPStore("127.0.0.1", int(front.local_addr.rsplit(":", 1)[1]), is_master=False,
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
        assert not ours.check(["stray"])  # nothing reached the store
    finally:
        front.stop()
