"""Trained weights out of a run: the final state, and `phoenixft export` to safetensors or torch.save.

Every run that completes writes `RUN_DIR/final/model.safetensors` (rank 0, at the end): the
model's full, unsharded `state_dict` - parameters as their fp32 master weights, buffers as
trained - loadable with `model.load_state_dict(safetensors.torch.load_file(path))`, and
`RUN_DIR/final/meta.json` (step, final state hash, configuration).

`phoenixft export SRC --out PATH [--format safetensors|pt] [--step N]` copies that out of a run
directory, or rebuilds it from a persistent checkpoint directory (`--persist-dir`, the newest
complete checkpoint or `--step N`): the manifest carries the run's configuration, so the model
is built by its workload and the flat master weights and buffers are put back under its names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phoenixft.errors import UserError

if TYPE_CHECKING:  # (imported where used: the CLI builds its parser from this module, and `phoenixft gc`,
    import torch  # `status`, `simulate` and `--help` must not pay for `import torch`)

__all__ = ["state_dict_from", "write_final", "export", "add_parser"]


def state_dict_from(model: torch.nn.Module, master: torch.Tensor,
                    buffers: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's state_dict with trainable parameters taken from `master` (flat fp32, in the order
    of `model.parameters()`, as FlatModel lays them out) and buffers from `buffers` (their bytes,
    in state_dict order). Tied parameters get their own copy under every name."""
    offsets: dict[int, tuple[int, torch.Size]] = {}
    off = 0
    for p in model.parameters():
        if p.requires_grad:
            offsets[id(p)] = (off, p.shape)
            off += p.numel()
    if off != master.numel():
        raise UserError(f"the state has {master.numel():,} parameters, the model has {off:,}")
    pids = {id(p) for p in model.parameters()}
    out: dict[str, torch.Tensor] = {}
    boff = 0
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in offsets:
            o, shape = offsets[id(t)]
            out[name] = master[o : o + t.numel()].reshape(shape).clone()
        elif id(t) in pids:  # frozen parameter: as built
            out[name] = t.detach().to("cpu", copy=True)
        else:
            n = t.numel() * t.element_size()
            if buffers is not None and boff + n <= buffers.numel():
                out[name] = buffers[boff : boff + n].clone().view(t.dtype).reshape(t.shape)
            else:
                out[name] = t.detach().to("cpu", copy=True)
            boff += n
    return out


def _save(sd: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if fmt == "pt":
        import torch

        torch.save(sd, tmp)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    os.replace(tmp, path)


def write_final(run_dir: str, trainer: Any, master: torch.Tensor, cfg: Any, sha: str) -> str:
    """Rank 0, at the end of a run: the final state as safetensors in RUN_DIR/final."""
    d = Path(run_dir) / "final"
    whole = trainer.full_model is trainer.model  # else a stage of a 3D layout; the full model's structure is kept
    sd = state_dict_from(trainer.full_model, master, trainer.flat.buffer_bytes_now() if whole else None)
    _save(sd, d / "model.safetensors", "safetensors")
    (d / "meta.json").write_text(json.dumps({"step": cfg.steps, "final_state_sha256": sha,
                                             "config": json.loads(cfg.to_json())}, indent=2))
    return str(d / "model.safetensors")


def _from_checkpoint(root: Path, step: int | None) -> dict[str, torch.Tensor]:
    import torch

    from phoenixft.config import RunConfig
    from phoenixft.protect.persist import check, latest_manifest, load_full, verified_manifest
    from phoenixft.workload import WorkloadContext, load_workload

    man = latest_manifest(root, max_step=step)
    if man is None or (step is not None and man["step"] != step):
        what = f"no complete checkpoint of step {step}" if step is not None else "no complete checkpoint"
        raise UserError(f"SRC={str(root)!r} is invalid: {what} (step_*/MANIFEST.json) there")
    bad_file = check(man)
    if bad_file is not None:  # never export bytes that changed since they were written
        good, _ = verified_manifest(root, max_step=man["step"] - 1)
        hint = (f"; the newest checkpoint that verifies is step {good['step']} (--step {good['step']})"
                if good is not None else "; no older checkpoint there verifies either")
        raise UserError(f"SRC={str(root)!r}: the checkpoint of step {man['step']} does not verify: {bad_file[0]} "
                        f"{bad_file[1]}{hint}")
    if not man.get("config"):
        raise UserError(f"SRC={str(root)!r}: the checkpoint of step {man['step']} predates exports (no configuration "
                        "in its manifest)")
    cfg = RunConfig.from_json(json.dumps(man["config"]))
    try:
        wl = load_workload(cfg.workload, WorkloadContext.from_config(cfg))
    except UserError as e:  # (export has no --workload flag: say where the name came from)
        raise UserError(f"SRC={str(root)!r}: the checkpoint was written by a run of {e} (its module must import "
                        "here too: PYTHONPATH)") from None
    torch.manual_seed(cfg.seed)
    model = wl.build_model()
    if cfg.precision == "bf16":  # buffers (and frozen parameters) were trained (and saved) in the parameters' dtype
        for b in [*model.buffers(), *(p for p in model.parameters() if not p.requires_grad)]:
            if b.is_floating_point():
                b.data = b.data.to(torch.bfloat16)
    try:
        full, buffers, bad = load_full(man)
    except OSError as e:
        raise UserError(f"SRC={str(root)!r}: {e}") from None
    if bad:
        raise UserError(f"SRC={str(root)!r}: shards {bad} of step {man['step']} do not match their checksums")
    return state_dict_from(model, full[0], buffers)


def export(src: str, out: str, fmt: str = "safetensors", step: int | None = None) -> Path:
    root = Path(src)
    if fmt not in ("safetensors", "pt"):
        raise UserError(f"--format={fmt!r} is invalid: one of safetensors, pt")
    if not root.exists():
        raise UserError(f"SRC={src!r} does not exist: give a run directory or a persistent checkpoint directory")
    from phoenixft.config import check_output_file

    check_output_file("--out", out)  # before the model is loaded: a wrong path is one line, not a traceback
    path = Path(out)
    final = root / "final" / "model.safetensors"
    if final.exists() and step is None:
        from safetensors.torch import load_file

        sd = load_file(str(final))
    elif any(root.glob("step_*/MANIFEST.json")) or (root / "MANIFEST.json").exists():
        sd = _from_checkpoint(root if any(root.glob("step_*/MANIFEST.json")) else root.parent, step)
    elif final.exists():
        raise UserError(f"--step={step} is invalid for SRC={src!r}: a run directory holds only its final model; "
                        "--step picks a checkpoint of a persistent checkpoint directory (--persist-dir), or leave "
                        "it out")
    else:
        raise UserError(f"SRC={src!r} is invalid: neither a run directory with final/model.safetensors (a run that "
                        "completed) nor a checkpoint directory with step_*/MANIFEST.json")
    from safetensors import SafetensorError

    try:
        _save(sd, path, fmt)
    except (OSError, SafetensorError) as e:  # e.g. the disk filled up meanwhile
        with contextlib.suppress(OSError):  # (a half-written temporary file)
            path.with_name(path.name + ".tmp").unlink()
        raise UserError(f"--out={out!r} is invalid: cannot write it ({getattr(e, 'strerror', None) or e}); give a "
                        "writable file path") from None
    return path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's (or a checkpoint's) model state_dict as safetensors or .pt",
                       description="Export the full, unsharded model state_dict (parameters and buffers).")
    p.add_argument("src", metavar="SRC", help="a run directory, or a persistent checkpoint directory (--persist-dir)")
    p.add_argument("--out", required=True, help="output file, e.g. model.safetensors")
    p.add_argument("--format", default="safetensors", help="safetensors (default) or pt (torch.save)")
    p.add_argument("--step", type=int, default=None, help="from a checkpoint directory: this step (default newest)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    path = export(args.src, args.out, args.format, args.step)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0
