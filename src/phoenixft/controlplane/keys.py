"""Names of the control-plane store keys: one place, so every process agrees on them.

Every key a process of the job reads or writes is named here (a constant, or a function of the ids it
depends on): the test that writes junk into every key of a live run (tests/test_junk_values.py) enumerates
this module, so a key added here is covered at once. The process groups' own rendezvous keys are torch's,
below each group's prefix `e<epoch>/<group>` (distributed/comm.py; distributed/rendezvous.py seals each value):
the junk test finds those in the live store.
"""

from __future__ import annotations

CONFIG = "config"
CONFIG_SIG = "config/sig"  # the config's signature with the run key (controlplane.signed): checked before use
RUN_STATE = "run/state"  # "done" | "failed"
RUN_ERROR = "run/error"
EVENTS = "events"  # sealed JSON lines: the run's events (on a TCPStore, what the launcher took from the queue)
EVENTS_QUEUE = "events/queue"  # on a TCPStore: the queue events are pushed to (Store.log_push), the launcher pops
PROGRESS = "progress"
FINAL = "final"
FINAL_SEEN = "final/seen"  # set (sealed) by the launcher once it has the signed final state: rank 0 stops rewriting it
EPOCH = "epoch"
JOURNAL = "coordinator/journal"  # the coordinator's last decision (topology, spare pool, dead nodes), write-ahead
COORDINATOR_PID = "coordinator/pid"  # the running coordinator (cleared by the launcher when it exits)
EXITS = "exits"  # node exits the launcher told (it alone writes it, with `set`): `exit/<node>` keys to look at
WORKER_EXITS = "wexits"  # hint an agent sets after writing `wexit/<wid>` (a worker restarted in place)
START_FAILS = "startfails"  # hint a worker sets after writing `startfail/<wid>` (it failed before any step)
RUN_DIR = "run/dir"  # where rank 0 writes the final state (the launcher's run directory)
JOB_WHOLE = "job/whole"  # set by the coordinator while the job has its full size (and a warm spare, if it has spares)
RUN_ID = "run/id"  # the run's id (shared-memory names), told to every admitted agent
MEMBERS = "members"  # JSON {node id: {name, host, spare, t}} of every admitted node (informational, unsigned)
ADMIT_SEQ = "admit/seq"  # counter: the highest number a join request took (raised by compare_set)
ADMIT_POSTED = "admit/posted"  # counter an agent raises (compare_set) after each write of its request or response
ADMIT_DONE = "admit/done"  # the join requests the coordinator answered (signed: a restart never answers one again)
COORDINATOR_READY = "coordinator/ready"  # the time the coordinator (re)started its loop (informational)
LEADER = "coordinator/leader"  # the leading coordinator's identity (etcd: bound to its lease)
STOP_CLAIM = "run/stop_claim"  # claimed (sealed.claim) by the one worker that stops the run
# a request to stop the whole job at the next step boundary with its state saved in the persistent tier (JSON as a
# drain request's, without node_id; controlplane/drain.py `request_stop`, coordinator/stop.py its one consumer)
STOP_REQUEST = "stop/request"
SDC_LOG = "sdc/log"  # sealed JSON lines: detections, verdicts, audits (the report's `sdc`)
HEALTH_REF = "health/ref"  # the reference checksum of the health check's matrix product, published by the coordinator
# a user's training script (phoenixft.api), sealed: the steps its loop asked for (rank 0), the capacity every rank's
# own snapshot side has (raised by any rank whose state outgrew it), and whether its model is sharded over the ranks
SCRIPT_TOTAL_STEPS = "script/total_steps"
SCRIPT_PRIVATE_BYTES = "script/private_bytes"
SCRIPT_FIXED_SIZE = "script/fixed_size"


def ready(wid: str) -> str:
    return f"ready/{wid}"


def heartbeat(node: str) -> str:
    return f"hb/{node}"


def node_exit(node: str) -> str:
    return f"exit/{node}"


def fence(node: str) -> str:
    return f"fence/{node}"


def topo(epoch: int) -> str:
    return f"topo/{epoch}"


def assign(node: str) -> str:
    return f"assign/{node}"


def failflag(epoch: int) -> str:
    return f"failflag/{epoch}"


def failflag_by_worker(epoch: int) -> str:
    """Set with `failflag(epoch)` when a worker (not the coordinator) raised the flag."""
    return f"failflag/{epoch}/by-worker"


def desc(epoch: int, wid: str) -> str:
    return f"desc/{epoch}/{wid}"


def evidence(epoch: int, rank: int | None = None) -> str:
    """The plan's evidence for I2/I4 (recovery/evidence.py): rank `rank`'s part (its shard, its stage), or
    the whole table (None), read only to name what a rank installed when its part matches nothing."""
    return f"evidence/{epoch}" if rank is None else f"evidence/{epoch}/{rank}"


def desc_posted(epoch: int) -> str:
    """Hint every worker sets (`sealed.hint`, a fresh value, never an `add`) after posting its descriptor of
    `epoch`: the coordinator polls this one key, and looks at every descriptor only when it moves."""
    return f"desc_posted/{epoch}"


def join(epoch: int, wid: str) -> str:
    return f"join/{epoch}/{wid}"


def first_step(epoch: int) -> str:
    return f"first_step/{epoch}"


def recovery(epoch: int) -> str:
    return f"recovery/{epoch}"


def recovery_failed(epoch: int) -> str:
    """The recovery that was to start `epoch` and could not (the run failed there): what it found and why."""
    return f"recovery_failed/{epoch}"


def step(s: int) -> str:
    """Rank 0's record of step s. The launcher deletes a record once it is in metrics.jsonl and the newest
    --store-step-records steps are past it (observe/live.py): a reader looks up only steps the store keeps."""
    return f"step/{s}"


def fault(index: int) -> str:
    return f"fault/{index}"


def fault_fired(index: int) -> str:
    """Claimed (or set) once fault `index` fired: it fires once a run."""
    return f"fault/{index}/fired"


def fault_together(index: int, node: str) -> str:
    """Set by each node a fault strikes together once it is there to fire it (faults/inject.py)."""
    return f"fault/{index}/together/{node}"


def fault_done(index: int) -> str:
    """Set by the agent that takes a fault it fires in hand (a partition, before it cuts the link or once it
    could not; a preemption, once its drain is asked for): the workers holding the fault's step go on."""
    return f"fault/{index}/done"


def fault_claim(index: int, who: int | str) -> str:
    """Claimed once by each node a fault strikes (by node id; a partition by its slot)."""
    return f"fault/{index}/claim/{who}"


def fault_struck(node: str) -> str:
    """Sealed JSON {spec, index, t}: an `--inject` fault that can make `node` fail struck it (faults/struck.py):
    its failures from then on are the fault's, never its host's."""
    return f"fault/struck/{node}"


def fault_targets(index: int) -> str:
    """JSON list of the node ids a fault strikes, fixed by its first firing (faults/inject.py)."""
    return f"fault/{index}/targets"


def worker_exit(wid: str) -> str:
    return f"wexit/{wid}"


def node_restarts(node: str) -> str:
    """Set (sealed) by `node`'s agent once it restarted a worker in place, and kept: the coordinator looks at
    the `wexit/<wid>` keys of these nodes only (one look per node, not per worker)."""
    return f"wexit-node/{node}"


def start_failed(wid: str) -> str:
    """JSON {t, error}: worker `wid` raised before the run's first step (its first error is kept)."""
    return f"startfail/{wid}"


def topo_sig(epoch: int) -> str:
    """HMAC of `topo/<epoch>` with the job token (written before the topology itself)."""
    return f"topo/{epoch}/sig"


def admit_req(seq: int) -> str:
    return f"admit/{seq}/req"


def admit_challenge(seq: int) -> str:
    return f"admit/{seq}/challenge"


def admit_resp(seq: int) -> str:
    return f"admit/{seq}/resp"


def admit_verdict(seq: int) -> str:
    return f"admit/{seq}/verdict"


def left(node: str) -> str:
    """Set by an agent that ends normally (its workers are gone), never by a fenced one."""
    return f"left/{node}"


def drain_key(slot: int) -> str:
    """A request to drain the node in slot `slot` of the current epoch (its position in the topology's node
    list): JSON {"reason": str, "source": str, "deadline": seconds since the epoch or null} and optionally
    "t" (when the notice came) and "node_id" (the node id the request means; a request whose slot holds
    another node by the time it is read is stale and ignored). Written by `phoenixft drain`, an agent that
    received its drain signal, the `preempt:` fault, and any other producer (a straggler detector: reason
    "straggler"); the coordinator is its one consumer and deletes it once it has acted on it."""
    return f"drain/{int(slot)}"


def drain_notice(epoch: int) -> str:
    """Set by the coordinator before the failure flag of `epoch` when the epoch ends for a planned drain
    (JSON: node, slot, reason, source, t_notice, after_step): every worker completes step `after_step`, stops
    at that step boundary, lets the replication of that step finish and posts its descriptor, so that the
    drained node's shard has a committed replica of that step elsewhere and nothing is lost. A stop of the
    whole job (`STOP_REQUEST`) writes one with `stop` and `persist` true and no node: every rank also writes
    the persistent checkpoint of `after_step`."""
    return f"drain_notice/{epoch}"


def drain_abort(epoch: int) -> str:
    """Set by the coordinator once a drain of `epoch` has gathered what it waits for (or waited long enough):
    a worker still inside a step of `epoch` leaves it now, as on a failure flag."""
    return f"drain_abort/{epoch}"
HOST_HISTORY = "hosts/history"  # appended JSON records: a host's failures and quarantines (phoenixft.health.history)
HEALTH_ASK = "health/ask"  # JSON {seq, nodes, recheck, t}: the coordinator asks these spares to check themselves again


def health(node: str) -> str:
    """JSON: spare `node`'s latest health check (ok, reason, phase, the ask it answers, per-check times)."""
    return f"health/node/{node}"


def health_running(node: str) -> str:
    """JSON {n, phase, ask, t}: spare `node` started its n-th health check (its verdict, `health(node)`, follows)."""
    return f"health/running/{node}"


def persist_rank(epoch: int, step: int, rank: int) -> str:
    """Rank `rank`'s record of the persistent checkpoint of `step` written in `epoch` (protect/persist.py)."""
    return f"persist/{epoch}/{step}/rank/{rank}"


def persist_manifest(epoch: int, step: int) -> str:
    """Claimed by the rank that writes the manifest of the persistent checkpoint of `step` (written in `epoch`)."""
    return f"persist/{epoch}/{step}/manifest"


def sdc_accused(epoch: int) -> str:
    """Sealed JSON lines: the nodes named as computing wrong in `epoch`."""
    return f"sdc/accused/{epoch}"


def sdc_quarantine(node: str) -> str:
    """Set (sealed) once `node` is kept out of the job for silent data corruption."""
    return f"sdc/quarantine/{node}"


def sdc_logged(what: str) -> str:
    """Claimed once per SDC record logged once per run (`what` names it)."""
    return f"sdc/logged/{what}"
