"""The coordinator: control plane, out of process.

It works on the control-plane store every process meets at (`phoenixft.controlplane`: torch's
TCPStore served by the launcher, or a replicated cluster) and owns membership,
failure detection on the node level (agent exits reported by the launcher, missed heartbeats),
recovery epochs and the spare pool. On a failure in epoch e (Algorithm 2 of the paper):

1. set the epoch's failure flag so every member stops at its next wait;
2. collect a *descriptor* from every surviving worker (which steps its ping-pong halves hold,
   which replicas it keeps) and decide which nodes are dead: reported exits, stale heartbeats,
   or workers that did not answer within `--failure-timeout` (those nodes are fenced);
3. pick the recovery step r: the newest step for which every logical shard still has a
   committed copy somewhere (its owner, or a verified replica);
4. acquire one spare per dead node, put it in the dead node's slot and publish topology e+1
   with the transfers (parameters from a healthy DP peer, optimizer shard from a replica
   holder, matched by logical shard id).

Its cost per poll does not grow with the number of workers W: while it waits for descriptors it
polls one counter that workers bump when they post (`desc_posted/<e>`), plus the launcher's exit
counter and the agents' restart counter; the descriptors are checked in one call when the counter
says they may be complete and fetched with one `multi_get`; heartbeats are read with one
`multi_get`; single keys are looked at only when something happened (an exit, a restart, a stale
node) or, after the deadline, to name the nodes that did not answer. `bench/control_plane.py`
measures it with up to 4,096 simulated workers.

Membership is the coordinator's alone: an agent is a member only once it has answered the
admission challenge with the job token (`phoenixft.controlplane.auth.AdmissionDesk`); the coordinator names
its id (`n<i>` active slots first, then spares `s<k>`), keeps the spare pool in id order, and starts
the job when the `--nodes` active nodes have joined and are ready (`--join-timeout`). Every topology
it publishes is signed (`topo/<e>/sig`, written first). Heartbeats are judged on its own clock (when
it last saw a node's heartbeat change), never by comparing another host's clock with its own.

On a store with leases (`Store.has_leases`) several coordinators may run (`--coordinators N`,
`phoenixft coordinator --standby`): each campaigns for `coordinator/leader` (`controlplane.Election`),
only the leader acts, and every topology it publishes goes out in one transaction with its journal
record, guarded on it still leading; a standby that wins reloads the journal from the store and
carries on (an epoch whose failure flag is set but unanswered is recovered by it). A leader that
cannot renew its lease exits.

Run as `python -m phoenixft.coordinator --store ADDRESS` (what `controlplane.connect` takes) with the
job token in PHOENIXFT_TOKEN (the launcher and `phoenixft coordinator` do this).

The package, one module per seam (each part is handed the shared `Job` and `Membership`, its
other inputs explicitly):

- `shared.py`: `Job`, the job's keys as the coordinator reads and writes them; `Membership`, the
  admitted nodes, the spare pool, the dead and the epoch published last;
- `admission.py`: `Admission`, join requests answered, the spare pool kept;
- `detect.py`: `FailureDetector`, failures in steady state and the recovery's gather;
- `decide.py`: `Decider`, a recovery from the failure flag to the next epoch's plan;
- `publish.py`: `Publisher`, epochs published journal first, and the journal's reload;
- `lead.py`: `Coordinator`, leadership, start-up and the main loop; `main`, the command line.
"""

from phoenixft.coordinator.lead import ControlPlaneLost as ControlPlaneLost
from phoenixft.coordinator.lead import Coordinator, main
from phoenixft.coordinator.lead import WrongToken as WrongToken

__all__ = ["Coordinator", "main"]
