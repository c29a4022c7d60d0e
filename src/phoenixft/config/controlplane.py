"""The control-plane section: where the job's state is kept, its coordinators, and the timeouts that
decide when a node, the start of the job, or the whole run is given up on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import MAX_FAILURE_TIMEOUT_S, need, real
from phoenixft.config.options import option

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["ControlPlaneConfig", "validate_control_plane"]


@dataclass(kw_only=True)
class ControlPlaneConfig:
    """Who coordinates the job, where its state lives, and how long anyone waits."""

    join_timeout: float = option(600.0, "Seconds to wait at the start for the --nodes active nodes to join and be "
                                 "ready; then the run fails naming who is missing.", flag="--join-timeout")
    start_grace: float = option(15.0, "Seconds an active node admitted before the start may go without its first "
                                "heartbeat; then it is taken for dead while starting and its slot goes to a ready "
                                "spare (never less than --failure-timeout).", flag="--start-grace")
    control_plane: str = option("tcpstore", "Where the control plane keeps its state: tcpstore (torch's TCPStore in "
                                "the launcher's process: zero set-up, but the job depends on that process and host), "
                                "etcd (a local 3-member etcd cluster started for the run) or "
                                "etcd://HOST:PORT[,HOST:PORT...] (an existing etcd cluster: no single process or host "
                                "whose loss ends the job).", flag="--control-plane")
    coordinators: int = option(1, "Coordinator processes: one leads, the others stand by and take over within a few "
                               "seconds of its death (more than 1 needs --control-plane etcd).", flag="--coordinators")
    failure_timeout: float = option(10.0, "Seconds without a heartbeat or answer before a node is declared failed.",
                                    flag="--failure-timeout")
    fence_kill: bool = option(True, "Fence a failed node by SIGKILL of its process group in local runs, besides the "
                              "logical fence every process obeys; off (--no-fence-kill) = logical fence only, as for a "
                              "host that cannot be reached.", flag="--no-fence-kill", action="store_false")
    straggler_factor: float = option(1.3, "A node whose own compute time per step (forward, backward, optimizer; not "
                                     "its waits for other nodes) exceeds its peers' median by this factor for "
                                     "--straggler-window consecutive steps is a straggler: reported live and in the "
                                     "report; 0 = no straggler detection.", flag="--straggler-factor")
    straggler_window: int = option(20, "Consecutive steps a node must be slower than --straggler-factor times its "
                                   "peers' median before it is flagged as a straggler.", flag="--straggler-window")
    evict_stragglers: bool = option(True, "Move a straggler's role to a ready spare (at most once per node, never "
                                    "during a recovery; needs --protect phoenix); --no-evict-stragglers: report "
                                    "it only.",
                                    flag="--evict-stragglers", action="both")
    timeout: float = option(0.0, "A wall-clock limit for the whole run, in seconds: once reached, the run stops "
                            "(the persistent tier finishes the checkpoints it is writing) and everything is torn "
                            "down. 0 = no limit (the default: a training run takes as long as it takes).")
    tls_cert: str = option("", "This host's TLS certificate (PEM, signed by --tls-ca; `phoenixft certs DIR` makes "
                           "one). With --tls-key and --tls-ca: the store listens on loopback only and every agent "
                           "reaches it through mutually authenticated TLS; an etcd control plane is spoken to over "
                           "HTTPS with this client certificate (and a local one started with TLS).",
                           flag="--tls-cert")
    tls_key: str = option("", "The private key of --tls-cert (PEM; yours, mode 0600).", flag="--tls-key")
    store_max_mb: int = option(1024, "The most the TCPStore holds, in MiB (its values and queued items, whoever wrote "
                               "them): a write past it closes its writer's connection, so nothing that reaches the "
                               "store can grow it past this.", flag="--store-max-mb")
    store_max_keys: int = option(1_000_000, "The most keys the TCPStore holds (whoever wrote them): a write past it "
                                 "closes its writer's connection.", flag="--store-max-keys")
    store_step_records: int = option(256, "Step records (`step/<n>`) the control-plane store keeps: the newest ones; "
                                     "the launcher deletes older ones once it has written them to metrics.jsonl, "
                                     "so the store's size does not grow with the run's length (the report takes "
                                     "every step from metrics.jsonl). At least --spike-window + 2 (a recovery "
                                     "rebuilds the spike guard's window from them).", flag="--store-step-records")
    tls_ca: str = option("", "The job CA's certificate (PEM): only peers presenting a certificate it signed are "
                         "let in.", flag="--tls-ca")


def validate_control_plane(cfg: RunConfig) -> None:
    """The store spec, the coordinators it can hold, and the timeouts."""
    c = cfg.control
    # (the collectives wait up to 6x this, in milliseconds that gloo keeps in a 32-bit int)
    real(c.failure_timeout, 0 < c.failure_timeout <= MAX_FAILURE_TIMEOUT_S, "--failure-timeout",
         f"> 0 and at most {MAX_FAILURE_TIMEOUT_S:g} seconds (a day)")
    need(1 <= c.coordinators <= 9, "--coordinators", c.coordinators, "must be in 1..9")
    need(c.coordinators == 1 or c.control_plane != "tcpstore", "--coordinators", c.coordinators,
         "standby coordinators need --control-plane etcd or etcd://HOST:PORT,... (with the embedded tcpstore the "
         "store lives in the launcher's process, so a standby would not remove the single point of failure)")
    real(c.join_timeout, c.join_timeout > 0, "--join-timeout", "> 0 seconds")
    need(64 <= c.store_max_mb <= 1 << 20, "--store-max-mb", c.store_max_mb, "must be in 64..1048576 (MiB)")
    need(10_000 <= c.store_max_keys <= 1 << 30, "--store-max-keys", c.store_max_keys, "must be in 10000..1073741824")
    low = cfg.protection.spike_window + 2
    need(low <= c.store_step_records <= 1 << 30, "--store-step-records", c.store_step_records,
         f"must be in {low}..1073741824 (at least --spike-window + 2: a recovery rebuilds the spike guard's window of "
         f"{cfg.protection.spike_window} steps from the step records before its resume step)")
    real(c.start_grace, 0 < c.start_grace <= MAX_FAILURE_TIMEOUT_S, "--start-grace",
         f"> 0 and at most {MAX_FAILURE_TIMEOUT_S:g} seconds (a day)")
    real(c.straggler_factor, c.straggler_factor == 0 or 1 < c.straggler_factor <= 1000, "--straggler-factor",
         "> 1 and at most 1000 (how many times its peers' median a straggler's compute takes), or 0 = no detection")
    need(1 <= c.straggler_window <= 1_000_000, "--straggler-window", c.straggler_window,
         "must be in 1..1000000 (consecutive steps)")
    real(c.timeout, c.timeout >= 0, "--timeout", ">= 0 seconds (0 = no limit)")
    # last, and only when given: the control plane's package imports torch (the store client)
    if c.control_plane != "tcpstore":
        from phoenixft.controlplane import validate_spec

        why = validate_spec(c.control_plane)
        need(why is None, "--control-plane", c.control_plane, why or "")
    if c.tls_cert or c.tls_key or c.tls_ca:
        from phoenixft.controlplane.tls import TlsFiles

        TlsFiles.given(c.tls_cert, c.tls_key, c.tls_ca)  # (files present, key private, cert signed by the CA)
