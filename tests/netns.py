"""Test hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

`Hosts(["head", "h1", ...])` builds, under a tag `pft<pid>x<hex>` unique to this harness:

* a switch namespace `<tag>-sw` holding the bridge `br0`;
* per host a namespace `<tag>-<host>` with `lo` up and `eth0`, one end of a veth pair whose other
  end (`p<i>`) sits in the switch namespace, enslaved to `br0`; host i has the address
  10.231.0.<i+1>/24 (a private test subnet: it exists only inside these namespaces).

Nothing is added to the machine's own network namespace: both ends of every veth pair are created
directly inside the test namespaces, so no address or route of the machine changes and only the
test namespaces' addresses are ever bound. `run(host, argv)` starts a process inside a host
(`ip netns exec`, its own session; with `own_shm`, on a /dev/shm of its own, a tmpfs mounted in the
process's own mount namespace, which its children share and which goes when the last of them exits:
a host that shares no memory file with the others); `connect(host, addr)` opens a store client from inside a host
(setns on this thread for the moment of the connect; the socket stays in that namespace).

Cleanup: `close()` SIGKILLs every process group this harness started, then every process still
inside its namespaces (`ip netns pids`: only processes the test started can be there), deletes the
namespaces (a veth pair and the bridge go with their namespace), and checks that none is left. It
runs on every exit of the `with` block (a failing assertion, Ctrl-C) and at interpreter exit; a
harness whose process was SIGKILLed leaves namespaces tagged with a dead PID, which the next
harness removes when it starts (`sweep_orphans`). Needs root and `ip` (iproute2); `unavailable()`
says why not, for a skip.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["Hosts", "unavailable", "sweep_orphans", "namespaces", "SUBNET"]

SUBNET = "10.231.0"
PREFIX = "pft"
CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def namespaces() -> list[str]:
    """Names of every network namespace (`ip netns list`)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


_reason: list[str | None] = []


def unavailable() -> str | None:
    """None if network namespaces can be built here; else why not (for pytest.skip)."""
    if _reason:
        return _reason[0]
    why: str | None = None
    if os.geteuid() != 0:
        why = f"network-namespace tests need root (uid 0); this is uid {os.geteuid()}"
    elif shutil.which("ip") is None:
        why = "network-namespace tests need `ip` (iproute2): apt-get install -y iproute2"
    else:
        probe = f"{PREFIX}{os.getpid()}xprobe{secrets.token_hex(2)}"
        p = _ip("netns", "add", probe, check=False)
        if p.returncode != 0:
            why = f"`ip netns add` failed here (no CAP_SYS_ADMIN?): {p.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _reason.append(why)
    return why


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process inside namespace `ns` (only the test's own can be there) and wait for them."""
    for _ in range(50):
        p = _ip("netns", "pids", ns, check=False)
        pids = [int(x) for x in p.stdout.split() if x.strip().isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "del", ns, check=False)


def sweep_orphans() -> list[str]:
    """Delete the namespaces of harnesses whose process is gone (SIGKILLed mid-test); returns them."""
    gone = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        digits = ns[len(PREFIX):].split("x", 1)[0]
        if digits.isdigit() and not _pid_alive(int(digits)):
            _delete(ns)
            gone.append(ns)
    return gone


class Hosts:
    """Test hosts in network namespaces on one bridge; a context manager (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not 1 <= len(names) <= 200:
            raise ValueError(f"host names must be unique, 1-200 of them: {names}")
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.names = list(names)
        self.addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(names)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def all_namespaces(self) -> list[str]:
        return [self.switch] + [self.ns(h) for h in self.names]

    # ------------------------------------------------------------------ build
    def __enter__(self) -> Hosts:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        sweep_orphans()
        sw = self.switch
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, h in enumerate(self.names):
            ns = self.ns(h)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # both ends created inside the test namespaces: nothing appears in the machine's own
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # ------------------------------------------------------------------ use
    def run(self, host: str, argv: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None,
            own_shm: bool = False) -> subprocess.Popen[bytes]:
        """Start argv inside `host` (its own session; `own_shm`: on a /dev/shm of its own, see the module
        docstring); stdout+stderr to `log` if given."""
        out: Any = subprocess.DEVNULL
        if log is not None:
            out = open(log, "ab")
            self._logs.append(out)
        if own_shm:  # (`ip netns exec` gives the process a mount namespace of its own: the tmpfs stays in it)
            argv = ["sh", "-c", 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"', "sh", *argv]
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        self.procs.append(p)
        return p

    def pids(self, host: str) -> list[int]:
        """Processes inside `host` now."""
        p = _ip("netns", "pids", self.ns(host), check=False)
        return [int(x) for x in p.stdout.split() if x.strip().isdigit()]

    @contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """This thread in `host`'s network namespace for the duration (sockets made meanwhile stay there)."""
        libc = ctypes.CDLL(None, use_errno=True)
        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.ns(host)}", os.O_RDONLY)
        try:
            if libc.setns(there, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.ns(host)} failed")
            try:
                yield
            finally:
                if libc.setns(here, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back into the test's own namespace failed")
        finally:
            os.close(here)
            os.close(there)

    def connect(self, host: str, addr: str, timeout_s: float = 30.0) -> Any:
        """A TCPStore client of `addr`, connected from inside `host`."""
        from phoenixft.distributed.comm import connect_store

        with self.inside(host):
            return connect_store(addr, timeout_s)

    def link(self, host: str, up: bool) -> None:
        """Take `host`'s eth0 down or bring it up (the harness's own control of its test network)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Kill what was started, delete every namespace (with its links); idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            try:
                _delete(ns)
            except Exception:  # noqa: BLE001 - keep deleting the others; leftovers() reports it
                pass
        for f in self._logs:
            f.close()
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """This harness's namespaces that still exist (empty after close())."""
        mine = set(self.all_namespaces())
        return [n for n in namespaces() if n in mine]

