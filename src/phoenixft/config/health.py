"""The health section: the gate every spare passes before it may be promoted, and the quarantine of
hosts that fail again and again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phoenixft.config.checks import MAX_FAILURE_TIMEOUT_S, need, real
from phoenixft.config.options import option

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["HealthConfig", "validate_health", "DEFAULT_QUARANTINE_WINDOW_S", "DEFAULT_HEALTH_MAX_AGE_S",
           "DEFAULT_HEALTH_RECHECK_S"]

DEFAULT_QUARANTINE_WINDOW_S = 86400.0
DEFAULT_HEALTH_MAX_AGE_S = 60.0
DEFAULT_HEALTH_RECHECK_S = 30.0


@dataclass(kw_only=True)
class HealthConfig:
    """Which spares may be promoted, and which hosts are never admitted again."""

    health_gate: bool = option(True, "Check every spare when it joins, while it waits, and before its promotion (a "
                               "deterministic matrix product, a write/read pattern over its snapshot memory, a "
                               "loopback collective on its device, and --health-check); a spare that fails is never "
                               "promoted. Off (--no-health-gate): spares are promoted unchecked.",
                               flag="--no-health-gate", action="store_false")
    health_check: str = option("", "A command every spare's host runs in a shell as part of its health check (exit "
                               "0 = healthy), e.g. a DCGM diagnostic on GPU hosts: 'dcgmi diag -r 1'.",
                               flag="--health-check")
    health_max_age: float = option(DEFAULT_HEALTH_MAX_AGE_S, "Seconds a spare's passing health check stays "
                                   "valid: a promotion takes a spare checked within them at once, and asks an older "
                                   "one to check again first (0: every promotion waits for a check just before it).",
                                   flag="--health-max-age")
    health_recheck_every: float = option(DEFAULT_HEALTH_RECHECK_S, "Seconds between the background re-checks of "
                                         "an idle spare, so that a promotion finds a fresh verdict (0: none; the "
                                         "spare is then checked again before its promotion once its verdict is "
                                         "older than --health-max-age).", flag="--health-recheck-every")
    health_check_timeout: float = option(60.0, "Seconds the --health-check command may run; one that runs longer is "
                                         "killed and its spare counts as unhealthy.", flag="--health-check-timeout")
    quarantine_after: int = option(2, "Failures (a node of the host declared dead, or a failed health check) after "
                                   "which a host is quarantined: never admitted to the job again, e.g. when it comes "
                                   "back repaired (0 = never).", flag="--quarantine-after")
    quarantine_window: float = option(DEFAULT_QUARANTINE_WINDOW_S, "Seconds within which --quarantine-after failures "
                                      "of one host quarantine it (a day: a host failing twice in a day is a lemon).",
                                      flag="--quarantine-window")
    quarantine_injected: bool = option(False, "Count the failures that --inject faults cause (and those of a chaos "
                                       "campaign) against their hosts as well, to try the quarantine itself; by "
                                       "default an injected fault is never held against a host (its failures are "
                                       "listed as injected, and repaired nodes come back).",
                                       flag="--quarantine-injected", action="store_true")


def validate_health(cfg: RunConfig) -> None:
    """The command's timeout, the quarantine rule, and that a sick: fault has a gate to fail."""
    h = cfg.health
    real(h.health_check_timeout, 0 < h.health_check_timeout <= MAX_FAILURE_TIMEOUT_S, "--health-check-timeout",
         f"> 0 and at most {MAX_FAILURE_TIMEOUT_S:g} seconds")
    need("\n" not in h.health_check and "\0" not in h.health_check, "--health-check", h.health_check,
         "must be one line")
    need(not h.health_check or h.health_gate, "--health-check", h.health_check,
         "runs as part of the spares' health gate, which --no-health-gate turns off")
    real(h.health_max_age, 0 <= h.health_max_age <= 86400.0, "--health-max-age", "of 0 to 86400 seconds")
    real(h.health_recheck_every, h.health_recheck_every == 0 or 0.1 <= h.health_recheck_every <= 86400.0,
         "--health-recheck-every", "of 0 (none) or 0.1 to 86400 seconds")
    need(0 <= h.quarantine_after <= 1000, "--quarantine-after", h.quarantine_after, "must be in 0..1000 (0 = never)")
    real(h.quarantine_window, 0 < h.quarantine_window <= 100 * 365 * 86400.0, "--quarantine-window",
         "> 0 seconds (and at most a century)")
    from phoenixft.faults.kinds import Point

    sick = [f.text for f in cfg.faults if f.point is Point.HEALTH]
    need(not sick or h.health_gate, "--inject", sick[0] if sick else "",
         "makes a spare's health check fail, and --no-health-gate runs none")
