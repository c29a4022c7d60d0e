"""Who is at the other end of a TCP connection on this host: the kernel's word for it (standard library only).

A relay that serves only its own user's processes (the store's loopback guard, an agent's forwarder) asks the
kernel which socket is at the other end of each connection it accepts, by the connection's exact four-tuple
(the peer's address and port, and the relay's own address and port), and whose that socket is:

- `sock_diag` (NETLINK_SOCK_DIAG, the interface `ss` uses): one exact lookup, the socket's uid and inode as the
  kernel keeps them. A socket open before `Identity()` is made keeps asking the network namespace it was made
  in (a relay that moves to a private namespace afterwards still asks about the host's connections);
- else `/proc/net/tcp` and `tcp6` read at the time (the same four-tuple, whole lines compared).

Only a live, connected socket counts (state ESTABLISHED, an inode: a socket in TIME_WAIT, or orphaned, is
nobody's). Matching the whole four-tuple, not ports only, is what keeps a local user from borrowing the relay's
own socket: one who binds `127.0.0.X:P` (P the relay's port) and connects is found as itself. A peer whose
socket is not found is local or remote by its address: an address of this host (one a socket can bind) must be
found (else it closed already, or hides: refused); any other is on another host.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

__all__ = ["Peer", "Identity", "is_local_address"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TCP_ESTABLISHED = 1
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSGHDR = struct.Struct("=IHHII")
_REQ_V2 = struct.Struct("=BBBxI")  # family, protocol, ext, (pad), states
# inet_diag_sockid: sport, dport (big-endian), src[4], dst[4] (u32 each, network order), if, cookie[2]
_SOCKID = struct.Struct("!HH16s16sI")
_COOKIE = struct.Struct("=II")
# inet_diag_msg: family, state, timer, retrans, sockid, expires, rqueue, wqueue, uid, inode
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")


@dataclass(frozen=True)
class Peer:
    """The other end of a connection: `local` (on this host), and then the uid owning its socket (None: no live
    socket was found for it)."""

    local: bool
    uid: int | None = None


_local_cache: dict[str, bool] = {}


def is_local_address(addr: str) -> bool:
    """Whether `addr` is an address of this host (in this process's network namespace at the time of the first
    call for it: the answer is kept): one a socket can bind."""
    if addr not in _local_cache:
        ip = ipaddress.ip_address(addr)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback:
            _local_cache[addr] = True
        else:
            fam = socket.AF_INET6 if isinstance(ip, ipaddress.IPv6Address) else socket.AF_INET
            try:
                with socket.socket(fam, socket.SOCK_STREAM) as s:
                    s.bind((str(ip), 0))
                _local_cache[addr] = True
            except OSError:
                _local_cache[addr] = False
    return _local_cache[addr]


def _packed(addr: str) -> tuple[int, bytes]:
    """(family, 16 address bytes as sock_diag wants them) of `addr` (a v4-mapped IPv6 address: as IPv4)."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return socket.AF_INET, ip.packed + bytes(12)
    return socket.AF_INET6, ip.packed


class Identity:
    """Looks up the owner of a connection's other end (`peer(sock)`). Make it before a change of network
    namespace: its netlink socket keeps asking the namespace it was made in."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self._seq = 0
        try:
            self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
            self._nl.settimeout(2.0)
        except (OSError, AttributeError):  # (no netlink: /proc/net then, in this process's namespace)
            self._nl = None
        self._proc = [open(f"/proc/{os.getpid()}/net/{t}", "rb") for t in ("tcp", "tcp6")  # noqa: SIM115
                      if os.path.exists(f"/proc/{os.getpid()}/net/{t}")]  # (kept open: the namespace of now)

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
        for f in self._proc:
            f.close()

    def peer(self, sock: socket.socket) -> Peer:
        """Who is at the other end of the connected TCP socket `sock` (see the module docstring)."""
        raddr, rport = sock.getpeername()[:2]
        laddr, lport = sock.getsockname()[:2]
        found = self.lookup(raddr, rport, laddr, lport)
        if found is not None:
            return Peer(True, found)
        return Peer(is_local_address(raddr), None)

    def lookup(self, src: str, sport: int, dst: str, dport: int) -> int | None:
        """The uid of the live, connected socket of this host whose local end is src:sport and remote end
        dst:dport (exactly), None if there is none."""
        if self._nl is not None:
            try:
                return self._diag(src, sport, dst, dport)
            except OSError:
                pass
        return self._proc_lookup(src, sport, dst, dport)

    def _diag(self, src: str, sport: int, dst: str, dport: int) -> int | None:
        assert self._nl is not None
        fam, s = _packed(src)
        fam_d, d = _packed(dst)
        if fam != fam_d:
            return None
        out = None
        for family in ((fam, socket.AF_INET6) if fam == socket.AF_INET else (fam,)):
            if family == socket.AF_INET6 and fam == socket.AF_INET:  # (a v4-mapped dual-stack socket)
                s6, d6 = b"\0" * 10 + b"\xff\xff" + s[:4], b"\0" * 10 + b"\xff\xff" + d[:4]
            else:
                s6, d6 = s, d
            out = self._ask(family, s6, sport, d6, dport)
            if out is not None:
                return out
        return out

    def _ask(self, family: int, src: bytes, sport: int, dst: bytes, dport: int) -> int | None:
        assert self._nl is not None
        self._seq += 1
        body = _REQ_V2.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + _SOCKID.pack(
            sport, dport, src, dst, 0) + _COOKIE.pack(_INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
        msg = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, self._seq, 0) + body
        self._nl.send(msg)
        while True:
            data = self._nl.recv(65536)
            at = 0
            while at + _NLMSGHDR.size <= len(data):
                length, kind, _flags, seq, _pid = _NLMSGHDR.unpack_from(data, at)
                if length < _NLMSGHDR.size:
                    return None
                if seq == self._seq:
                    if kind == NLMSG_ERROR:
                        return None  # (ENOENT: no such socket)
                    return self._uid_of(data[at + _NLMSGHDR.size: at + length])
                at += (length + 3) & ~3

    @staticmethod
    def _uid_of(msg: bytes) -> int | None:
        if len(msg) < _MSG_HEAD.size + _SOCKID.size + _COOKIE.size + _MSG_TAIL.size:
            return None
        _fam, state, _t, _r = _MSG_HEAD.unpack_from(msg, 0)
        _exp, _rq, _wq, uid, inode = _MSG_TAIL.unpack_from(msg, _MSG_HEAD.size + _SOCKID.size + _COOKIE.size)
        return uid if state == TCP_ESTABLISHED and inode != 0 else None

    def _proc_lookup(self, src: str, sport: int, dst: str, dport: int) -> int | None:
        want = (_hexaddr(src), sport, _hexaddr(dst), dport)
        for f in self._proc:
            f.seek(0)
            for line in f.read().decode(errors="replace").splitlines()[1:]:
                cols = line.split()
                if len(cols) < 10:
                    continue
                la, lp = cols[1].rsplit(":", 1)
                ra, rp = cols[2].rsplit(":", 1)
                got = (_norm(la), int(lp, 16), _norm(ra), int(rp, 16))
                if got == want and cols[3] == "01" and cols[9] != "0":
                    return int(cols[7])
        return None


def _hexaddr(addr: str) -> str:
    """`addr` as the (normalized) hex of /proc/net/tcp*."""
    fam, raw = _packed(addr)
    return raw[:4].hex() if fam == socket.AF_INET else raw.hex()


def _norm(col: str) -> str:
    """An address column of /proc/net/tcp* as `_hexaddr` writes it: bytes in network order; a v4-mapped IPv6
    address as its IPv4 part."""
    b = bytes.fromhex(col)
    if len(b) == 4:
        return b[::-1].hex()  # (/proc prints the u32 in host order, little-endian here)
    words = b"".join(b[i:i + 4][::-1] for i in range(0, 16, 4))
    if words[:12] == b"\0" * 10 + b"\xff\xff":
        return words[12:].hex()
    return words.hex()
