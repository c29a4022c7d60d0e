"""Typed, validated run configuration, in sections.

`RunConfig` is the single source of truth for a training job: the launcher builds it from the
command line, validates it, and publishes it to the control-plane store as flat JSON, where every
agent and worker reads it back. It is composed of one dataclass per section, each in its own module
with its validation:

    training      TrainingConfig      model, data, steps, batch, optimizer, schedule, precision, eval, resume
    parallelism   ParallelismConfig   nodes, device, workers per node, tp/pp, spares, racks, threads
    protection    ProtectionConfig    protect, redundancy/replicas, persistent checkpoints, replica transport
    control       ControlPlaneConfig  store, coordinators, failure/join/run timeouts, fencing
    health        HealthConfig        the spares' health gate, --health-check, the quarantine of hosts
    injection     InjectionConfig     --inject fault specs (parsed by phoenixft.faults.spec)
    output        OutputConfig        run directory, report, live display, JSON events

Each field's metadata is its flag (`options.option`): its help text is the --help line. Every field is
also read and written by its flat name (`cfg.steps` is `cfg.training.steps`). Importing this package
does not import torch; validation imports what it checks when it runs. The agent's flags, which are
not a run's, are in `phoenixft.config.agent`.
"""

from __future__ import annotations

from phoenixft.config.checks import (
    MAX_FAILURE_TIMEOUT_S,
    MAX_THREADS,
    MAX_WORKERS,
    check_output_file,
    checkpoint_bytes,
)
from phoenixft.config.controlplane import ControlPlaneConfig
from phoenixft.config.flags import add_run_arguments, config_from_args
from phoenixft.config.health import HealthConfig
from phoenixft.config.injection import InjectionConfig
from phoenixft.config.output import OutputConfig
from phoenixft.config.parallelism import ParallelismConfig
from phoenixft.config.protection import PROTECT_MODES, TRANSPORTS, ProtectionConfig
from phoenixft.config.run import SECTIONS, RunConfig, run_fields
from phoenixft.config.training import TrainingConfig

__all__ = ["RunConfig", "TrainingConfig", "ParallelismConfig", "ProtectionConfig", "ControlPlaneConfig",
           "HealthConfig", "InjectionConfig", "OutputConfig", "SECTIONS", "run_fields", "add_run_arguments",
           "config_from_args",
           "checkpoint_bytes", "check_output_file", "PROTECT_MODES", "TRANSPORTS", "MAX_FAILURE_TIMEOUT_S",
           "MAX_THREADS", "MAX_WORKERS"]
