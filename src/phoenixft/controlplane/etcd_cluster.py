"""Start and stop a local etcd cluster (the Debian package `etcd-server`, etcd 3.4), for tests,
benchmarks and `phoenixft run --control-plane etcd`.

Every member runs in its own session (so a SIGKILL to its process group ends only it), listens on
loopback (or the address given) on free ports, keeps its data under a directory this object
removes on `stop()`, with etcd's default raft timing (heartbeat 100 ms, election timeout 1 s: an
idle 3-member cluster costs ~0.05 CPU cores here, twice that at 50/500 ms; a raft leader's death
costs ~1 s of write unavailability, which clients ride out by retrying).

    with EtcdCluster(members=3) as c:
        print(c.url)          # etcd://127.0.0.1:P0,127.0.0.1:P1,127.0.0.1:P2
        c.kill(1)             # SIGKILL member 1; the other two keep a quorum

With `tls` it serves HTTPS only, to clients with a certificate of that CA (members among themselves
too); `restrict` then turns etcd's users on, one user allowed the job's prefix only.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from phoenixft.controlplane.tls import TlsFiles

__all__ = ["EtcdCluster", "etcd_binary"]


def etcd_binary() -> str | None:
    """Path of the `etcd` server binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)),
                                        None)


def _free_ports(host: str, n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """A `members`-member etcd cluster of local processes (see the module docstring)."""

    def __init__(self, members: int = 3, host: str = "127.0.0.1", base_dir: str | None = None,
                 log_dir: str | None = None, tag: str = "", tls: TlsFiles | None = None) -> None:
        if members < 1:
            raise ValueError(f"members={members}: an etcd cluster needs at least 1 member (3 tolerate one loss)")
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no `etcd` binary on PATH: install the Debian package etcd-server "
                                    "(apt-get install etcd-server) or point --control-plane at an existing cluster")
        self.binary = binary
        self.members = members
        self.host = host
        self.tls = tls  # HTTPS with client certificates of its CA, for clients and between members
        self._ctx = tls.client_context() if tls else None
        self.scheme = "https" if tls else "http"
        self._own_dir = base_dir is None
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix=f"phoenixft-etcd-{tag + '-' if tag else ''}"))
        self.log_dir = Path(log_dir) if log_dir else self.dir
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        ports = _free_ports(host, 2 * members)
        self.client_ports = ports[:members]
        self.peer_ports = ports[members:]
        self._token = f"phoenixft-{os.getpid()}-{int(time.time() * 1000)}"

    # ------------------------------------------------------------------ addresses
    @property
    def endpoints(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        """The `--control-plane` value that reaches this cluster."""
        return "etcd://" + ",".join(self.endpoints)

    # ------------------------------------------------------------------ life cycle
    def _cmd(self, i: int, state: str) -> list[str]:
        h, u = self.host, self.scheme
        cluster = ",".join(f"m{j}={u}://{h}:{p}" for j, p in enumerate(self.peer_ports))
        tls: list[str] = []
        if self.tls is not None:
            cert, key, ca = (os.path.abspath(x) for x in (self.tls.cert, self.tls.key, self.tls.ca))
            tls = ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                   "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                   "--peer-client-cert-auth"]
        return [self.binary, "--name", f"m{i}", "--data-dir", str(self.dir / f"m{i}.etcd"), *tls,
                "--listen-client-urls", f"{u}://{h}:{self.client_ports[i]}",
                "--advertise-client-urls", f"{u}://{h}:{self.client_ports[i]}",
                "--listen-peer-urls", f"{u}://{h}:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"{u}://{h}:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self._token,
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--logger", "zap", "--log-level", "warn", "--quota-backend-bytes", str(2 << 30),
                "--bcrypt-cost", "4",  # (the passwords `restrict` sets are 256-bit keys: no stretching needed)
                # a long run writes a revision per step and per event: keep 10 minutes of history
                "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m"]

    def start_member(self, i: int, state: str = "new") -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"etcd-m{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(self._cmd(i, state), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.members):
                self.start_member(i)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def restrict(self, prefix: str, user: str, password: str, timeout_s: float = 10.0) -> None:
        """Turn etcd's users on: `user` (with `password`) may read and write the keys under `prefix` and
        nothing else, anyone else nothing (root gets a random password no one keeps). Call it once the
        cluster is healthy; RuntimeError naming the step etcd refused."""
        key = "/" + prefix.strip("/") + "/"
        perm = {"permType": "READWRITE", "key": base64.b64encode(key.encode()).decode(),
                "range_end": base64.b64encode((key[:-1] + "0").encode()).decode()}
        steps = [("user/add", {"name": "root", "password": secrets.token_hex(32)}),
                 ("user/grant", {"user": "root", "role": "root"}), ("role/add", {"name": user}),
                 ("role/grant", {"name": user, "perm": perm}), ("user/add", {"name": user, "password": password}),
                 ("user/grant", {"user": user, "role": user}), ("enable", {})]
        for step, body in steps:
            req = urllib.request.Request(f"{self.scheme}://{self.host}:{self.client_ports[0]}/v3/auth/{step}",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s, context=self._ctx) as r:
                    r.read()
            except OSError as e:
                raise RuntimeError(f"etcd refused /v3/auth/{step} ({e})") from None

    def healthy(self, i: int, timeout_s: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.scheme}://{self.host}:{self.client_ports[i]}/health",
                                        timeout=timeout_s, context=self._ctx) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = 30.0, members: list[int] | None = None) -> None:
        todo = list(range(self.members)) if members is None else list(members)
        deadline = time.monotonic() + timeout_s
        while todo:
            for i in list(todo):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    log = (self.log_dir / f"etcd-m{i}.log")
                    tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
                    raise RuntimeError(f"etcd member m{i} exited with {p.returncode} while starting: {tail}")
                if self.healthy(i):
                    todo.remove(i)
            if todo and time.monotonic() > deadline:
                raise TimeoutError(f"etcd members {todo} not healthy within {timeout_s:g}s (logs in {self.log_dir})")
            if todo:
                time.sleep(0.05)

    def leader_index(self, timeout_s: float = 10.0) -> int:
        """Index of the member that is the raft leader now."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, p in enumerate(self.client_ports):
                if self.procs[i] is None or self.procs[i].poll() is not None:  # type: ignore[union-attr]
                    continue
                try:
                    req = urllib.request.Request(f"{self.scheme}://{self.host}:{p}/v3/maintenance/status", data=b"{}",
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=1.0, context=self._ctx) as r:
                        st = json.loads(r.read())
                except OSError:
                    continue
                if st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd member says it leads within {timeout_s:g}s")
            time.sleep(0.05)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal member i (its process group: etcd runs in a session of its own)."""
        p = self.procs[i]
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        """Start member i again on its old data directory (it rejoins the cluster)."""
        self.kill(i)
        self.start_member(i, state="existing")
        self.wait_healthy(timeout_s, [i])

    def stop(self) -> None:
        """SIGTERM the members one after another, each waited for (at most 5 s, then SIGKILL). Signalled all
        at once, the leader tries to hand its leadership to followers that are leaving too and exits only
        after that times out (about 7 s); one at a time, each exits in a fraction of a second."""
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
