"""The job's store behind its front: what `phoenixft run` and `phoenixft coordinator` serve.

`serve_job_store(host, port, tls, limits)` starts the front (a `tlsproxy.py front` process) and the store:

- the front listens on 127.0.0.1 at a port of its own (`local_addr`: the launcher, the coordinator and every
  process of this host use it), letting through only connections the kernel says are this user's; where the
  job serves another address (`phoenixft coordinator --host`), on that address too (`public_addr`): with TLS
  (`--tls-*`) for certificates of the job CA only, else as a plain TCP port (with a one-line warning);
- the store (torch's TCPStore) serves on a socket the front made in a network namespace of its own and handed
  over: nobody but the front can connect to it. Where the kernel allows no private namespace the store
  listens on a loopback port instead, said in one line (`shared`): another user of the host can then connect
  to it, around the front.

Every request reaches the store through the front, which frames and checks it against `limits`
(controlplane/storewire.py). See docs/security.md.
"""

from __future__ import annotations

import ipaddress
import os
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from phoenixft.controlplane import netns
from phoenixft.controlplane.server import StoreServer, format_addr, listen_on
from phoenixft.controlplane.storewire import Limits
from phoenixft.controlplane.tlsproxy import STOP_SIGNAL
from phoenixft.errors import UserError

__all__ = ["Relay", "start_relay", "StoreFront", "serve_job_store", "is_loopback", "START_TIMEOUT_S"]

START_TIMEOUT_S = 20.0
_PROXY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tlsproxy.py")  # run as a script (no torch)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address) is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class Relay:
    """A running tlsproxy process: its listening address; `stop()` ends it."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int) -> None:
        self.proc, self.host, self.port = proc, host, port

    @property
    def addr(self) -> str:
        return format_addr(self.host, self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)  # (it ignores SIGTERM: see controlplane/tlsproxy.py)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_relay(args: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a tlsproxy process. It ends when the thread that started it ends (the kernel's parent-death signal
    follows the thread): start it from the thread that lives as long as it should (the launcher's and the
    agent's main thread)."""
    return subprocess.Popen([sys.executable, "-P", _PROXY, "--parent", str(os.getpid()), *args],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, **env},
                            pass_fds=pass_fds)


def listening(p: subprocess.Popen[bytes], what: str) -> int:
    """The port relay `p` says it listens on (`listening PORT`), waited for at most START_TIMEOUT_S; UserError
    (and the relay killed) if it says nothing else or dies."""
    assert p.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            if sel.select(timeout=0.2):
                chunk = os.read(p.stdout.fileno(), 256)
                if not chunk:
                    break
                line += chunk
    p.stdout.close()
    if not line.startswith(b"listening "):
        p.kill()
        p.wait(timeout=5)
        raise UserError(f"the {what} did not start ({line.decode(errors='replace').strip() or 'no answer'})")
    return int(line.split()[1])


@dataclass
class StoreFront:
    """The job's store and its front: where this host's processes connect (`local_addr`), where agents of
    other hosts join (`public_addr`), and why the store is reachable around the front ('' : it is not)."""

    relay: Relay
    server: StoreServer
    local_addr: str
    public_addr: str
    shared: str = ""

    def stop(self) -> None:
        self.relay.stop()


def _control_message(chan: socket.socket) -> tuple[socket.socket | None, str]:
    """(the store's listening socket the front sent, or None and why it could not make one)."""
    chan.settimeout(START_TIMEOUT_S)
    note, fd = netns.recv_fd(chan)
    if fd is not None:
        return socket.socket(fileno=fd), ""
    text = note.decode(errors="replace").strip()
    return None, text[len("none "):] if text.startswith("none ") else (text or "the front said nothing")


def serve_job_store(host: str, port: int, tls_env: dict[str, str] | None, limits: Limits,
                    what: str = "--host/--port", timeout_s: float = 60.0) -> StoreFront:
    """The job's store behind its front (module docstring). `tls_env`: the TLS files' environment
    (`TlsFiles.env()`) for a TLS public address, None for none. UserError (one line naming `what`) when an
    address cannot be listened on or the front does not start."""
    public = None
    if tls_env is None and is_loopback(host):  # one address: the local one
        local = listen_on(host, port, what)
    else:
        local = listen_on("127.0.0.1", 0)
        public = listen_on(host, port, what)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    args = ["front", "--local-fd", str(local.fileno()), "--control-fd", str(theirs.fileno()),
            "--limits", f"{limits.max_bytes},{limits.max_keys},{limits.max_value},{limits.max_key}"]
    fds = [local.fileno(), theirs.fileno()]
    if public is not None:
        args += ["--public-fd", str(public.fileno()), *(["--public-tls"] if tls_env is not None else [])]
        fds.append(public.fileno())
    local_port = int(local.getsockname()[1])
    public_port = int(public.getsockname()[1]) if public is not None else local_port
    try:
        p = start_relay(args, tls_env or {}, tuple(fds))
    finally:
        theirs.close()
    relay = Relay(p, "127.0.0.1", local_port)
    try:
        sock, why = _control_message(mine)
        if sock is not None:
            server = StoreServer("127.0.0.1", 0, timeout_s, sock=sock)
        else:  # no private namespace here: the store on a loopback port, the front relaying to it
            server = StoreServer("127.0.0.1", 0, timeout_s)
            mine.sendall(f"target {server.port}\n".encode())
        listening(p, "store's front")
    except BaseException:
        relay.stop()
        raise
    finally:
        mine.close()
        local.close()  # (the front holds its own copies)
        if public is not None:
            public.close()
    local_addr = format_addr("127.0.0.1" if public is not None else host.strip("[]"), relay.port)
    public_addr = format_addr(host.strip("[]"), public_port) if public is not None else local_addr
    return StoreFront(relay, server, local_addr, public_addr, why)
