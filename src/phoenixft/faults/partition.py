"""Network partitions (`--inject partition:node=I@step=S[,for=T][,wait=W]`): a host cut off, alive.

A partition is fired by the node agent of the host in slot I (its workers cannot fire it: they are
what gets cut off). `PartitionInjector.tick()`, called from the agent's heartbeat loop, watches
the job's progress; once the job has completed step S-1 (so within one heartbeat of step S
starting) it claims the fault in the store (it fires once per run, also when the node in slot I
was replaced meanwhile), records it (`fault/<i>`, an event), and only then
takes the link that carries the agent's address down (`ip link set dev IF down`): its processes
live on, but nothing reaches them and nothing leaves. Every rank of the job holds step S at its start
until the agent has taken the fault in hand (`fault/<i>/done`, set just before the cut, or when it
cannot be made), so the cut falls in step S however fast the job trains and however seldom the agent
looks. After T seconds (`for=`) a timer brings the
link back up; without `for=` it stays down until the agent gives up on the control plane
(`--control-plane-timeout`) and exits, which brings it back up on the way out. With `wait=W` the
agent first waits until the job is whole (full size, and a warm spare if it has spares), at most W
seconds, the workers holding the step meanwhile, as `wait=` does for the faults workers fire.

It needs `ip` (iproute2) and the right to change links (root, or CAP_NET_ADMIN; in a network
namespace, the namespace's own), and a host with its own address: a loopback address cannot be
cut (`phoenixft run` refuses partition faults). A partition that cannot be made is recorded as a
`fault_failed` event with the reason, and the run goes on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

from phoenixft.controlplane import Store, keys, sealed
from phoenixft.controlplane.values import parse_int
from phoenixft.faults import struck
from phoenixft.faults.kinds import Point
from phoenixft.faults.spec import FaultSpec

__all__ = ["PartitionError", "LinkCut", "interface_of", "cut_link", "PartitionInjector"]

IP_TIMEOUT_S = 10.0


class PartitionError(Exception):
    """The link could not be taken down (no `ip`, no permission, no interface with that address)."""


def _ip(*args: str) -> str:
    exe = shutil.which("ip")
    if exe is None:
        raise PartitionError("`ip` (iproute2) is not installed on this host")
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PartitionError(f"`ip {' '.join(args)}` did not finish within {IP_TIMEOUT_S:g}s") from None
    if p.returncode != 0:
        raise PartitionError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()[:200]}")
    return p.stdout


def interface_of(addr: str) -> str:
    """The interface that holds `addr` on this host (network namespace)."""
    addr = addr.strip("[]")
    for line in _ip("-o", "addr", "show").splitlines():
        parts = line.split()
        for i, word in enumerate(parts[:-1]):
            if word in ("inet", "inet6") and parts[i + 1].split("/")[0] == addr:
                ifname = parts[1].split("@")[0]
                if ifname == "lo" or "LOOPBACK" in line:
                    raise PartitionError(f"{addr} is a loopback address: a partition needs a host with its own "
                                         "address on a real link")
                return ifname
    raise PartitionError(f"no interface of this host holds {addr}")


class LinkCut:
    """A link taken down; `heal()` (idempotent, thread-safe) brings it back up."""

    def __init__(self, ifname: str) -> None:
        self.ifname = ifname
        self.t_cut = time.time()
        self.t_healed: float | None = None
        self._lock = threading.Lock()
        _ip("link", "set", "dev", ifname, "down")

    def heal(self) -> None:
        with self._lock:
            if self.t_healed is not None:
                return
            self.t_healed = time.time()
            try:
                _ip("link", "set", "dev", self.ifname, "up")
            except PartitionError as e:  # nothing left to tell it to: the host is on its own
                print(f"phoenixft partition: could not bring {self.ifname} back up: {e}", flush=True)


def cut_link(addr: str) -> LinkCut:
    return LinkCut(interface_of(addr))


class PartitionInjector:
    """The partition faults of one node agent; `tick(store)` once per heartbeat, `heal()` on exit."""

    def __init__(self, faults: list[FaultSpec], node: str, bind: str, token: str | None) -> None:
        self.todo = [f for f in faults if f.point is Point.HEARTBEAT]
        self.node, self.bind, self.token = node, bind, token
        self.cut: LinkCut | None = None
        self._held: dict[int, float] = {}  # fault index -> when its hold began
        self._topo: tuple[int, list[str]] | None = None  # (epoch, nodes) of the last verified topology
        self._timer: threading.Timer | None = None

    def _slot(self, store: Store) -> int | None:
        """This node's slot in the current epoch (from a topology whose signature verifies)."""
        from phoenixft.controlplane.auth import sign_topology

        e = parse_int(sealed.get(store, keys.EPOCH), keys.EPOCH, -1)
        if e < 0:
            return None
        if self._topo is None or self._topo[0] != e:
            names = [keys.topo(e), keys.topo_sig(e)]
            if not self.token or not store.check(names):
                return None
            raw, sig = store.multi_get(names)
            if bytes(sig).decode(errors="replace") != sign_topology(self.token, e, bytes(raw)):
                return None
            self._topo = (e, list(json.loads(raw)["nodes"]))
        nodes = self._topo[1]
        return nodes.index(self.node) if self.node in nodes else None

    def tick(self, store: Store) -> None:
        if not self.todo or self.cut is not None:
            return
        slot = self._slot(store)
        if slot is None:
            return
        progress = parse_int(sealed.get(store, keys.PROGRESS), keys.PROGRESS, 0)
        for f in list(self.todo):
            if slot not in f.nodes or f.step is None or progress < f.step - 1:
                continue
            if sealed.has(store, keys.fault_fired(f.index)):  # fired on the node this one replaced: once a run
                self.todo.remove(f)
                continue
            if f.wait and not sealed.has(store, keys.JOB_WHOLE):  # (the workers hold the step meanwhile)
                since = self._held.setdefault(f.index, time.monotonic())
                if time.monotonic() - since < f.wait:
                    return
            self.todo.remove(f)
            self._fire(store, f, slot, progress + 1)
            return

    def _fire(self, store: Store, f: FaultSpec, slot: int, step: int) -> None:
        try:
            if not sealed.claim(store, keys.fault_claim(f.index, slot)):
                return
            rec = {"t": time.time(), "kind": "fault", "spec": f.text, "index": f.index, "fault": "partition",
                   "node": self.node, "slot": slot, "step": step, "phase": "partition", "for": f.duration or None,
                   "address": self.bind}
            try:
                ifname = interface_of(self.bind)
            except PartitionError as e:
                sealed.append(store, keys.EVENTS, {"t": time.time(), "kind": "fault_failed", "spec": f.text,
                                                   "node": self.node, "error": str(e)})
                return
            rec["interface"] = ifname
            if sealed.claim(store, keys.fault_fired(f.index)):
                sealed.put(store, keys.fault(f.index), json.dumps(rec))
            struck.mark(store, self.node, f)  # (declared dead while cut off: the fault's failure, not the host's)
            sealed.append(store, keys.EVENTS, rec)
            sealed.put(store, keys.fault_done(f.index), "1")  # the workers holding the step go on (into the cut)
            store.check([keys.EVENTS])  # a set is not acknowledged: an answered request flushes them first
            try:
                self.cut = LinkCut(ifname)
            except PartitionError as e:
                sealed.append(store, keys.EVENTS, {"t": time.time(), "kind": "fault_failed", "spec": f.text,
                                                   "node": self.node, "error": str(e)})
                return
            print(f"phoenixft agent {self.node}: partition fault: {ifname} ({self.bind}) is down"
                  + (f" for {f.duration:g}s" if f.duration else " until this agent exits"), flush=True)
            if f.duration:
                self._timer = threading.Timer(f.duration, self._heal_by_timer)
                self._timer.daemon = True
                self._timer.start()
        finally:
            if self.cut is None:  # not cut (or cut by the agent that claimed it first): the step goes on
                sealed.put(store, keys.fault_done(f.index), "1")

    def _heal_by_timer(self) -> None:
        if self.cut is not None:
            self.cut.heal()
            print(f"phoenixft agent {self.node}: partition healed: {self.cut.ifname} is up again", flush=True)

    def heal(self) -> None:
        """On the agent's way out (its workers already killed): bring the link back up."""
        if self._timer is not None:
            self._timer.cancel()
        if self.cut is not None:
            self.cut.heal()
