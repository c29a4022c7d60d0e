"""The relay processes of the control plane's TLS (see `phoenixft.controlplane.tls`).

    python -P .../controlplane/tlsproxy.py --parent PID gateway --fd FD --target 127.0.0.1:PORT
    python -P .../controlplane/tlsproxy.py --parent PID forwarder --target HOST:PORT

The TLS files come from the environment (`tls.TLS_ENV`). A gateway accepts TLS connections on the
listening socket FD, requiring a client certificate signed by the job CA, and relays each to the
store at the target once the handshake succeeded. A forwarder listens on a free loopback port,
accepts only connections whose socket belongs to its own user, and relays each through a TLS
connection to the gateway at the target (whose certificate must be signed by the job CA). Each
prints `listening PORT` on stdout once it listens (and nothing else there), logs refusals to
stderr (a few per peer address), and exits when its parent process dies (the kernel's
parent-death signal) or on SIGTERM. One asyncio loop relays every connection.

It is run as a script, and imports the standard library only: a relay starts in ~0.1 s, where
importing the package (and with it torch) takes seconds on a loaded host. The TLS contexts every
side of the job uses are made here (`server_context`, `client_context`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import socket
import ssl
import sys
from collections import Counter
from typing import Any

__all__ = ["main", "socket_owner", "server_context", "client_context", "TLS_ENV", "HANDSHAKE_TIMEOUT_S"]

TLS_ENV = ("PHOENIXFT_TLS_CERT", "PHOENIXFT_TLS_KEY", "PHOENIXFT_TLS_CA")
HANDSHAKE_TIMEOUT_S = 10.0

PR_SET_PDEATHSIG = 1
CHUNK = 1 << 16
LOG_PER_PEER = 3
_logged: Counter[str] = Counter()


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """TLS 1.2+ server: presents `cert`, requires a client certificate signed by `ca`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """TLS 1.2+ client: presents `cert`, accepts a server signed by `ca`, whatever its name (identity is
    "signed by this job's own CA")."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx


def _log(peer: str, text: str) -> None:
    _logged[peer] += 1
    if _logged[peer] <= LOG_PER_PEER:
        print(f"phoenixft tls: {text}", file=sys.stderr, flush=True)


def socket_owner(local_port: int, remote_port: int) -> int | None:
    """The uid owning the loopback TCP socket whose local port is `local_port`, connected to `remote_port`
    (from /proc/net/tcp, or tcp6: torch's client connects from an IPv6 socket, v4-mapped), or None."""
    want_l, want_r = f":{local_port:04X}", f":{remote_port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) > 7 and cols[1].endswith(want_l) and cols[2].endswith(want_r):
                        return int(cols[7])
        except (OSError, StopIteration):
            continue
    return None


async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(CHUNK):
            w.write(data)
            await w.drain()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        pass


async def _relay(r1: asyncio.StreamReader, w1: asyncio.StreamWriter, r2: asyncio.StreamReader,
                 w2: asyncio.StreamWriter) -> None:
    """Copy both ways until either side ends, then close both."""
    tasks = [asyncio.ensure_future(_pump(r1, w2)), asyncio.ensure_future(_pump(r2, w1))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    for w in (w1, w2):
        w.close()


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A failed handshake (a peer without a certificate of the job CA) is one logged line, not a traceback."""
    exc = context.get("exception")
    transport = context.get("transport")
    peer = ""
    try:
        info = transport.get_extra_info("peername") if transport is not None else None
        peer = str(info[0]) if info else ""
    except Exception:  # noqa: BLE001 - (a transport already closed)
        pass
    reason = getattr(exc, "reason", None) or exc or context.get("message")
    _log(peer, f"refused a connection from {peer or 'a peer'}: {reason}")


class _Paused(asyncio.StreamReaderProtocol):
    """A stream whose reading starts paused: a client's first bytes (its TLS ClientHello) stay in the
    socket until `start_tls` takes the connection over, instead of going to a StreamReader that the TLS
    layer never looks at (the handshake would then wait for ever)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]
        super().connection_made(transport)


async def _gateway(fd: int, target: tuple[str, int], ctx: ssl.SSLContext) -> None:
    sock = socket.socket(fileno=fd)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peer = str((w.get_extra_info("peername") or ("?",))[0])
        try:  # the store is connected to only once the peer's certificate verified
            await asyncio.wait_for(w.start_tls(ctx), HANDSHAKE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:  # (ssl.SSLError is an OSError)
            why = getattr(e, "reason", None) or str(e)
            if why or not isinstance(e, (ConnectionError, ssl.SSLEOFError)):  # (silent: a reachability probe)
                _log(peer, f"refused a connection from {peer}: {why or type(e).__name__}")
            w.close()
            return
        try:
            r2, w2 = await asyncio.open_connection(*target)
        except OSError as e:
            _log("store", f"the store at {target[0]}:{target[1]} did not accept a relayed connection ({e})")
            w.close()
            return
        await _relay(r, w, r2, w2)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Paused(asyncio.StreamReader(limit=CHUNK), handle), sock=sock)
    _say_listening(sock.getsockname()[1])
    async with server:
        await server.serve_forever()


async def _forwarder(target: tuple[str, int], ctx: ssl.SSLContext) -> None:
    me = os.getuid()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peer = w.get_extra_info("peername")
        owner = socket_owner(int(peer[1]), port)
        if owner != me:
            _log(f"uid{owner}", f"refused a local connection of uid {owner} (only uid {me}'s processes may use this "
                                "host's channel to the store)")
            w.close()
            return
        try:
            r2, w2 = await asyncio.wait_for(asyncio.open_connection(*target, ssl=ctx), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, OSError, ssl.SSLError) as e:
            _log("gateway", f"no TLS connection to the gateway at {target[0]}:{target[1]} ({e})")
            w.close()
            return
        await _relay(r, w, r2, w2)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    _say_listening(port)
    async with server:
        await server.serve_forever()


def _say_listening(port: int) -> None:
    os.write(1, f"listening {port}\n".encode())
    os.close(1)  # nothing more goes there (the parent stops reading it)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phoenixft tlsproxy")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("mode", choices=["gateway", "forwarder"])
    ap.add_argument("--fd", type=int, default=-1)
    ap.add_argument("--target", required=True)
    a = ap.parse_args(argv)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != a.parent:  # it died before the line above
        return 1
    files = [os.environ.get(k, "") for k in TLS_ENV]
    if not all(files):
        print("phoenixft tls: no TLS files in the environment", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_exception_handler)
    target = _hostport(a.target)
    if a.mode == "gateway":
        coro = _gateway(a.fd, target, server_context(*files))
    else:
        coro = _forwarder(target, client_context(*files))
    try:
        loop.run_until_complete(coro)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
