"""The checks that need the workload itself: its model (built on torch's meta device, no memory and no
init cost), how it splits over --tp/--pp, its held-out data, the room a checkpoint of it takes, and
whether the checkpoint a run resumes from fits it. torch is imported only when these run."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from phoenixft.config.checks import checkpoint_bytes, existing, mib, need
from phoenixft.config.training import DEFAULT_WORKLOAD
from phoenixft.errors import UserError

if TYPE_CHECKING:
    from phoenixft.config.run import RunConfig

__all__ = ["validate_split", "validate_model", "model_numel", "model_name"]

_NUMEL: dict[tuple[Any, ...], int | None] = {}


def validate_split(cfg: RunConfig) -> None:
    """--tp/--pp > 1: the workload loads and its model splits over the mesh (checked with the mesh's
    sizes, before the sections that build on the mesh; only then is torch imported)."""
    if cfg.tp * cfg.pp > 1:
        from phoenixft.workload import check_workload_path

        check_workload_path(cfg.workload)
        _check_split(cfg)


def validate_model(cfg: RunConfig) -> None:
    """The workload loads, splits over the mesh, evaluates when asked to, fits its persistent tier, and
    matches the checkpoint of --resume; then the token file of --data."""
    from phoenixft.workload import check_workload_path

    check_workload_path(cfg.workload)
    if cfg.eval_every and cfg.workload != DEFAULT_WORKLOAD:
        from phoenixft.workload import WorkloadContext, load_workload

        # (asked for and silently never done: no val_loss anywhere, no word why)
        need(load_workload(cfg.workload, WorkloadContext.from_config(cfg)).eval_batch is not None,
             "--eval-every", cfg.eval_every, f"--workload {cfg.workload} has no held-out batches "
             "(Workload.eval_batch) to evaluate on: give it one, or --eval-every 0")
    if cfg.persist_every:
        numel = model_numel(cfg)
        if numel is not None:
            st = os.statvfs(existing(cfg.persist_dir))
            free, need_b = st.f_bavail * st.f_frsize, checkpoint_bytes(numel)
            need(free >= need_b, "--persist-dir", cfg.persist_dir,
                 f"only {mib(free)} free there, one checkpoint of {model_name(cfg)} "
                 f"({numel:,} parameters) needs about {mib(need_b)}")
    if cfg.resume:
        _validate_resume(cfg)
    if cfg.data:
        from phoenixft.data import check_data
        from phoenixft.train.gpt import PRESETS

        # the window check needs the block size: known for the built-in GPT, the user's business otherwise
        block = PRESETS[cfg.model].block_size if cfg.workload == DEFAULT_WORKLOAD else None
        check_data(cfg.data, cfg.data_dtype, block)
    else:
        need(cfg.data_dtype in ("uint16", "uint32"), "--data-dtype", cfg.data_dtype, "one of uint16, uint32")


def _validate_resume(cfg: RunConfig) -> None:
    """--resume: a complete checkpoint before --steps, of this model, in this precision and optimizer; no
    fault at a step the resumed run never trains."""
    from phoenixft.protect.persist import latest_manifest

    man = latest_manifest(cfg.resume)
    need(man is not None, "--resume", cfg.resume, "no complete checkpoint (step_*/MANIFEST.json) there")
    assert man is not None
    need(man["step"] < cfg.steps, "--resume", cfg.resume,
         f"its checkpoint is at step {man['step']}; --steps must be larger")
    done = int(man["step"])
    for f in cfg.faults:  # steps up to the checkpoint's are never trained again: such a fault never fires
        if f.step is not None and f.step <= done:
            need(False, "--inject", f.text,
                 f"its step {f.step} is at or before step {done} of the checkpoint --resume={cfg.resume} "
                 f"starts from (the run trains steps {done + 1}..{cfg.steps}), so it would never fire; "
                 f"give a step in {done + 1}..{cfg.steps}")
    numel = model_numel(cfg)
    if numel is not None and int(man.get("numel", numel)) != numel:
        raise UserError(f"--resume={cfg.resume}: checkpoint has {int(man['numel']):,} parameters, "
                        f"{model_name(cfg)} has {numel:,}")
    _check_resume_rows(cfg, man)
    wrote = (man.get("config") or {}).get("precision", "fp32")
    # the model's buffers are saved as bytes in the precision that trained them (floating buffers follow
    # the parameters into bf16): read with another one they were garbage (a loss of inf a step later)
    need(not int(man.get("buffer_bytes") or 0) or wrote == cfg.precision, "--precision", cfg.precision,
         f"with --resume={cfg.resume}: its checkpoint of step {man['step']} was written with --precision "
         f"{wrote} and holds the model's buffers in it; resume it with --precision {wrote}")


def _check_resume_rows(cfg: RunConfig, man: dict[str, Any]) -> None:
    """--resume: the checkpoint's state rows (master weights + one per optimizer state tensor, whatever
    the precision) must be the rows of this run's optimizer, or the restore fails once the job runs."""
    from phoenixft.optim import OPTIMIZERS

    def names(states: tuple[str, ...]) -> str:
        return ", ".join(("param", *states))

    rows = int(man.get("rows", 3))  # checkpoints that predate the key held AdamW's 3 rows (as load_full reads)
    opt = _run_optimizer(cfg)
    if opt is None:
        return
    flag, value, what, mine = opt
    if 1 + len(mine) == rows:
        return
    wrote = (man.get("config") or {}).get("optimizer")
    by = f"--optimizer {wrote}, " if isinstance(wrote, str) else ""
    if isinstance(wrote, str) and wrote in OPTIMIZERS and 1 + len(_states(wrote)) == rows:
        by += f"{rows} state rows ({names(_states(wrote))})"
    else:
        by += f"{rows} state rows"
    same = [n for n in OPTIMIZERS if 1 + len(_states(n)) == rows]
    valid = (f"resume it with --optimizer {' or '.join(same)}" if same else
             "no built-in optimizer keeps that many rows (the workload that wrote it brought its own)")
    raise UserError(f"{flag}={value!r} is invalid with --resume={cfg.resume}: its checkpoint of step "
                    f"{man['step']} was written with {by}; {what} keeps {1 + len(mine)} rows ({names(mine)}); "
                    f"{valid}")


def _run_optimizer(cfg: RunConfig) -> tuple[str, str, str, tuple[str, ...]] | None:
    """(flag, value, description, state names) of this run's optimizer: --optimizer, or the workload's
    own; None if the workload cannot be loaded here or brings an invalid optimizer (its workers report it)."""
    from phoenixft.optim import ElementwiseOptimizer

    by_flag = ("--optimizer", cfg.optimizer, cfg.optimizer, _states(cfg.optimizer))
    if cfg.workload == DEFAULT_WORKLOAD:
        return by_flag
    try:
        from phoenixft.workload import WorkloadContext, load_workload

        own = load_workload(cfg.workload, WorkloadContext.from_config(cfg)).optimizer
    except Exception:  # noqa: BLE001 - user code: the workers will report its errors properly
        return None
    if own is None:
        return by_flag
    if not isinstance(own, ElementwiseOptimizer):
        return None
    return "--workload", cfg.workload, f"its optimizer {own.describe()}", tuple(own.state_names)


def _states(optimizer: str) -> tuple[str, ...]:
    """The state tensors a built-in --optimizer keeps per parameter (its shard rows after the master weights)."""
    from phoenixft.optim import OPTIMIZERS

    return tuple(getattr(OPTIMIZERS[optimizer], "state_names", ()))


def _check_split(cfg: RunConfig) -> None:
    """--tp/--pp > 1: the workload must say how its model splits, and this split must be valid."""
    from phoenixft.parallel.layers import TPHandle
    from phoenixft.parallel.stage import StageSpec
    from phoenixft.workload import WorkloadContext, build_on_meta, load_workload

    wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
    if wl.split is None:
        raise UserError(f"--tp={cfg.tp} --pp={cfg.pp} is invalid for --workload {cfg.workload}: it does not say "
                        "how its model splits (Workload.split); use --tp 1 --pp 1 for data parallelism")
    split = wl.split

    def build_and_split() -> None:
        model = wl.build_model()
        for pp in range(cfg.pp):
            split(model, StageSpec(pp=pp, pp_size=cfg.pp, tp=0, tp_size=cfg.tp, handle=TPHandle(cfg.tp, 0)))

    try:
        build_on_meta(build_and_split)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - user code: the workers report its errors properly
        pass


def model_name(cfg: RunConfig) -> str:
    """The flag that names the model: `--model PRESET` for the built-in GPT, else `--workload PATH`."""
    return f"--model {cfg.model}" if cfg.workload == DEFAULT_WORKLOAD else f"--workload {cfg.workload}"


def model_numel(cfg: RunConfig) -> int | None:
    """Trainable parameters of the configured model, built on torch's meta device (no memory,
    no init cost); None if the workload's model cannot be built that way. Cached per model."""
    key = (cfg.workload, cfg.model, cfg.data, cfg.data_dtype, cfg.micro_batch, cfg.seed)
    if key not in _NUMEL:
        _NUMEL[key] = _build_numel(cfg)
    return _NUMEL[key]


def _build_numel(cfg: RunConfig) -> int | None:
    try:
        from phoenixft.workload import WorkloadContext, build_on_meta, load_workload

        wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
        model = build_on_meta(wl.build_model)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    except Exception:  # noqa: BLE001 - user code: the workers will report its errors properly
        return None
