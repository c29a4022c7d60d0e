"""Another user of the job's host, a real Unix user made for the test (`useradd`; removed after), tries the
store: through the store's front (the only TCP port it serves), with a socket bound to the front's own port on
another loopback address (the bypass of a port-only owner check), and at an agent's TLS forwarder; each try is
refused and writes nothing, while the job's own processes (this user's) pass, and a run beside it ends with the
failure-free hash. The store's own listening socket is in no network namespace another user can enter."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SUITE_FLAGS

from phoenixft.controlplane.front import serve_job_store
from phoenixft.controlplane.storewire import Limits

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd (a second Unix user is made for the test)")

MAGIC = struct.pack("<I", 0x3C85F7CE)


def _key(k: bytes) -> bytes:
    return struct.pack("<Q", len(k)) + k


def handshake_and_set(key: bytes) -> bytes:
    """What a TCPStore client sends to say hello (VALIDATE, then PING) and to set `key` (torch's wire format)."""
    hello = b"\x00" + MAGIC + b"\x0d" + struct.pack("<I", 7)
    return hello + b"\x01" + _key(b"/" + key) + _key(b"written by another user")


@contextlib.contextmanager
def other_user() -> Iterator[tuple[int, int]]:
    """A new system user (uid, gid), removed with its group afterwards."""
    name = f"pft{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True, timeout=30)
    try:
        import pwd

        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


def as_user(uid: int, gid: int, fn: Callable[[], Any]) -> Any:
    """`fn()` in a child process running as uid:gid (its JSON result)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out: Any
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def attempt(port: int, bind: str | None = None, payload: bytes = b"") -> str:
    """Connect to 127.0.0.1:port (from `bind`:port where given: the front's own port on another loopback
    address), send `payload`; what came of it: refused (closed without an answer), answered, or kept open."""
    s = socket.socket()
    try:
        if bind is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bind, port))
        s.settimeout(3)
        s.connect(("127.0.0.1", port))
        s.sendall(payload or handshake_and_set(b"x"))
        return "answered" if s.recv(4) else "refused"
    except TimeoutError:
        return "kept open"
    except (ConnectionResetError, BrokenPipeError):
        return "refused"  # (closed before or while it spoke)
    except OSError as e:
        return f"failed ({e.strerror})"
    finally:
        s.close()


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _tcp_inodes() -> set[str]:
    """The inodes of every TCP socket in this process's network namespace (the host's)."""
    out = set()
    for t in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(t) as f:
            out |= {line.split()[9] for line in f.readlines()[1:]}
    return out


def test_the_front_lets_in_this_users_processes_only(capfd: pytest.CaptureFixture[str]) -> None:
    """The store behind its front: this user's client reads and writes; another user is refused at the front's
    port, also from a socket bound to that same port on 127.0.0.5 (which a port-only owner check took for the
    front's own), and writes nothing; garbage of this user's is refused at the frame, never reaching the store.
    The store's listening socket is not in the host's network namespace."""
    import datetime

    import torch.distributed as dist

    front = serve_job_store("127.0.0.1", 0, None, Limits())
    try:
        port = _port(front.local_addr)
        ours = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
        ours.set("mine", b"1")
        assert ours.get("mine") == b"1" and front.shared == "", front.shared
        inode = os.readlink(f"/proc/self/fd/{front.server._sock.fileno()}").strip("socket:[]")
        assert inode not in _tcp_inodes()  # (the store's own socket: in a network namespace of the front's)
        with other_user() as (uid, gid):
            got = as_user(uid, gid, lambda: [attempt(port), attempt(port, bind="127.0.0.5"),
                                             attempt(port, bind="127.0.0.9")])
            assert got == ["refused", "refused", "refused"], got
        assert not ours.check(["x"])  # nothing written by the other user
        assert attempt(port, payload=b"\x7f" * 64) == "refused"  # an operation no store knows: closed at the front
        assert ours.get("mine") == b"1"  # (and the store's own clients unaffected)
    finally:
        front.stop()
    err = capfd.readouterr().err
    assert f"refused a local connection of uid {uid}" in err, err
    assert "not a request of the store" in err and "Traceback" not in err and "frame #" not in err, err


def test_a_forwarder_refuses_another_user_also_on_its_own_port(tmp_path: Path) -> None:
    """An agent's TLS forwarder: this user's TCPStore client reaches the head's store through it; another user
    is refused, also from 127.0.0.5 bound to the forwarder's own port, and nothing it sends is relayed."""
    import datetime

    import torch.distributed as dist

    from phoenixft.cli.cmd_certs import make_certs
    from phoenixft.controlplane.tls import TlsFiles, start_forwarder

    make_certs(tmp_path, ["job"], [])
    files = TlsFiles(str(tmp_path / "job.crt"), str(tmp_path / "job.key"), str(tmp_path / "ca.crt"))
    front = serve_job_store("127.0.0.1", 0, files.env(), Limits())
    fwd = start_forwarder(front.public_addr, files)
    try:
        ours = dist.TCPStore("127.0.0.1", fwd.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
        ours.set("through", b"tls")
        assert ours.get("through") == b"tls"
        with other_user() as (uid, gid):
            got = as_user(uid, gid, lambda: [attempt(fwd.port), attempt(fwd.port, bind="127.0.0.5")])
        assert got == ["refused", "refused"], got
        assert not ours.check(["x"])
    finally:
        fwd.stop()
        front.stop()


def test_a_run_beside_another_user_ends_bitwise_and_writes_nothing_of_it(tmp_path: Path, reference: Any) -> None:
    """A `phoenixft run` (a hot-swap in it) while another user of the host keeps trying its store (a TCPStore
    hello and a write, at the front's port and from the front's own port on another loopback address): every
    try refused, the run ends with exit 0 and the failure-free hash, nothing of the other user's in the store."""
    ref = reference(nodes=2, steps=16)["final_state_sha256"]
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    p = subprocess.Popen([sys.executable, "-m", "phoenixft", "run", "--nodes", "2", "--spares", "1", "--steps", "16",
                          *SUITE_FLAGS, "--run-dir", str(run_dir), "--timeout", "240", "--inject",
                          "kill:node=1@step=8,wait=60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    tries: list[list[str]] = []
    with other_user() as (uid, gid):
        f = run_dir / "coordinator.port"
        deadline = time.monotonic() + 120
        while not (f.exists() and f.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(f.read_text())

        def keep_trying() -> None:
            while p.poll() is None:
                got = as_user(uid, gid, lambda: [attempt(port), attempt(port, bind="127.0.0.7")])
                if p.poll() is None:  # (tried while the run still served its store)
                    tries.append(got)
                time.sleep(0.2)

        t = threading.Thread(target=keep_trying, daemon=True)
        t.start()
        out, err = p.communicate(timeout=300)
        t.join(timeout=30)
    assert p.returncode == 0, err[-3000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["final_state_sha256"] == ref and [r["action"] for r in rep["recoveries"]] == ["hotswap"]
    passed = [t for t in tries if {"answered", "kept open"} & set(t)]  # (refused, or at the end nothing listening)
    assert len(tries) >= 3 and sum(t == ["refused", "refused"] for t in tries) >= 3 and not passed, tries
    assert f"refused a local connection of uid {uid}" in err, err[-3000:]
