"""One rank's membership in a job, across epochs: the part of a worker that every front door shares.

A rank joins the run's epochs as the control plane publishes them: it waits for its assignment (a
spare until it is promoted), builds the epoch's process groups (distributed/comm.py) while watching the
epoch's failure flag, restores its state of the resume step as the plan says, checks the invariants
I1-I4 with every member, and trains. On any `PeerFailure` it posts a descriptor of what it holds
(protect/protection.py), waits for the next epoch's plan, and joins it (`recover`). A fenced node never
writes again; a drained node leaves at the drain's step boundary.

`Member` holds all of that; what differs between the built-in trainer (runtime/worker.py) and a user's
own training script (phoenixft.api) is what a rank's state is, how it is restored (`_restore`) and what
follows a join (`_joined`). Protection, recovery and fault injection see the rank through its
`RankContext` (core/context.py).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch

from phoenixft.config import RunConfig
from phoenixft.controlplane import Store, auth, exists_many, keys, poll_interval, sealed
from phoenixft.controlplane.keeper import Keeper
from phoenixft.controlplane.signed import CONFIG_WAIT_S, end_record, env_token, run_ended, set_signed, wait_verified
from phoenixft.controlplane.values import parse_int
from phoenixft.controlplane.watcher import FailureWatcher
from phoenixft.core.context import RankContext
from phoenixft.distributed import device
from phoenixft.distributed.comm import EpochComm, connect_store
from phoenixft.distributed.device import Device
from phoenixft.distributed.topology import Topology
from phoenixft.errors import Drained, PeerFailure, RunAborted, Unhealable, user_traceback
from phoenixft.protect.protection import Protection
from phoenixft.recovery import restore
from phoenixft.recovery.evidence import installed_seen
from phoenixft.recovery.invariants import check_invariants, failure_message

__all__ = ["Member", "Joined"]

RUN_DIR_WAIT_S = 5.0  # ... a run directory
EVIDENCE_WAIT_S = 5.0  # ... the plan's evidence (published before its topology; put back if overwritten)
FINAL_ACK_S = 10.0  # rank 0 writes the final state again until the launcher has it, at most this long
FINAL_REWRITE_S = 0.05
WAIT_KEY_NAP_S = 0.05  # the longest a worker sleeps between two looks for a key it waits for (a spare's assignment)
WAIT_END_CHECK_S = 0.1  # ... and how often it looks meanwhile whether the run has ended
RUN_END_CHECK_S = 0.5  # how often a rank looks at a step boundary whether the run has ended (one store request)
SPARE_WAIT_S = 10 * 24 * 3600.0  # a spare waits this long for its promotion (the run's end releases it first)
FIRST_EPOCH_WAIT_S = 600.0


class Joined:
    """The config and the epoch a rank starts from, as the control plane has them when it connects."""

    def __init__(self, store_addr: str, node_id: str, local_rank: int, run_id: str, incarnation: int) -> None:
        self.store: Store = connect_store(store_addr)
        sealed.bind(env_token(), run_id)  # what this rank writes to the store and acts on is sealed
        raw_cfg = wait_verified(self.store, env_token(), run_id, keys.CONFIG, CONFIG_WAIT_S)
        if raw_cfg is None:
            raise RunAborted(f"the job's config in the store is not signed with the key of run {run_id}: refusing "
                             "to train on it (something other than the job wrote it)")
        self.cfg = RunConfig.from_json(raw_cfg.decode())
        self.incarnation = incarnation
        self.cur: Topology | None = None  # restarted in place: the epoch it rejoins
        store, wid = self.store, f"{node_id}.{local_rank}"
        e0 = parse_int(sealed.get(store, keys.EPOCH), keys.EPOCH, -1) if incarnation > 0 else -1
        if e0 >= 0:
            self.cur = auth.verified_topology(store, e0, store.get(keys.topo(e0)))
        if incarnation > 0 and (self.cur is None or (node_id.startswith("s") and node_id not in self.cur.nodes)):
            # restarted before the run's first epoch was published, or as an idle spare: nothing to rejoin,
            # so a fresh start (the rejoin path waited 30 s for an epoch that never came while this node was
            # not ready, or found the spare in no epoch, and crashed again, each time, until --join-timeout
            # failed the run, or the agent gave the spare up, with a ready spare waiting)
            self.incarnation, self.cur = 0, None
            store.delete_key(keys.worker_exit(wid))  # (no recovery deals with it: none is needed)


class Member:
    """One rank across the run's epochs. A front door builds it, sets `ctx.trainer` (the rank's state),
    `protection` and `device`, and implements `_restore`."""

    device: Device
    protection: Protection
    user_group = False  # the epoch's groups include `user` (a script's own collectives)

    def __init__(self, store_addr: str, node_id: str, local_rank: int, run_id: str, threads: int,
                 incarnation: int = 0) -> None:
        start = Joined(store_addr, node_id, local_rank, run_id, incarnation)
        self.start_topo = start.cur  # the current epoch's topology when restarted in place, else None
        self.node_id, self.local_rank, self.run_id = node_id, local_rank, run_id
        self.wid = f"{node_id}.{local_rank}"
        self.cfg: RunConfig = start.cfg
        self.incarnation = start.incarnation
        self.restarted = start.incarnation > 0
        self.watcher = FailureWatcher(start.store.independent())  # (its wait blocks)
        # what protection, recovery and fault injection see of this rank: its state, epoch, communicators
        self.ctx = RankContext(self.cfg, run_id, self.wid, node_id, start.store, self.watcher)
        self._side_store: Store | None = None  # for polls while the rendezvous blocks ctx.store (_build_comm)
        self._end_checked = 0.0  # when a step boundary last looked whether the run has ended
        self._first_after_join: int | None = None
        self._place(threads)

    def _place(self, threads: int) -> None:
        """This rank's CPU threads and device (CUDA: the GPU of its LOCAL_RANK, NCCL set up to report, not punish,
        a dead peer)."""
        torch.set_num_threads(threads)
        cfg = self.cfg
        self.device = device.place(cfg.device, self.local_rank, self.node_id, cfg.nodes, cfg.workers_per_node)

    def _attach_protection(self, gen: int) -> None:
        """The protection layer (replicator, redundancy scheme, persistent tier), attached to the rank's state;
        after a restart in place, with what this rank kept in shared memory adopted."""
        self.protection = Protection(self.ctx, self.ctx.coll_timeout)
        # what this rank wrote for others to find (its readiness, its descriptor): put back if overwritten
        self.keeper = Keeper(self.ctx.store).start(self.protection.bg_store or self.ctx.store)
        scheme = self.ctx.scheme = self.protection.scheme
        if scheme is not None and self.ctx.trainer is not None:
            scheme.attach(self.ctx.trainer.state)
        if scheme is not None and self.incarnation > 0:  # adopt what it kept in shared memory
            scheme.adopt(self.run_id, self.wid, gen)

    def announce(self) -> None:
        """This rank is ready for its epoch (the coordinator starts the run once every active rank is)."""
        self.keeper.put(keys.ready(self.wid), str(time.time()))
        if self.restarted:  # its earlier failure before the first step did not repeat (a transient one)
            self.ctx.store.delete_key(keys.start_failed(self.wid))

    def finish_hash(self, final: str) -> None:
        """Rank 0: the run's final state (JSON) and its end, published (see `_publish_final`)."""
        self._check_fence()
        self._publish_final(end_record(final, self.node_id, self.ctx.store))  # (its writer: signed.end_problem)

    def await_end(self) -> None:
        """Every rank but 0, after the final gather: until rank 0 published the run's end."""
        deadline = time.monotonic() + self.ctx.coll_timeout
        while time.monotonic() < deadline:
            if self._run_end() is not None:
                return
            if self.ctx.abort_reason():
                raise PeerFailure("failure during the final gather")
            time.sleep(0.02)
        raise PeerFailure("rank 0 did not publish the final state")

    def _publish_final(self, final: str) -> None:
        """The final state and the run's end, signed with the run key (the launcher believes only signed ones),
        written again every FINAL_REWRITE_S until the launcher says it has them (`final/seen`, sealed), at
        most FINAL_ACK_S: a stranger who overwrites them as they appear delays the end, and must keep winning
        every race for as long to make the run fail. A run that already ended otherwise (its --timeout, a
        failure, an interruption: an end signed with the run key) keeps that end: nothing is written."""
        deadline = time.monotonic() + FINAL_ACK_S
        while True:
            ended = self._run_end()
            if ended is not None and ended != "done":
                print(f"phoenixft worker {self.ctx.wid}: the run ended ({ended}) before its final state was "
                      "published; it is not", flush=True)
                return
            set_signed(self.ctx.store, env_token(), self.run_id, keys.FINAL, final)
            set_signed(self.ctx.store, env_token(), self.run_id, keys.RUN_STATE, "done")
            if sealed.has(self.ctx.store, keys.FINAL_SEEN) or time.monotonic() > deadline:
                return
            time.sleep(FINAL_REWRITE_S)

    def _run_dir(self) -> str:
        """Where the final model goes: the launcher's run directory (`run/dir`, sealed: one that does not verify
        is waited for, the launcher puts it back); '' where there is none (a head on another host)."""
        deadline = time.monotonic() + RUN_DIR_WAIT_S
        while self.ctx.store.check([keys.RUN_DIR]):
            v = sealed.get(self.ctx.store, keys.RUN_DIR)
            if v is not None:
                return v.decode(errors="replace")
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return ""

    def _wait_key(self, key: str, timeout_s: float, is_sealed: bool = False) -> bytes:
        """The value of `key` once it is there (`is_sealed`: and verifies); RunAborted if the run ends first or
        after `timeout_s`. Looked for every 5 ms at first, backing off to every WAIT_KEY_NAP_S (or the store's
        `poll_s`), and the run's end every WAIT_END_CHECK_S: a spare waits like this for its assignment the whole
        run, and must not cost the control plane hundreds of requests a second while it does."""
        deadline = time.monotonic() + timeout_s
        nap, cap, end_checked = 0.005, poll_interval(self.ctx.store, WAIT_KEY_NAP_S), 0.0
        while True:
            if self.ctx.store.check([key]):
                v = sealed.get(self.ctx.store, key) if is_sealed else self.ctx.store.get(key)
                if v is not None:
                    return v
            now = time.monotonic()
            if now - end_checked >= WAIT_END_CHECK_S:
                end_checked = now
                ended = self._run_end()
                if ended is not None:
                    raise RunAborted(f"run ended ({ended})")
            if now > deadline:
                raise RunAborted(f"no answer from the control plane for {key!r} after {timeout_s:.0f}s")
            time.sleep(nap)
            nap = min(nap * 1.5, cap)

    def await_membership(self) -> Topology:
        if self.node_id.startswith("s"):  # spare: wait, warm, to be promoted
            e = parse_int(self._wait_key(keys.assign(self.node_id), SPARE_WAIT_S, is_sealed=True),
                          keys.assign(self.node_id), 0)
        else:
            e = 0
        return auth.verified_topology(self.ctx.store, e, self._wait_key(keys.topo(e), FIRST_EPOCH_WAIT_S),
                                     FIRST_EPOCH_WAIT_S)

    def _check_fence(self) -> None:
        """A fenced node (declared dead while it was stopped or cut off) must never write again."""
        if sealed.has(self.ctx.store, keys.fence(self.node_id)):
            raise RunAborted(f"{self.node_id} was fenced: it is not a member any more and writes nothing")

    def recover(self, err: str) -> int:
        """Report a failure of the current epoch (`report`) and join the next; the resume step."""
        return self.join(self.report(err))

    def report(self, err: str) -> Topology:
        """The failure `err` of the current epoch: the epoch's failure flag, this rank's descriptor, its groups
        retired; the next epoch's topology once the coordinator published it (Drained, RunAborted: this node
        is not in it)."""
        e = self.ctx.epoch
        t_err = time.time()
        self.watcher.disarm()
        self._check_fence()
        if "requested by the control plane" not in err:  # else the flag is set already: no round trip
            sealed.put_many(self.ctx.store, [keys.failflag(e), keys.failflag_by_worker(e)], ["1", "1"])
        # (no event of its own: the descriptor carries the error and its time, and the coordinator logs one
        # `failures_reported` event for all of them: W appends to one key would be W more store round trips)
        drain = sealed.has(self.ctx.store, keys.drain_notice(e))  # the epoch ends for a planned drain
        if self.protection.repl is not None:
            if drain:  # nothing failed: the replication of the last completed step finishes first, so that
                self.protection.repl.settle(self._drain_wait_s())  # the drained node's shard has its replica
            self.protection.repl.abort()
        desc = self.protection.descriptor(err, t_err)
        self.keeper.drop_prefix("desc/")
        self.keeper.put(keys.desc(e, self.wid), json.dumps(desc.to_json()))
        sealed.hint(self.ctx.store, keys.desc_posted(e))  # the coordinator polls this one key, not every descriptor
        if drain and self.ctx.topo is not None:
            self._await_peers_settled(e, self.ctx.topo)
        # only now the old epoch's groups are aborted: an NCCL abort can block up to the group's timeout,
        # and the descriptor must reach the coordinator within its own; the abort gets a bounded wait
        # (distributed/retire.py: past it, the groups are abandoned to the abort's thread and the worker goes on)
        comm, self.ctx.comm = self.ctx.comm, None
        if comm is not None:
            comm.retire()
        wait_s = self.cfg.next_epoch_wait_s
        topo = auth.verified_topology(self.ctx.store, e + 1, self._wait_key(keys.topo(e + 1), wait_s), wait_s)
        self._check_fence()
        if self.node_id not in topo.nodes and self.node_id in topo.meta.get("drained", []):
            raise Drained(f"{self.node_id} was drained: {topo.meta.get('drain', {}).get('reason', 'requested')}; "
                          f"its role moved to {', '.join(topo.meta.get('promoted', [])) or 'the other nodes'} "
                          f"at step {topo.resume_step}")
        if self.node_id not in topo.nodes and self.node_id in topo.meta.get("released", []):
            return self._await_promotion(topo)
        if self.node_id not in topo.nodes:
            raise RunAborted(f"{self.node_id} is not a member of epoch {topo.epoch}: fenced")
        return topo

    def _await_promotion(self, topo: Topology) -> Topology:
        """This node was released: another node of its data-parallel replica was lost with no spare ready, and the
        mesh dropped the whole replica. It waits, warm, as a spare until the coordinator promotes it again (an
        assignment to an epoch after `topo`'s: one from an earlier promotion is stale), and returns that epoch."""
        print(f"phoenixft worker {self.wid}: released at step {topo.resume_step} (the data-parallel replica of "
              f"{self.node_id} left the mesh); waiting as a spare", flush=True)
        self.ctx.event("released", epoch=topo.epoch, step=topo.resume_step)
        while True:
            raw = self._wait_key(keys.assign(self.node_id), SPARE_WAIT_S, is_sealed=True)
            e = parse_int(raw, keys.assign(self.node_id), -1)
            if e > topo.epoch:
                return auth.verified_topology(self.ctx.store, e, self._wait_key(keys.topo(e), FIRST_EPOCH_WAIT_S),
                                              FIRST_EPOCH_WAIT_S)
            ended = self._run_end()
            if ended is not None:
                raise RunAborted(f"run ended ({ended})")
            time.sleep(WAIT_KEY_NAP_S)

    def _post_join(self, topo: Topology, t0: float, inv: dict[str, bool], bad: list[str],
                   timings: dict[str, Any]) -> None:
        """This rank's join record of `topo`'s epoch: its invariants, what failed verification, its timings."""
        timings["join_s"] = time.time() - t0
        sealed.put(self.ctx.store, keys.join(topo.epoch, self.wid),
                   json.dumps({"t": time.time(), "rank": self.ctx.rank, "invariants": inv, "i3_failures": bad,
                               **timings}))

    def _stop_for_drain(self, done: int) -> None:
        """At the step boundary after step `done`: a planned drain of this epoch stops every rank here, once
        the drain's step is done (no collective of the next step has begun, nothing is left half-done)."""
        after = self.watcher.drain_step(self.ctx.epoch)
        if after is not None and done >= after:
            raise PeerFailure(f"drain requested by the control plane: stopped at the step boundary after step {done}")

    def _run_end(self) -> str | None:
        """The run's end signed with the run key ("done", "aborted", "failed", ...), or None while it runs."""
        return run_ended(self.ctx.store, self.run_id) if self.ctx.store.check([keys.RUN_STATE]) else None

    def _stop_if_ended(self) -> None:
        """At a step boundary, at most every RUN_END_CHECK_S: the run has ended (its --timeout, an interruption,
        a failure the launcher saw): stop here. A step's own waits see the end only when one of them lasts long
        enough to look, which fast collectives never do; without this the ranks would train on until the
        launcher killed them."""
        now = time.monotonic()
        if now - self._end_checked < RUN_END_CHECK_S:
            return
        self._end_checked = now
        ended = self._run_end()
        if ended is not None:
            raise RunAborted(f"run ended ({ended})")

    def _drain_wait_s(self) -> float:
        """How long a drain waits for the replication of the last completed step (and for every peer to
        have posted): every peer is alive, so it takes milliseconds; past this, what is there is described."""
        return min(5.0, max(1.0, self.cfg.failure_timeout / 2))

    def _await_peers_settled(self, e: int, topo: Topology) -> None:
        """A drain: every worker of the epoch has posted its descriptor (so its replication is complete)
        before this one retires the epoch's groups: a retired group could cut a transfer a peer is still
        receiving from this rank. Bounded, and over at the drain's end (`keys.drain_abort`: the coordinator saw
        every descriptor, or stopped waiting for them: the drained node died before its notice ran out, and
        its descriptor never comes); a peer lost meanwhile is the ordinary failure path."""
        deadline = time.monotonic() + self._drain_wait_s()
        names = [keys.desc(e, f"{n}.{i}") for n in topo.nodes for i in range(topo.workers_per_node)]
        posts = sealed.Hint(keys.desc_posted(e), 0.05)  # (each worker sets it after its descriptor)
        while time.monotonic() < deadline and not (posts.moved(self.ctx.store)
                                                   and sealed.all_present(self.ctx.store, names)):
            if sealed.has(self.ctx.store, keys.drain_abort(e)):  # (one request: a Hint would add a second)
                return
            time.sleep(0.002)

    def _build_comm(self, topo: Topology) -> EpochComm:
        """The epoch's process groups. Their rendezvous waits for every member (up to the collective
        timeout, a minute or more), so a member that dies meanwhile would keep this worker from posting
        its descriptor within the coordinator's failure timeout, and it would be fenced as unresponsive
        (with a node killed before the first step: every survivor, and the run lost). So the groups are
        built on a thread (the rendezvous releases the GIL) while this one watches the epoch's failure
        flag; when it is set the build is abandoned (its thread ends with the rendezvous' timeout)."""
        box: dict[str, Any] = {}
        gave_up = threading.Event()

        def build() -> None:
            try:
                if self.device.is_cuda:  # the current CUDA device is per thread: this worker's GPU here too
                    torch.cuda.set_device(self.device.torch)
                comm = EpochComm(
                    self.ctx.store.c10d, topo.epoch, self.ctx.rank, topo.world, self.ctx.coll_timeout,
                    backend=self.device.backend, layout=topo.layout, device=self.device,
                    transfer_members=topo.transfer_ranks() if restore.path_of(topo) == "in_place" else None,
                    user_group=self.user_group)
                box["comm"] = comm
                if gave_up.is_set():  # completed after the worker abandoned it: nobody will use these groups
                    comm.retire()
            except BaseException as e:  # noqa: BLE001 - handed to the joining thread (a failed build aborted its groups)
                box["error"] = e

        if self._side_store is None:  # the rendezvous blocks this worker's store client: poll on another,
            # connected before the build (EpochComm takes the sockets opened while it builds for its own)
            self._side_store = self.ctx.store.independent()
        t = threading.Thread(target=build, name=f"phoenixft-groups-e{topo.epoch}", daemon=True)
        t.start()
        side = self._side_store
        every, last = max(0.02, side.abort_check_s), 0.0
        while t.is_alive():
            t.join(0.005)
            if not t.is_alive() or time.monotonic() - last < every:
                continue
            last = time.monotonic()
            failed, over = exists_many(side, [keys.failflag(topo.epoch), keys.RUN_STATE])
            over = over and run_ended(side, self.run_id) is not None  # (a forged end is ignored)
            failed = failed and sealed.has(side, keys.failflag(topo.epoch))  # (so is a forged flag)
            if over or failed:  # the blocked client stays with the abandoned build; this one becomes the worker's
                self.ctx.store, self._side_store = side, None
                gave_up.set()
                if "comm" in box:  # (completed between the join and this check: aborted without waiting,
                    box["comm"].retire(0.0)  # the descriptor comes first)
            if over:
                raise RunAborted(f"run ended ({run_ended(side, self.run_id)})")
            if failed:
                raise PeerFailure(f"recovery requested by the control plane while the process groups of epoch "
                                  f"{topo.epoch} were being built (a member did not arrive)")
        if "error" in box:
            e = box["error"]
            if isinstance(e, (PeerFailure, RunAborted, Unhealable)):
                raise e
            raise PeerFailure(f"building the process groups of epoch {topo.epoch}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        comm: EpochComm = box["comm"]
        return comm

    def _recover_until_joined(self, err: str) -> int:
        """A failure during a recovery (cascading) restarts the recovery in the next epoch."""
        while True:
            try:
                return self.recover(err)
            except PeerFailure as e:
                err = str(e)

    def join(self, topo: Topology) -> int:
        """Join `topo`'s epoch: its process groups, this rank's state of the resume step (the front door's
        `_restore`), the protection of the new epoch, and the invariants I1-I4, checked with every member."""
        t0 = time.time()
        old_rank = self.ctx.rank
        self.ctx.topo, self.ctx.epoch = topo, topo.epoch
        self.ctx.rank = topo.rank_of(self.node_id, self.local_rank)
        self.ctx.comm = None
        self.ctx.comm = self._build_comm(topo)
        r = topo.resume_step
        timings: dict[str, Any] = {"reconfigure_s": time.time() - t0}
        bad: list[str] = []  # I3: what failed verification on this rank
        self._restore(topo, r, old_rank, timings, bad)
        tr = self.ctx.trainer
        self.protection.configure(topo, self.ctx.rank, r)
        half = tr.state.half_with(r)
        held = tr.state.shard_of(half) if half is not None else (-1, 0)
        store, e = self.ctx.store, topo.epoch
        # (published before the topology; one overwritten since is put back by the coordinator: waited for, bounded)
        part = sealed.wait_json(store, keys.evidence(e, self.ctx.rank), EVIDENCE_WAIT_S) \
            if "evidence_step" in topo.meta else None
        seen = installed_seen(tr, topo, self.ctx.rank, r, part,
                              lambda: sealed.wait_json(store, keys.evidence(e), EVIDENCE_WAIT_S))
        try:
            inv, detail = check_invariants(self.ctx.comm.train, topo, self.ctx.rank, r, tr.flat.step,
                                           tr.state.steps(), held, not bad, self.ctx.wait, seen)
        except PeerFailure:
            if bad:  # the check was cut short (a peer that saw I3 fail set the failure flag first): what failed
                # verification here still reaches the report, or the recovery would say I3 failed on no rank
                self._post_join(topo, t0, dict.fromkeys(("I1", "I2", "I3", "I4"), False), bad, timings)
            raise
        self._post_join(topo, t0, inv, bad, timings)
        if not inv["I3"]:
            # a copy failed verification: recover again without that source (or stop, if none is left)
            raise PeerFailure(f"invariant I3 failed after recovery to epoch {topo.epoch}: "
                              f"{'; '.join(bad) or 'on another rank'}")
        if not all(inv.values()):
            why = failure_message(inv, detail, topo.epoch, r)
            self._stop_run(why, ours=True)
            raise RunAborted(why)
        self.ctx.bad_sources = []
        self._joined(topo, r)
        self.watcher.arm(topo.epoch)
        if self.ctx.scheme is not None:
            self.ctx.scheme.protect(r)
        if topo.epoch > 0:
            self._first_after_join = topo.epoch
        return r

    def _restore(self, topo: Topology, r: int, old_rank: int, timings: dict[str, Any], bad: list[str]) -> None:
        """This rank's state of step r as the plan of `topo` says (the epoch's groups are built); what failed
        verification goes to `bad` (I3)."""
        raise NotImplementedError

    def _joined(self, topo: Topology, r: int) -> None:
        """After a join whose invariants hold, before training resumes at r + 1."""

    def _unhealable(self, e: Unhealable) -> None:
        """Stop the run for `e` in one line; an error raised in the user's own code (the workload's) also with
        its traceback, the user's frames first: in this node's log, and with the run's end (the report)."""
        trace = user_traceback(e.__cause__) if e.__cause__ is not None else None
        if trace is not None:
            print(trace[1], flush=True)
        self._stop_run(str(e), trace=trace)
        print(f"phoenixft worker {self.wid}: {e}", flush=True)

    def _stop_run(self, why: str, ours: bool = False, trace: tuple[str, str] | None = None) -> None:
        """Stop the whole run at the last committed step, with one clear reason: a fault that is not
        ours to heal, or (`ours`) a broken recovery guarantee that must never be trained past. `trace`: where
        in the user's code the error was raised and its traceback (`errors.user_traceback`)."""
        if sealed.claim(self.ctx.store, keys.STOP_CLAIM):
            last = max(self.ctx.trainer.state.steps(), default=0) if self.ctx.trainer is not None else 0
            if trace is not None:
                why = f"{why} (at {trace[0]}; traceback in the log of node {self.node_id})"
            msg = (f"{why}; the run stops rather than train on a state it cannot vouch for" if ours
                   else f"{why}; not ours to heal, stopped at the last committed step {last}")
            sealed.put(self.ctx.store, keys.RUN_ERROR, msg)
            extra = {"where": trace[0], "traceback": trace[1][-8000:], "node": self.node_id} if trace else {}
            self.ctx.event("run_failed", error=why, last_committed=last, **extra)
            set_signed(self.ctx.store, env_token(), self.run_id, keys.RUN_STATE, "failed")
