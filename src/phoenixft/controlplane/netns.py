"""A network namespace of the store's own: a listening socket no other user of the host can connect to.

torch's TCPStore serves TCP only (its server refuses a Unix socket), and every user of a host can connect to
every TCP socket listening on its loopback. So the store's listening socket is made in a private network
namespace (`private_listener`): the relay process that fronts the store (controlplane/tlsproxy.py) moves itself
into a new namespace (a new user namespace too when it is not root: an unprivileged user may make one where the
kernel allows it), brings its loopback up, listens there, and hands that socket to the process that serves the
store (SCM_RIGHTS over a Unix socket pair). A socket keeps its namespace: the store's server accepts only
connections made from inside it, which only the relay (and root) can make. Every other client reaches the store
through the relay, which lets a local connection through only when the kernel says it is the job user's
(controlplane/peers.py), and a remote one only through TLS (or, without TLS, as any client of a plain TCP port).

Standard library only (the relay imports it).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct

__all__ = ["CLONE_NEWNET", "CLONE_NEWUSER", "private_listener", "send_fd", "recv_fd"]

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _map_ids(uid: int, gid: int) -> None:
    """Map this (unprivileged) user to itself inside the new user namespace, so the files it opens stay its own."""
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass  # (unmapped: the process is nobody inside; it only listens and connects there)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH", ifr[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def private_listener(port: int) -> tuple[socket.socket | None, str]:
    """Move this process into a new network namespace of its own and listen on 127.0.0.1:`port` there: (the
    listening socket, ""), or (None, why not) where the kernel refuses (the process then stays where it was).
    Irreversible for the calling process: call it from the relay, after it made every socket of the host's
    namespace it needs (those keep working)."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _unshare(CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as e:
        how = "as root" if uid == 0 else "an unprivileged user namespace"
        hint = "" if uid == 0 else " (kernel.unprivileged_userns_clone / user.max_user_namespaces, or AppArmor)"
        return None, f"the kernel refused a private network namespace ({how}: {e.strerror}){hint}"
    if uid != 0:
        _map_ids(uid, gid)
    try:
        _loopback_up()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", port))
        s.listen(4096)
        return s, ""
    except OSError as e:
        return None, f"no loopback in the private network namespace ({e.strerror or e})"


def send_fd(chan: socket.socket, fd: int, note: bytes = b"private") -> None:
    socket.send_fds(chan, [note], [fd])


def recv_fd(chan: socket.socket) -> tuple[bytes, int | None]:
    """(the note sent, the descriptor sent with it, or None)."""
    try:
        msg, fds, _flags, _addr = socket.recv_fds(chan, 4096, 1)
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return b"", None
        raise
    return msg, (fds[0] if fds else None)
