"""Background replication of the committed optimizer shard to k peers on other nodes.

After step s commits, `start(s)` hands the job to a background thread that sends the committed
half's payload (exp_avg, exp_avg_sq; never the parameters) to each holder, in chunks, over the
epoch's dedicated replication process group, and receives the peers' payloads into the staging
half of the matching `Holding`. The staging half is received into in place (no private buffer, no
copy): it is marked torn before the transfer starts, so a transfer that fails or is abandoned leaves
it invalid and the committed half untouched; a recovery retires the epoch's groups (aborted, their
sockets shut down) before anything reads or rewrites a holding.

Each byte is checksummed once per step, by its sender (the checksum travels in the header and is
committed with the replica). The holder does not hash what it received: a replica is only ever read
by a recovery, and a recovery verifies every held copy against that committed checksum before it is
offered (`Protection.descriptor`), and its receiver checks every byte it gets again, so a replica
corrupted in flight or at rest is rejected where it would be used, never loaded. Hashing on receipt
as well would double the hashing of every step (43 MB at ~7 GB/s, 6 ms of a 2-core step on `small`)
for an earlier report of the same rejection. What the header says (shard, size) is checked on receipt.
Before the
gradient reduce-scatter of
step s+1 the training loop calls `wait(s)`: a rank that entered the reduce-scatter has therefore
always committed its replicas on both sides (see DESIGN: this is what makes a consistent
recovery point exist for every combination of survivors).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from phoenixft.distributed.comm import EpochComm, alltoallv, wait_work
from phoenixft.errors import PeerFailure, RunAborted
from phoenixft.protect.snapshot import Holding, ShardState, checksum
from phoenixft.protect.transport import ReplicaTransport, Routes, TransportMode

__all__ = ["Replicator", "ReplicaPlan"]

# A replication job has the next step's compute (hundreds of ms) to finish: its waits poll every 5 ms,
# not every 0.5 ms like the training thread's, so that the polls take less of that thread's GIL.
BACKGROUND_NAP_S = 0.005


@dataclass(kw_only=True)
class ReplicaPlan:
    shard: int
    send_to: list[int]  # ranks holding my shard, one per ring round
    recv_from: list[tuple[int, int]]  # (rank, shard) whose replica I keep, same rounds


_Incoming = tuple[int, torch.Tensor, Holding, int, ReplicaTransport]  # (shard, header, holding, half, backend)


@dataclass
class _Stats:
    jobs: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    last_job_s: float = 0.0  # wall seconds of the newest replication job
    last_cpu_s: float = 0.0  # CPU seconds the replication thread spent on it (copies, checksums, sends)
    last_bytes: int = 0  # bytes it replicated (sent, or read by holders on this host)
    last_shm_bytes: int = 0  # of the bytes it received, those read through host shared memory


class Replicator:
    def __init__(
        self,
        state: ShardState,
        holding_factory: Callable[[int], Holding],
        chunk_numel: int,
        abort_check: Callable[[], str | None],
        timeout_s: float,
        on_in_flight: Callable[[int, Callable[[], None]], None] | None = None,
        after_commit: Callable[[int, dict[int, Holding]], None] | None = None,
        transport: str | TransportMode = TransportMode.AUTO,
        before_job: Callable[[int, Callable[[], str | None]], None] | None = None,
    ) -> None:
        self.state = state
        self.transport = TransportMode.parse(transport)  # which backends each pair may use (transport/)
        self._routes: Routes | None = None  # this epoch's, made by the first job
        self.holdings: dict[int, Holding] = {}
        self._holding_factory = holding_factory
        self.chunk = max(1, chunk_numel)
        self._abort_check = abort_check
        self.timeout_s = timeout_s
        self._on_in_flight = on_in_flight
        self._after_commit = after_commit
        self._before_job = before_job  # (step, abort check): e.g. the scrubber's share of the step (scrub.py)
        self._cv = threading.Condition()
        self._job: int | None = None
        self._done = -1
        self._error: str | None = None
        self._ended: RunAborted | None = None  # the run ended while a job waited (abort_check raised it)
        self._abort = threading.Event()
        self._stop = False
        self.comm: EpochComm | None = None
        self.plan: ReplicaPlan | None = None
        self.scheme: Any = None  # another redundancy scheme for this epoch (phoenixft.protect.redundancy), or None
        self.stats = _Stats()
        self._thread = threading.Thread(target=self._run, name="phoenixft-replicator", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- main-thread API
    def configure(self, comm: EpochComm, plan: ReplicaPlan | None, scheme: Any = None) -> None:
        """The epoch's groups and plan; with `scheme` (e.g. `redundancy.ErasureProtector`) each job
        is `scheme.protect(self, step)` instead of sending replicas."""
        with self._cv:
            assert self._job is None, "reconfigure while a job runs"
            self.comm, self.plan, self.scheme = comm, plan, scheme
            self._drop_routes()
            self._error = None
            self._ended = None
            self._done = -1
            self._abort.clear()

    def holding(self, shard: int) -> Holding:
        if shard not in self.holdings:
            self.holdings[shard] = self._holding_factory(shard)
        return self.holdings[shard]

    def start(self, step: int) -> None:
        """Protect committed step `step` in the background, once the job in flight (if any) has ended: a job is
        never replaced by the next one (its peers run it: a replaced job left them waiting for this rank)."""
        with self._cv:
            if self._job is not None:
                self._cv.wait_for(lambda: self._job is None or self._stop, timeout=self.timeout_s)
            self._job = step
            self._cv.notify_all()

    def wait(self, step: int) -> float:
        """Block until the replication of `step` committed on both sides; returns seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            while self._done < step and self._error is None and self._ended is None:
                if not self._cv.wait(timeout=self.timeout_s):
                    raise PeerFailure(f"replication of step {step}: timed out after {self.timeout_s:.1f}s")
            if self._ended is not None:  # not a failure to recover from: the run is over
                raise RunAborted(str(self._ended))
            if self._error is not None:
                raise PeerFailure(self._error)
        return time.perf_counter() - t0

    def settle(self, timeout_s: float) -> bool:
        """Let the in-flight job finish (a planned drain: every peer is alive and replicates the same step,
        so it completes); True once the thread is idle, False if it is still busy after `timeout_s`."""
        with self._cv:
            return self._cv.wait_for(lambda: self._job is None, timeout=timeout_s)

    def abort(self, timeout_s: float = 5.0) -> None:
        """Make an in-flight job give up and wait until the thread is idle."""
        self._abort.set()
        with self._cv:
            self._cv.wait_for(lambda: self._job is None, timeout=timeout_s)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._abort.set()
            self._cv.notify_all()
            if self._job is None:
                self._drop_routes()

    def _drop_routes(self) -> None:
        if self._routes is not None:
            self._routes.close()
            self._routes = None

    # ---------------------------------------------------------------- background thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._stop)
                if self._stop:  # (closed while a job ran: that job's epoch routes are dropped here)
                    self._drop_routes()
                    return
                step = self._job
            assert step is not None
            err: str | None = None
            ended: RunAborted | None = None
            try:
                self._replicate(step)
            except RunAborted as e:
                ended = e
            except PeerFailure as e:
                err = str(e)
            except Exception as e:  # noqa: BLE001 - surfaced to the training loop
                err = f"replication of step {step}: {type(e).__name__}: {e}"
            with self._cv:
                if ended is not None:
                    self._ended = ended
                elif err is None:
                    self._done = step
                else:
                    self._error = err
                self._job = None
                self._cv.notify_all()

    def _abort_reason(self) -> str | None:
        if self._abort.is_set():
            return "recovery started"
        return self._abort_check()

    # ---------------------------------------------------------------- for a redundancy scheme's job
    def wait_all(self, works: list[Any], what: str, nap_s: float = BACKGROUND_NAP_S) -> None:
        """Wait for a job's transfers (one deadline for all), giving up when a recovery starts; `nap_s`: the
        longest nap between polls (a short exchange the job waits on before its transfers takes a shorter one)."""
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            wait_work(w, what, self._abort_reason, max(0.1, deadline - time.monotonic()), nap_s)

    @contextlib.contextmanager
    def commit_guard(self, comm: EpochComm, step: int) -> Iterator[None]:
        """Held while a job commits what it received; raises if a recovery superseded the job."""
        with self._cv:
            if self._abort.is_set() or self.comm is not comm:
                raise PeerFailure(f"replication of step {step}: superseded by a recovery")
            yield

    def in_flight(self, step: int, joined: Any) -> None:
        """Step's transfers are posted (a `replicate` kill strikes here). `joined` is the job's first
        exchange: once it completed, every peer has entered the job (its scrub share done: gloo's and NCCL's
        all-to-all complete only when every rank of the group posted its part), so a fault that waits for
        it strikes at the same point of the protocol whatever the threads' timing."""
        if self._on_in_flight is not None:
            self._on_in_flight(step, lambda: wait_work(joined, f"replication of step {step}: the first exchange",
                                                       self._abort_reason, self.timeout_s, BACKGROUND_NAP_S))

    def _replicate(self, step: int) -> None:
        if self._before_job is not None:
            self._before_job(step, self._abort_reason)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        if self.scheme is not None:  # parity instead of replicas: the scheme moves the bytes
            sent, received = self.scheme.protect(self, step)
            if self._after_commit is not None:
                self._after_commit(step, received)
            dt = time.perf_counter() - t0
            self.stats.jobs += 1
            self.stats.bytes_sent += sent
            self.stats.seconds += dt
            self.stats.last_job_s, self.stats.last_cpu_s, self.stats.last_bytes = dt, time.thread_time() - c0, sent
            self.stats.last_shm_bytes = 0  # (parity moves over TCP)
            return
        assert self.comm is not None and self.plan is not None
        comm, plan = self.comm, self.plan
        routes = self._epoch_routes(step)
        mine = self.state.half_with(step)
        if mine is None:
            raise PeerFailure(f"replication of step {step}: no committed half holds it")
        payload = self.state.payload(mine).reshape(-1)
        n = payload.numel()
        crc = checksum(payload)
        self.state.header[mine, 1] = crc
        hdr = torch.tensor([plan.shard, step, crc, n, mine], dtype=torch.int64)
        works, incoming = self._post(step, routes, hdr, payload)
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            wait_work(w, f"replication of step {step}", self._abort_reason, max(0.1, deadline - time.monotonic()),
                      BACKGROUND_NAP_S)
        shm_bytes = self._complete(step, incoming, n)
        committed: dict[int, Holding] = {}
        with self._cv:
            if self._abort.is_set() or self.comm is not comm:
                raise PeerFailure(f"replication of step {step}: superseded by a recovery")
            for shard, rhdr, h, half, _ in incoming:
                # the sender's checksum is committed with it; the replica is verified where it is used
                h.commit(half, int(rhdr[1]), int(rhdr[2]), (shard, comm.world))
                committed[shard] = h
        if self._after_commit is not None:
            self._after_commit(step, committed)
        dt = time.perf_counter() - t0
        self.stats.jobs += 1
        self.stats.bytes_sent += n * 4 * len(plan.send_to)
        self.stats.seconds += dt
        self.stats.last_job_s, self.stats.last_cpu_s = dt, time.thread_time() - c0
        self.stats.last_bytes = n * 4 * len(plan.send_to)
        self.stats.last_shm_bytes = shm_bytes

    def _epoch_routes(self, step: int) -> Routes:
        """The epoch's backend for each pair: the handshake, made by the epoch's first job."""
        assert self.comm is not None and self.plan is not None
        if self._routes is None:
            self._routes = Routes.handshake(
                self.comm.repl, self.comm.world, self.transport, self.state, self.plan.send_to,
                [src for src, _ in self.plan.recv_from],
                lambda w, what: wait_work(w, f"{what} (step {step})", self._abort_reason, self.timeout_s,
                                          BACKGROUND_NAP_S))
        return self._routes

    def _post(self, step: int, routes: Routes, hdr: torch.Tensor, payload: torch.Tensor
              ) -> tuple[list[object], list[_Incoming]]:
        """Start one ring round per holder: the header, then the payload chunks of the pairs that move over
        the group (every rank makes the same collective calls; a pair that does not contributes nothing)."""
        assert self.comm is not None and self.plan is not None
        pg, world, n = self.comm.repl, self.comm.world, payload.numel()
        works: list[object] = []
        incoming: list[_Incoming] = []
        for dst, (src, shard) in zip(self.plan.send_to, self.plan.recv_from, strict=True):
            w, rhdr, _ = alltoallv(pg, world, {dst: hdr}, {src: 5}, dtype=torch.int64)
            works.append(w)
            joined = w
            # received straight into the holding's staging half, marked torn until its checksum matched:
            # the committed half stays the recovery point whatever happens to this transfer
            h = self.holding(shard)
            half = h.staging()
            h.begin_write(half)
            buf = h.payload(half).view(-1)
            if buf.numel() != n:
                raise PeerFailure(f"replication of step {step}: holding of shard {shard} has {buf.numel()} "
                                  f"elements, the shard {n}")
            out, inn = routes.to(dst), routes.from_(src)
            if routes.over_group:
                for off in range(0, n, self.chunk):
                    m = min(self.chunk, n - off)
                    recv, into = inn.receive(src, buf[off : off + m])
                    w, _, _ = alltoallv(pg, world, out.send(dst, payload[off : off + m]), recv, out=into)
                    works.append(w)
                    if off == 0:
                        self.in_flight(step, joined)
            else:
                self.in_flight(step, joined)
            incoming.append((shard, rhdr, h, half, inn))
        return works, incoming

    def _complete(self, step: int, incoming: list[_Incoming], n: int) -> int:
        """Check each header; the pairs that did not move over the group fetch their bytes now, from the half
        the header names (the owner's committed half of that step: not rewritten before this job ends).
        Returns the bytes so fetched."""
        fetched = 0
        for shard, rhdr, h, half, inn in incoming:
            self._check_header(step, shard, rhdr, n)
            if inn.over_group:
                continue
            why = self._abort_reason()
            if why:
                raise PeerFailure(f"replication of step {step}: {why}")
            try:
                fetched += inn.complete(h.payload(half).view(-1), int(rhdr[4]))
            except (OSError, ValueError) as e:
                raise PeerFailure(f"replication of step {step}: reading shard {shard} from its owner's memory: "
                                  f"{e}") from e
        return fetched

    @staticmethod
    def _check_header(step: int, shard: int, rhdr: torch.Tensor, n: int) -> None:
        r_shard, r_step, _, r_numel, r_half = (int(x) for x in rhdr.tolist())
        if r_shard != shard or r_numel != n or r_half not in (0, 1):
            # never committed (the other half stays the recovery point), and never silent:
            # a recovery epoch re-forms the groups and the next step replicates afresh
            raise PeerFailure(f"replica of shard {shard} (step {r_step}): its header says shard {r_shard} "
                              f"of {r_numel} elements (half {r_half}), the holding is for shard {shard} of {n}")
