"""`RunConfig`: a run's configuration, composed of its sections.

The sections (`TrainingConfig`, `ParallelismConfig`, `ProtectionConfig`, `ControlPlaneConfig`,
`HealthConfig`, `InjectionConfig`, `OutputConfig`) each own their fields, whose help texts are the run flags' --help
lines, and their validation. `RunConfig` holds one of each (`cfg.training.steps`) and also reads and
writes every field by its flat name (`cfg.steps`), which is how the rest of the code and the JSON form
(config.json, the report's `config`, the store's signed config) name them: the JSON is one flat object.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from phoenixft.config.controlplane import ControlPlaneConfig, validate_control_plane
from phoenixft.config.health import HealthConfig, validate_health
from phoenixft.config.injection import InjectionConfig, validate_injection
from phoenixft.config.model import model_numel, validate_model, validate_split
from phoenixft.config.output import OutputConfig, validate_output
from phoenixft.config.parallelism import ParallelismConfig, validate_parallelism
from phoenixft.config.protection import ProtectionConfig, validate_protection
from phoenixft.config.training import TrainingConfig, validate_training

if TYPE_CHECKING:
    from phoenixft.faults.spec import FaultSpec
    from phoenixft.protect.redundancy.scheme import Redundancy

__all__ = ["RunConfig", "SECTIONS", "run_fields"]

T = TypeVar("T")

# (attribute of RunConfig, section class, title of its group in --help), in --help order
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("training", TrainingConfig, "training"),
    ("parallelism", ParallelismConfig, "parallelism"),
    ("protection", ProtectionConfig, "protection"),
    ("control", ControlPlaneConfig, "control plane"),
    ("health", HealthConfig, "spare health and quarantine"),
    ("injection", InjectionConfig, "fault injection"),
    ("output", OutputConfig, "output"),
)
_SECTION_OF: dict[str, str] = {f.name: attr for attr, cls, _ in SECTIONS for f in dataclasses.fields(cls)}


def run_fields() -> list[dataclasses.Field[Any]]:
    """Every run flag's field, section by section (the flat names of RunConfig and of its JSON)."""
    return [f for _, cls, _ in SECTIONS for f in dataclasses.fields(cls)]


class _Flat(Generic[T]):
    """`cfg.NAME`: the field NAME of the section it lives in, read and written through."""

    def __init__(self, section: str) -> None:
        self.section = section
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if _SECTION_OF.get(name) != self.section:
            raise TypeError(f"RunConfig.{name}: no field {name!r} in section {self.section!r}")
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Flat[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> T | _Flat[T]:
        if obj is None:
            return self
        return getattr(getattr(obj, self.section), self.name)

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.section), self.name, value)


@dataclass(init=False)
class RunConfig:
    """Everything a run needs, by section; immutable once published to the store.

    `RunConfig(steps=10, nodes=3)` takes the flat field names (sections may be given whole too:
    `RunConfig(training=TrainingConfig(...))`), and so do `cfg.replace(nodes=2)` and
    `dataclasses.replace(cfg, nodes=2)`."""

    training: TrainingConfig
    parallelism: ParallelismConfig
    protection: ProtectionConfig
    control: ControlPlaneConfig
    health: HealthConfig
    injection: InjectionConfig
    output: OutputConfig

    def __init__(self, *, training: TrainingConfig | None = None, parallelism: ParallelismConfig | None = None,
                 protection: ProtectionConfig | None = None, control: ControlPlaneConfig | None = None,
                 health: HealthConfig | None = None, injection: InjectionConfig | None = None,
                 output: OutputConfig | None = None, **fields: Any) -> None:
        given = {"training": training, "parallelism": parallelism, "protection": protection, "control": control,
                 "health": health, "injection": injection, "output": output}
        for attr, cls, _ in SECTIONS:  # a copy of each given section: a replace() never changes its source
            sec = given[attr]
            setattr(self, attr, dataclasses.replace(sec) if sec is not None else cls())
        for name, value in fields.items():
            if name not in _SECTION_OF:
                raise TypeError(f"RunConfig() got an unexpected keyword argument {name!r}")
            setattr(getattr(self, _SECTION_OF[name]), name, value)
        self.parallelism.resolve()
        self.protection.resolve()

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with the fields `changes` (by their flat names) changed; this config is left as it is."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the fields by their flat names
    steps = _Flat[int]("training")
    model = _Flat[str]("training")
    workload = _Flat[str]("training")
    data = _Flat[str]("training")
    data_dtype = _Flat[str]("training")
    micro_batch = _Flat[int]("training")
    microbatches = _Flat[int]("training")
    optimizer = _Flat[str]("training")
    lr = _Flat[float]("training")
    weight_decay = _Flat[float]("training")
    beta1 = _Flat[float]("training")
    beta2 = _Flat[float]("training")
    eps = _Flat[float]("training")
    momentum = _Flat[float]("training")
    nesterov = _Flat[bool]("training")
    lr_schedule = _Flat[str]("training")
    warmup_steps = _Flat[int]("training")
    min_lr = _Flat[float]("training")
    decay_steps = _Flat[int]("training")
    clip_grad_norm = _Flat[float]("training")
    precision = _Flat[str]("training")
    eval_every = _Flat[int]("training")
    eval_batches = _Flat[int]("training")
    seed = _Flat[int]("training")
    resume = _Flat[str]("training")
    script = _Flat[str]("training")
    script_args = _Flat[list[str]]("training")
    nodes = _Flat[int]("parallelism")
    device = _Flat[str]("parallelism")
    workers_per_node = _Flat[int]("parallelism")
    tp = _Flat[int]("parallelism")
    pp = _Flat[int]("parallelism")
    spares = _Flat[int]("parallelism")
    racks = _Flat[int]("parallelism")
    spare_arrives_at_step = _Flat[int]("parallelism")
    repair_after = _Flat[float]("parallelism")
    threads = _Flat[int]("parallelism")
    bucket_mb = _Flat[float]("parallelism")
    protect = _Flat[str]("protection")
    replicas = _Flat[int]("protection")
    redundancy = _Flat[str]("protection")
    persist_every = _Flat[int]("protection")
    sdc_check_every = _Flat[int]("protection")
    spike_threshold = _Flat[float]("protection")
    spike_window = _Flat[int]("protection")
    sdc_audit = _Flat[str]("protection")
    sdc_audit_every = _Flat[int]("protection")
    persist_dir = _Flat[str]("protection")
    chunk_mb = _Flat[float]("protection")
    replica_transport = _Flat[str]("protection")
    scrub_every = _Flat[int]("protection")
    join_timeout = _Flat[float]("control")
    start_grace = _Flat[float]("control")
    control_plane = _Flat[str]("control")
    coordinators = _Flat[int]("control")
    failure_timeout = _Flat[float]("control")
    fence_kill = _Flat[bool]("control")
    straggler_factor = _Flat[float]("control")
    straggler_window = _Flat[int]("control")
    evict_stragglers = _Flat[bool]("control")
    timeout = _Flat[float]("control")
    tls_cert = _Flat[str]("control")
    tls_key = _Flat[str]("control")
    tls_ca = _Flat[str]("control")
    store_max_mb = _Flat[int]("control")
    store_max_keys = _Flat[int]("control")
    store_step_records = _Flat[int]("control")
    health_gate = _Flat[bool]("health")
    health_check = _Flat[str]("health")
    health_check_timeout = _Flat[float]("health")
    health_max_age = _Flat[float]("health")
    health_recheck_every = _Flat[float]("health")
    quarantine_after = _Flat[int]("health")
    quarantine_window = _Flat[float]("health")
    quarantine_injected = _Flat[bool]("health")
    inject = _Flat[list[str]]("injection")
    report = _Flat[str]("output")
    run_dir = _Flat[str]("output")
    quiet = _Flat[bool]("output")
    json_events = _Flat[bool]("output")
    tensorboard = _Flat[str]("output")
    metrics_port = _Flat[int]("output")
    metrics_host = _Flat[str]("output")

    # ------------------------------------------------------------------ derived
    @property
    def scheme(self) -> Redundancy:
        """The parsed --redundancy (after validate(): always valid)."""
        return self.protection.scheme

    @property
    def faults(self) -> list[FaultSpec]:
        """The parsed --inject specs."""
        return self.injection.specs

    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size (at start)."""
        return max(1, self.world // max(1, self.tp * self.pp))

    @property
    def total_microbatches(self) -> int:
        return self.microbatches or self.dp * self.pp

    @property
    def mesh_spare_wait_s(self) -> float:
        """At most how long the coordinator waits for an expected spare when a --tp/--pp mesh lost a node and
        none is ready (rather than drop the node's whole data-parallel replica): the repair (--repair-after) and
        the spare's start-up."""
        return self.repair_after + 2 * self.failure_timeout + 30.0

    @property
    def next_epoch_wait_s(self) -> float:
        """How long a survivor waits for the next epoch's topology before it takes the control plane for
        gone: the coordinator's gather and decision, and on a mesh its wait for a spare (mesh_spare_wait_s).
        Shorter, the survivors of a mesh gave up while the coordinator still waited for the repaired node,
        and each such exit spent one of the worker's in-place restarts (the run lost after a few)."""
        return 3 * self.failure_timeout + 60.0 + (self.mesh_spare_wait_s if self.tp * self.pp > 1 else 0.0)

    def validate(self) -> None:
        """Raise UserError naming the option, the value and what would be valid: the mesh and, with --tp/--pp,
        how the model splits over it first (the root of most other errors), then each section's own checks,
        none of which imports torch (so a bad value of a data-parallel job is refused at once), then those that
        need the workload's model (its data, its checkpoint)."""
        validate_parallelism(self)
        if self.script:
            from phoenixft.config.script import validate_script

            validate_script(self)
        else:
            validate_split(self)
        validate_training(self)
        validate_protection(self)
        validate_control_plane(self)
        validate_health(self)
        validate_injection(self)
        validate_output(self)
        if not self.script:
            validate_model(self)

    def model_numel(self) -> int | None:
        """Trainable parameters of the configured model (None if it cannot be built on the meta device)."""
        return model_numel(self)

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """The flat form: every field by its flat name."""
        return {f.name: _copy(getattr(self, f.name)) for f in run_fields()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        data = json.loads(text)
        data.setdefault("device", "cpu")  # written before --device existed: those runs trained on CPU
        return cls(**{k: v for k, v in data.items() if k in _SECTION_OF})


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


_missing = set(_SECTION_OF) ^ {n for n, v in vars(RunConfig).items() if isinstance(v, _Flat)}
if _missing:  # every section field has exactly one flat name, and no flat name is without its field
    raise TypeError(f"RunConfig's flat names and its sections' fields differ: {sorted(_missing)}")
