"""The relay processes of the control plane: the store's front, and an agent's forwarder.

    python -P .../controlplane/tlsproxy.py --parent PID front --local-fd FD --control-fd FD
        [--public-fd FD (--public-tls | --public-plain)] [--limits BYTES,KEYS,VALUE,KEY]
    python -P .../controlplane/tlsproxy.py --parent PID forwarder --target HOST:PORT

**The front** is the only way into the job's TCPStore. It moves itself into a network namespace of its own
(`netns.private_listener`), listens there on 127.0.0.1 at its local port, and hands that socket to the
process that serves the store (over the Unix socket `--control-fd`; where the kernel allows no private
namespace it says why there, and relays to the loopback port it is told instead). It accepts:

- on the local listener (127.0.0.1, `--local-fd`): connections whose other end the kernel says belongs to its
  own user (`peers.Identity`, by the exact four-tuple); any other local user is refused, in one line;
- on the public listener (`--public-fd`, where the head serves another address): with `--public-tls`, TLS
  connections whose client presents a certificate of the job CA (verified before a byte reaches the store);
  with `--public-plain`, local connections of its own user as above and remote ones (a plain TCP port: anyone
  who reaches it is a client, which the head warns about).

Every request a client sends is framed and checked (`storewire`): a malformed frame, an operation it does not
know, a key or value past the limits or a write that would take the store past its total bytes or keys closes
that connection (one line per peer, counted), so the store's server never logs a stack trace for a frame and
holds no more than the limits. Connections are capped (in all, and per remote address), a TLS handshake and
a client's first request must come within HANDSHAKE_TIMEOUT_S, and the process raises its open-file limit
to what the system allows.

**A forwarder** (one per agent's host, with TLS) listens on a free loopback port, accepts only connections of
its own user (the same exact four-tuple check), and relays each through a new TLS connection to the head's
front, verifying its certificate against the job CA.

Both print `listening PORT` on stdout once they listen (and nothing else there), log refusals to stderr (a
few per peer, then counted), and exit on STOP_SIGNAL (SIGALRM: nothing else sends it, and its default action ends
the process without a core dump, also before its handler is in place): their parent's stop (`front.Relay.stop`), or
the kernel's parent-death signal when their parent dies. They ignore SIGTERM: a scheduler ending a job (Slurm at
`scancel` or at the time limit) sends it to every process of the job at once, and the job then saves its state
through these relays before it exits (docs/hosts.md); their parent ends them once it has. One asyncio loop
relays every connection. The script imports the standard library and the package's standard-library modules
only (no torch): it starts in ~0.1 s. The TLS contexts every side of the job uses are made here
(`server_context`, `client_context`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import resource
import signal
import socket
import ssl
import sys
from collections import Counter
from typing import Any

if __name__ == "__main__":  # (run as a script with -P: the package's standard-library modules from its source)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from phoenixft.controlplane import netns, storewire  # noqa: E402
from phoenixft.controlplane.peers import Identity  # noqa: E402

__all__ = ["main", "server_context", "client_context", "TLS_ENV", "HANDSHAKE_TIMEOUT_S", "MAX_CONNECTIONS",
           "MAX_PER_ADDRESS", "STOP_SIGNAL"]

TLS_ENV = ("PHOENIXFT_TLS_CERT", "PHOENIXFT_TLS_KEY", "PHOENIXFT_TLS_CA")
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake, and a client's first request, must come within this
MAX_CONNECTIONS = 4096  # relayed connections at once (fewer where the open-file limit is lower: two files each)
MAX_PER_ADDRESS = 512  # ... from one remote address
PR_SET_PDEATHSIG = 1
STOP_SIGNAL = signal.SIGALRM  # a relay's end: its parent's stop, or the parent-death signal (never SIGTERM: see above)
CHUNK = 1 << 16
LOG_PER_PEER = 3
_logged: Counter[str] = Counter()
refused: Counter[str] = Counter()  # why connections were refused or closed (counted, logged a few times each)
relayed: Counter[str] = Counter()  # requests and bytes relayed to the store, connections accepted
GONE = "gone"  # a local connection whose socket was closed before its owner could be looked up
STATS_ENV = "PHOENIXFT_FRONT_STATS"  # a file the front writes its counts to (JSON) when it ends: for the bench


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


def _log(peer: str, why: str, text: str) -> None:
    refused[why] += 1
    _logged[peer] += 1
    if _logged[peer] <= LOG_PER_PEER:
        more = " (further ones from there are counted, not logged)" if _logged[peer] == LOG_PER_PEER else ""
        print(f"phoenixft tls: {text}{more}", file=sys.stderr, flush=True)


class _Paused(asyncio.StreamReaderProtocol):
    """A stream whose reading starts paused: a client's first bytes (its TLS ClientHello) stay in the
    socket until `start_tls` takes the connection over, instead of going to a StreamReader that the TLS
    layer never looks at (the handshake would then wait for ever)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]
        super().connection_made(transport)


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A failed handshake (a peer without a certificate of the job CA) is one logged line, not a traceback."""
    exc = context.get("exception")
    if exc is None:  # (a task pending when the loop stopped, at the end: nothing refused)
        return
    transport = context.get("transport")
    peer = ""
    try:
        info = transport.get_extra_info("peername") if transport is not None else None
        peer = str(info[0]) if info else ""
    except Exception:  # noqa: BLE001 - (a transport already closed)
        pass
    _log(peer, "error", f"refused a connection from {peer or 'a peer'}: {getattr(exc, 'reason', None) or exc}")


async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(CHUNK):
            w.write(data)
            await w.drain()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        pass


async def _framed(r: asyncio.StreamReader, w: asyncio.StreamWriter, ledger: storewire.Ledger, peer: str) -> None:
    """Client to store: each request framed and admitted (`storewire`); a malformed or refused one ends the
    connection (one line per peer). The first must come within HANDSHAKE_TIMEOUT_S."""
    framer = storewire.Framer(ledger.limits)
    first = True
    try:
        while True:
            data = await (asyncio.wait_for(r.read(CHUNK), HANDSHAKE_TIMEOUT_S) if first else r.read(CHUNK))
            if not data:
                return
            first = False
            for req in framer.feed(data):
                ledger.admit(req)
                w.write(req.raw)
                relayed["requests"] += 1
                relayed["bytes"] += len(req.raw)
            await w.drain()
    except TimeoutError:
        _log(peer, "idle", f"closed a connection from {peer}: no request within {HANDSHAKE_TIMEOUT_S:g}s")
    except storewire.Malformed as e:
        _log(peer, "malformed", f"closed a connection from {peer}: not a request of the store ({e})")
    except storewire.Refused as e:
        _log(peer, "limits", f"closed a connection from {peer}: past the store's limits ({e})")
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        pass


async def _relay(r1: asyncio.StreamReader, w1: asyncio.StreamWriter, r2: asyncio.StreamReader,
                 w2: asyncio.StreamWriter, ledger: storewire.Ledger | None = None, peer: str = "") -> None:
    """Copy both ways until either side ends, then close both; client to store framed where `ledger` is given."""
    up = _framed(r1, w2, ledger, peer) if ledger is not None else _pump(r1, w2)
    tasks = [asyncio.ensure_future(up), asyncio.ensure_future(_pump(r2, w1))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    for w in (w1, w2):
        w.close()


class _Caps:
    """Connections relayed now, in all and per remote address."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total, self.per_address = total, per_address
        self.now = 0
        self.by_address: Counter[str] = Counter()

    def take(self, addr: str, remote: bool) -> str:
        """'' (and counted) if one more connection from `addr` fits; else why not."""
        if self.now >= self.total:
            return f"{self.now} connections relayed already (at most {self.total})"
        if remote and self.by_address[addr] >= self.per_address:
            return f"{self.by_address[addr]} connections from {addr} already (at most {self.per_address} per address)"
        self.now += 1
        self.by_address[addr] += 1
        return ""

    def give(self, addr: str) -> None:
        self.now -= 1
        self.by_address[addr] -= 1
        if self.by_address[addr] <= 0:
            del self.by_address[addr]


class Front:
    """The store's front: its listeners, who may pass, the limits, the store it relays to."""

    def __init__(self, identity: Identity, ledger: storewire.Ledger, caps: _Caps, target: tuple[str, int],
                 tls: ssl.SSLContext | None) -> None:
        self.identity, self.ledger, self.caps, self.target, self.tls = identity, ledger, caps, target, tls
        self.me = os.getuid()

    def _who(self, w: asyncio.StreamWriter, remote_ok: bool) -> tuple[str, str]:
        """(the peer's address, why it may not pass or '')."""
        sock = w.get_extra_info("socket")
        addr = str((w.get_extra_info("peername") or ("?",))[0])
        peer = self.identity.peer(sock)
        if peer.local and peer.uid is None:
            return addr, GONE
        if peer.local and peer.uid != self.me:
            return addr, f"a local connection of uid {peer.uid} (only uid {self.me}'s processes may use the store)"
        if not peer.local and not remote_ok:
            return addr, "a connection from another host on a local-only port"
        return addr, self.caps.take(addr, not peer.local)

    async def plain(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, remote_ok: bool) -> None:
        addr, why = self._who(w, remote_ok)
        if why == GONE:  # (closed before it was looked up: a process that ended, as at a run's end; counted)
            refused[GONE] += 1
            w.close()
            return
        if why:
            _log(addr, "peer", f"refused {why}" if why.startswith("a ") else f"refused a connection from {addr}: {why}")
            w.close()
            return
        try:
            await self._to_store(r, w, addr)
        finally:
            self.caps.give(addr)

    async def tls_client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        addr = str((w.get_extra_info("peername") or ("?",))[0])
        why = self.caps.take(addr, True)
        if why:
            _log(addr, "caps", f"refused a connection from {addr}: {why}")
            w.close()
            return
        try:
            assert self.tls is not None
            try:  # the store is connected to only once the peer's certificate verified
                await asyncio.wait_for(w.start_tls(self.tls), HANDSHAKE_TIMEOUT_S)
            except (OSError, TimeoutError) as e:  # (ssl.SSLError is an OSError)
                reason = getattr(e, "reason", None) or str(e)
                if reason or not isinstance(e, (ConnectionError, ssl.SSLEOFError)):  # (silent: a reachability probe)
                    _log(addr, "tls", f"refused a connection from {addr}: {reason or type(e).__name__}")
                w.close()
                return
            await self._to_store(r, w, addr)
        finally:
            self.caps.give(addr)

    async def _to_store(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, addr: str) -> None:
        relayed["connections"] += 1
        try:
            r2, w2 = await asyncio.wait_for(asyncio.open_connection(*self.target), HANDSHAKE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            _log("store", "store", f"the store at {self.target[0]}:{self.target[1]} did not accept a relayed "
                                   f"connection ({e})")
            w.close()
            return
        await _relay(r, w, r2, w2, self.ledger, addr)


def _raise_nofile() -> int:
    """Raise this process's open-file limit to the hard one; the soft one now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError):
        return soft


def _place_store(control: socket.socket, port: int) -> tuple[tuple[str, int], str]:
    """Listen for the store in a private network namespace and hand that socket over `control`; where the
    kernel allows none, say why there and take the loopback port the store serves on instead. (target, why)."""
    sock, why = netns.private_listener(port)
    if sock is not None:
        netns.send_fd(control, sock.fileno())
        sock.close()
        return ("127.0.0.1", port), ""
    control.sendall(f"none {why}\n".encode())
    control.settimeout(60.0)
    line = b""
    while not line.endswith(b"\n"):
        chunk = control.recv(256)
        if not chunk:
            raise SystemExit(1)
        line += chunk
    return ("127.0.0.1", int(line.split()[1])), why


async def _front(a: argparse.Namespace, tls: ssl.SSLContext | None) -> None:
    identity = Identity()  # (before the move: it keeps asking the host's network namespace)
    local = socket.socket(fileno=a.local_fd)
    public = socket.socket(fileno=a.public_fd) if a.public_fd >= 0 else None
    nofile = _raise_nofile()
    control = socket.socket(fileno=a.control_fd)
    target, _why = _place_store(control, int(local.getsockname()[1]))
    control.close()
    limits = storewire.Limits(**dict(zip(("max_bytes", "max_keys", "max_value", "max_key"), a.limits, strict=True))) \
        if a.limits else storewire.Limits()
    caps = _Caps(max(16, min(MAX_CONNECTIONS, (nofile - 64) // 2)), MAX_PER_ADDRESS)
    front = Front(identity, storewire.Ledger(limits), caps, target, tls)
    loop = asyncio.get_running_loop()
    servers = [await asyncio.start_server(lambda r, w: front.plain(r, w, False), sock=local, limit=CHUNK)]
    if public is not None and tls is not None:
        servers.append(await loop.create_server(
            lambda: _Paused(asyncio.StreamReader(limit=CHUNK), front.tls_client), sock=public))
    elif public is not None:
        servers.append(await asyncio.start_server(lambda r, w: front.plain(r, w, True), sock=public, limit=CHUNK))
    _say_listening(int(local.getsockname()[1]))
    await asyncio.gather(*(s.serve_forever() for s in servers))


async def _forwarder(target: tuple[str, int], ctx: ssl.SSLContext) -> None:
    identity = Identity()
    me = os.getuid()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peer = identity.peer(w.get_extra_info("socket"))
        if not peer.local or peer.uid != me:
            if peer.local and peer.uid is None:  # (closed before it was looked up: counted, not logged)
                refused[GONE] += 1
            else:
                _log(f"uid{peer.uid}", "peer", f"refused a local connection of uid {peer.uid} (only uid {me}'s "
                                               "processes may use this host's channel to the store)")
            w.close()
            return
        try:
            r2, w2 = await asyncio.wait_for(asyncio.open_connection(*target, ssl=ctx), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, OSError, ssl.SSLError) as e:
            _log("gateway", "gateway", f"no TLS connection to the gateway at {target[0]}:{target[1]} ({e})")
            w.close()
            return
        await _relay(r, w, r2, w2)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    _say_listening(int(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def _say_listening(port: int) -> None:
    os.write(1, f"listening {port}\n".encode())
    os.close(1)  # nothing more goes there (the parent stops reading it)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="phoenixft tlsproxy")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("mode", choices=["front", "forwarder"])
    ap.add_argument("--local-fd", type=int, default=-1)
    ap.add_argument("--public-fd", type=int, default=-1)
    ap.add_argument("--control-fd", type=int, default=-1)
    ap.add_argument("--public-tls", action="store_true")
    ap.add_argument("--limits", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--target", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(STOP_SIGNAL), 0, 0, 0)
    if os.getppid() != a.parent:  # it died before the line above
        return 1
    # Ctrl-C and a terminal's hangup reach every process of the foreground group: the parent stops on them, and it
    # still reads the store through this relay for its report and teardown; it ends the relay itself (STOP_SIGNAL),
    # or the kernel does when it dies. A drain or stop notice sent to every process of a node (as Slurm signals a
    # step's), and the SIGTERM of a job being ended (the job saves its state through this relay first), are its
    # agent's or head's, never the relay's end.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    files = [os.environ.get(k, "") for k in TLS_ENV]
    if (a.mode == "forwarder" or a.public_tls) and not all(files):
        print("phoenixft tls: no TLS files in the environment", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_exception_handler)
    if a.mode == "front":
        coro = _front(a, server_context(*files) if a.public_tls else None)
    else:
        coro = _forwarder(_hostport(a.target), client_context(*files))
    loop.add_signal_handler(STOP_SIGNAL, loop.stop)
    try:
        loop.run_until_complete(coro)
    except KeyboardInterrupt:
        return 130
    except RuntimeError:  # (stopped by STOP_SIGNAL)
        pass
    finally:
        _write_stats()
    return 0


def _write_stats() -> None:
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    import json

    t = os.times()
    with open(path, "w") as f:
        json.dump({"relayed": dict(relayed), "refused": dict(refused), "cpu_s": round(t.user + t.system, 3)}, f)


if __name__ == "__main__":
    sys.exit(main())
