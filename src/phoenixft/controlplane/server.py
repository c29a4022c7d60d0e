"""Serve the control-plane store (torch's `TCPStore`) on exactly the socket given.

`TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says (measured
here: `*:PORT`). `serve_store` binds a listening socket to HOST:PORT itself and hands it to the
store (`master_listen_fd`), so the store is reachable on that address only; a job's store is served on a
socket its front made in a network namespace of its own (controlplane/front.py), reachable through the front
only.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from phoenixft.controlplane.store import TcpStore
from phoenixft.errors import UserError

__all__ = ["StoreServer", "serve_store", "format_addr", "listen_on"]


def format_addr(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_on(host: str, port: int, what: str = "--host/--port") -> socket.socket:
    """A TCP socket listening on exactly host:port (0: a free port); UserError (one line naming `what`) if not."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as e:
        sock.close()
        raise UserError(f"{what}={format_addr(host, port)}: cannot listen there ({e.strerror or e}); give an "
                        "address of this host and a free port (0 = any free port)") from None
    return sock


class StoreServer:
    """A TCPStore server listening on `host:port` only (port 0: a free one), or on the listening socket `sock`
    given (its clients connect to `host` at that socket's port); keep it referenced."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0, what: str = "--host/--port",
                 sock: socket.socket | None = None) -> None:
        host = host.strip("[]")
        sock = sock if sock is not None else listen_on(host, port, what)
        self._sock = sock  # the store serves on this socket: it must stay open as long as the store
        self.host, self.port = host, int(sock.getsockname()[1])
        self.timeout_s = timeout_s
        import torch.distributed as dist

        self.store = dist.TCPStore(host, self.port, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=sock.fileno())

    @property
    def addr(self) -> str:
        return format_addr(self.host, self.port)

    def as_store(self) -> TcpStore:
        """The serving store as a `controlplane.Store` (it is a client of itself too)."""
        return TcpStore(self.store, self.host, self.port, self.timeout_s)


def serve_store(host: str, port: int, timeout_s: float = 60.0, what: str = "--host/--port") -> StoreServer:
    return StoreServer(host, port, timeout_s, what)
