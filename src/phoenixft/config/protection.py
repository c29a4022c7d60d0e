"""The protection section: how each step's optimizer state is protected (replicas or erasure-coded
groups), how replicas move, and the persistent checkpoints written off the critical path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import need, real, unwritable
from phoenixft.config.options import option
from phoenixft.errors import UserError

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig
    from phoenixft.protect.redundancy.scheme import Redundancy

__all__ = ["ProtectionConfig", "validate_protection", "PROTECT_MODES", "TRANSPORTS", "PERSIST_CLOSE_S"]

PROTECT_MODES = ("phoenix", "none")
TRANSPORTS = ("auto", "tcp")  # --replica-transport (protect/transport/: TransportMode)
SCRUB_EVERY = 1  # --scrub-every default: measured by bench/scrub.py (docs/scrubbing.md)
PERSIST_CLOSE_S = 60.0  # how long a rank's persistent tier may finish the checkpoints it is writing once it stops


@dataclass(kw_only=True)
class ProtectionConfig:
    """What keeps a step's state alive when nodes fail."""

    protect: str = option("phoenix", "Per-step protection: phoenix (in-memory snapshot + peer replicas) or none.")
    replicas: int = option(1, "Peer replicas of each optimizer shard, placed on other nodes (k); shorthand for "
                              "--redundancy replicas:K.")
    redundancy: str = option("replicas:1", "How each optimizer shard is protected: replicas:K (K full copies on other "
                             "nodes) or ec:D+H (the shards of D data-parallel ranks on D nodes form a group whose H "
                             "parity blocks live on H further nodes, other racks first; any H lost members of a group "
                             "are rebuilt bit for bit; H=1 XOR, H>=2 Reed-Solomon). `phoenixft run --dry-run` prints "
                             "what each costs.")
    persist_every: int = option(0, "Write a persistent DCP checkpoint every K steps, off the critical path "
                                   "(0 = never).", flag="--persist-every")
    persist_dir: str = option("", "Directory of the persistent checkpoints (needed with --persist-every).",
                              flag="--persist-dir")
    chunk_mb: float = option(4.0, "Replication chunk size in MiB.", flag="--chunk-mb")
    replica_transport: str = option("auto", "How replicas move: auto (a holder on the owner's host - same boot, "
                                    "network and mount namespaces - reads the owner's committed half straight from "
                                    "host shared memory, one copy; other holders get it over TCP) or tcp (always over "
                                    "TCP).", flag="--replica-transport")
    scrub_every: int = option(SCRUB_EVERY, "Scrub the committed copies each node holds (its own snapshot halves, the "
                              "replicas or parity blocks it keeps): every held byte is re-hashed against the "
                              "checksum recorded at commit at least once every N steps, in the background (at most "
                              "1/N of the held bytes per step, on the replication thread), and a copy that no "
                              "longer matches is repaired at once from a good one (its owner, another replica, or "
                              "re-encoded from its group) and reported. 0 = off.", flag="--scrub-every")
    sdc_check_every: int = option(1, "Fingerprint the full parameters before the forward every N steps and compare "
                                     "them across each data-parallel group before the step commits, naming a member "
                                     "whose copy diverged "
                                     "(0 = never; see docs/sdc.md).", flag="--sdc-check-every")
    spike_threshold: float = option(20.0, "Spike guard: a loss or gradient norm this many robust deviations (median "
                                          "absolute deviations) above the recent window, or not finite, marks the step "
                                          "suspect and it is replayed before it commits (0 = only non-finite values; "
                                          "-1 = the guard off).", flag="--spike-threshold")
    spike_window: int = option(32, "Spike guard: committed steps in the window the score is taken against.",
                               flag="--spike-window")
    sdc_audit: str = option("off", "Audits: sample (every --sdc-audit-every steps one data-parallel rank's "
                                   "microbatches are recomputed on another node) or full (every rank's, on another "
                                   "node: double compute) or off; the gradients' fingerprints must agree bit for bit.",
                            flag="--sdc-audit")
    sdc_audit_every: int = option(0, "Steps between audits (with --sdc-audit; 0 = every step for full, every 10 "
                                     "steps for sample).", flag="--sdc-audit-every")

    def resolve(self) -> None:
        """--replicas K is a shorthand for --redundancy replicas:K: make the two fields agree."""
        from phoenixft.protect.redundancy.scheme import replicas_of

        k = replicas_of(str(self.redundancy))
        if k == 1 and self.replicas != 1:
            self.redundancy = f"replicas:{self.replicas}"
        elif k is not None and k >= 1 and self.replicas == 1:  # (a K < 1 stays --redundancy's: refused as such)
            self.replicas = k

    @property
    def scheme(self) -> Redundancy:
        """--redundancy as its typed value; ValueError saying why when it is not valid."""
        from phoenixft.protect.redundancy.scheme import parse_redundancy

        return parse_redundancy(self.redundancy)


def validate_protection(cfg: RunConfig) -> None:
    """--protect, the redundancy scheme against the nodes that hold it, replication and persistence."""
    p = cfg.protection
    need(p.protect in PROTECT_MODES, "--protect", p.protect, f"one of {', '.join(PROTECT_MODES)}")
    need(p.replicas >= 1, "--replicas", p.replicas, "must be >= 1")
    _validate_scheme(cfg)
    real(p.chunk_mb, p.chunk_mb > 0, "--chunk-mb", "> 0 (MiB)")
    need(p.replica_transport in TRANSPORTS, "--replica-transport", p.replica_transport,
         f"one of {', '.join(TRANSPORTS)}")
    need(p.persist_every >= 0, "--persist-every", p.persist_every, "must be >= 0")
    need(p.scrub_every >= 0, "--scrub-every", p.scrub_every,
         "must be >= 0 (steps per full scrub of the held copies; 0 = off)")
    _validate_sdc(p)
    if p.persist_every:
        need(bool(p.persist_dir), "--persist-dir", p.persist_dir, "needed with --persist-every")
        need(p.protect == "phoenix", "--persist-every", p.persist_every, "needs --protect phoenix")
        why = unwritable(p.persist_dir)
        need(why is None, "--persist-dir", p.persist_dir, f"cannot create or write a file there ({why})")


SDC_AUDITS = ("off", "sample", "full")


def _validate_sdc(p: ProtectionConfig) -> None:
    """The silent-data-corruption checks (docs/sdc.md)."""
    need(p.sdc_check_every >= 0, "--sdc-check-every", p.sdc_check_every, "must be >= 0 (0 = never)")
    real(p.spike_threshold, p.spike_threshold >= 0 or p.spike_threshold == -1, "--spike-threshold",
         ">= 0 (0: only non-finite values), or -1 (the guard off)")
    need(p.spike_window >= 4, "--spike-window", p.spike_window, "must be >= 4 steps")
    need(p.sdc_audit in SDC_AUDITS, "--sdc-audit", p.sdc_audit, f"one of {', '.join(SDC_AUDITS)}")
    need(p.sdc_audit_every >= 0, "--sdc-audit-every", p.sdc_audit_every, "must be >= 0 (0 = the audit's default)")


def _validate_scheme(cfg: RunConfig) -> None:
    """--redundancy (and --replicas, its shorthand): valid, and placeable on the job's nodes."""
    from phoenixft.protect.redundancy.scheme import VALID

    p = cfg.protection
    try:
        scheme = p.scheme
    except ValueError as e:
        raise UserError(f"--redundancy={p.redundancy!r} is invalid: {e}; valid: {VALID}") from None
    if scheme.is_ec:
        need(p.replicas == 1, "--replicas", p.replicas,
             f"--replicas K is a shorthand for --redundancy replicas:K and cannot be combined with "
             f"--redundancy {scheme}")
        need(cfg.tp * cfg.pp == 1, "--redundancy", p.redundancy,
             f"erasure-coded groups are data-parallel only for now; with --tp {cfg.tp} --pp {cfg.pp} use "
             "replicas:K")
        if p.protect == "phoenix":
            need(scheme.min_nodes <= cfg.nodes, "--redundancy", p.redundancy,
                 f"a group of D={scheme.d} members and its H={scheme.h} parity blocks need D + H = "
                 f"{scheme.min_nodes} distinct nodes, --nodes is {cfg.nodes}")
        return
    need(scheme.k == p.replicas, "--redundancy", p.redundancy, f"conflicts with --replicas {p.replicas}")
    if p.protect == "phoenix":
        pp, nodes = cfg.pp, cfg.nodes
        ring = nodes // pp if nodes % pp == 0 else nodes
        where = "nodes" if pp == 1 else "nodes of one pipeline stage (its data-parallel peers)"
        need(
            p.replicas < ring,
            "--replicas",
            p.replicas,
            f"replicas live on other {where}, so need replicas < {ring}" if ring > 1 else
            f"replicas live on other {where} and there is only one: give --nodes >= {2 * pp}"
            + (" (2 or more per pipeline stage)" if pp > 1 else "") + " or --protect none (no protection)",
        )
