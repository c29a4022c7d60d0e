"""The workload interface: how users train *their own* model under phoenixft.

A workload factory is a function `f(ctx: WorkloadContext) -> Workload`, named on the command
line as `--workload pkg.module:function` (a module in the current directory, on PYTHONPATH or installed)
or `--workload path/to/file.py:function` (loaded as `python file.py` runs it). The three callables it
returns must be deterministic:

- `build_model()` builds the model (called under `torch.manual_seed(ctx.seed)` on every rank);
- `loss(model, batch)` returns the scalar loss of one microbatch;
- `batch(step, index)` returns microbatch `index` of step `step`: a *pure function* of
  (seed, step, index), so that any rank can produce any microbatch and recovery or shrinking
  needs no data-loader state beyond the step number.

Optional: `eval_batch(index)` (held-out batches for `--eval-every`), `optimizer` (an elementwise
optimizer of the workload's own, see `phoenixft.optim`), `prepare` (one-off work in the launcher),
`split(full_model, spec)` (how the model cuts into tensor/pipeline-parallel stages, see
`phoenixft.parallel.stage`; without it `--tp`/`--pp` > 1 is refused).

Any randomness inside `loss` (dropout) is seeded by phoenixft per (seed, step, microbatch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from phoenixft.config.training import is_file_spec
from phoenixft.errors import UserError, user_traceback

__all__ = ["Workload", "WorkloadContext", "load_workload", "check_workload_path", "unsupported_parameters",
           "build_on_meta"]


@dataclass(frozen=True, kw_only=True)
class WorkloadContext:
    seed: int
    micro_batch: int
    model: str  # the --model preset name; user workloads may ignore it
    microbatches: int = 1  # microbatches per step across all ranks (global batch = micro_batch x microbatches)
    data: str = ""  # --data: a token file (or a directory with train.bin / val.bin); "" = built-in corpus
    data_dtype: str = "uint16"  # --data-dtype: token id type of --data when it has no sidecar JSON

    @classmethod
    def from_config(cls, cfg: Any) -> WorkloadContext:
        """The context of a RunConfig: the one way the launcher and every worker build it."""
        return cls(seed=cfg.seed, micro_batch=cfg.micro_batch, model=cfg.model,
                   microbatches=cfg.total_microbatches, data=cfg.data, data_dtype=cfg.data_dtype)


@dataclass(frozen=True, kw_only=True)
class Workload:
    build_model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    batch: Callable[[int, int], Any]
    tokens_per_microbatch: int = 0  # for tokens/s; 0 = unknown
    prepare: Callable[[], None] | None = None  # one-off work done by the launcher (e.g. corpus cache)
    eval_batch: Callable[[int], Any] | None = None  # held-out batch `index` (pure); enables --eval-every
    optimizer: Any = None  # an ElementwiseOptimizer of the workload's own (see phoenixft.optim); None = --optimizer
    split: Callable[[torch.nn.Module, Any], Any] | None = None  # (full model, StageSpec) -> Stage; enables --tp/--pp


# the built-in GPT's public name (the `--workload` default, written in every config.json) and the
# module that implements it
MODULE_ALIASES = {"phoenixft.gpt": "phoenixft.train.gpt"}


_FILES: dict[str, Any] = {}  # a workload file loaded once per process, by its path


def _import_file(target: str, spec: str) -> Any:
    """The module of the file `target`, loaded as `python FILE` would run it (its directory first on sys.path,
    so that the modules beside it import)."""
    path = os.path.abspath(os.path.expanduser(target))
    if path in _FILES:
        return _FILES[path]
    if not os.path.isfile(path):
        raise UserError(f"--workload={spec!r} is invalid: there is no file {path} (a relative path is taken from the "
                        f"current directory, {os.getcwd()})")
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and os.path.abspath(getattr(sys.modules[name], "__file__", "") or "") != path:
        name = f"{name}_{abs(hash(path)):x}"  # (another module of that name is imported: keep both)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_spec = importlib.util.spec_from_file_location(name, path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = mod
    try:
        mod_spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - user code: one line, with its own traceback above it
        del sys.modules[name]
        where, trace = user_traceback(e)
        raise UserError(f"--workload={spec!r} does not import: {type(e).__name__}: {e} (at {where})",
                        detail=trace) from None
    _FILES[path] = mod
    return mod


def _nearby(top: str, limit: int = 4) -> list[str]:
    """Files `TOP.py` (or packages `TOP/`) within three directories below the current one: where a module the
    user named may be."""
    found: list[str] = []
    base = os.getcwd()
    for root, dirs, files in os.walk(base):
        depth = os.path.relpath(root, base).count(os.sep) + (root != base)
        dirs[:] = [] if depth >= 3 else sorted(d for d in dirs if not d.startswith((".", "__")) and
                                                d not in ("node_modules", "site-packages", "venv", ".venv"))
        if f"{top}.py" in files:
            found.append(os.path.relpath(os.path.join(root, f"{top}.py"), base))
        if top in dirs and os.path.isfile(os.path.join(root, top, "__init__.py")):
            found.append(os.path.relpath(os.path.join(root, top), base) + os.sep)
        if len(found) >= limit:
            break
    return found


def _not_found(spec: str, name: str, fn: str) -> str:
    """Why module `name` of `spec` cannot be imported: where it was looked for, and what would fix it."""
    top = name.split(".")[0]
    pythonpath = os.environ.get("PYTHONPATH", "")
    searched = (f"searched the current directory ({os.getcwd()}), PYTHONPATH ({pythonpath or 'not set'}) and the "
                "installed packages")
    files = [f for f in _nearby(top) if f.endswith(".py")] if "." not in name else _nearby(top)
    if files:
        f = files[0]
        folder = os.path.dirname(f.rstrip(os.sep)) or "."
        give = f"give the file, --workload {f}:{fn}, or " if f.endswith(".py") else ""
        fix = (f"found {', '.join(files)} below the current directory: {give}put its directory on PYTHONPATH "
               f"(PYTHONPATH={folder} phoenixft ...)")
    else:
        fix = (f"run from the directory that holds {top}.py, put that directory on PYTHONPATH "
               f"(PYTHONPATH=DIR phoenixft ...), or give the file: --workload path/to/{top}.py:{fn}")
    return f"--workload={spec!r}: no module named {name!r} ({searched}); {fix}"


def _import_module(name: str, spec: str, fn: str) -> Any:
    """Module `name`, looked for as `python -m` would (the current directory too), then on sys.path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # (the `phoenixft` script's own directory is first on its path, not the current one)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise UserError(_not_found(spec, name, fn)) from None
        where, trace = user_traceback(e)
        raise UserError(f"--workload={spec!r} does not import: it imports {missing!r}, which is not installed or not "
                        f"on the path (at {where}; `pip install` it, or put its directory on PYTHONPATH)",
                        detail=trace) from None
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix: one line, with its traceback
        where, trace = user_traceback(e)
        raise UserError(f"--workload={spec!r} does not import: {type(e).__name__}: {e} (at {where})",
                        detail=trace) from None


def _resolve(path: str) -> Callable[[WorkloadContext], Workload]:
    if ":" not in path:
        raise UserError(f"--workload={path!r} is invalid: expected 'pkg.module:function' or "
                        "'path/to/file.py:function'")
    target, fn_name = path.rsplit(":", 1)
    if not target or not fn_name:
        raise UserError(f"--workload={path!r} is invalid: expected 'pkg.module:function' or "
                        "'path/to/file.py:function'")
    if is_file_spec(target):
        mod = _import_file(target, path)
    else:
        mod = _import_module(MODULE_ALIASES.get(target, target), path, fn_name)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == mod.__name__)
        raise UserError(f"--workload={path!r} is invalid: {target} has no function {fn_name!r}"
                        + (f" (its functions: {', '.join(names[:12])})" if names else ""))
    return fn


def check_workload_path(path: str) -> None:
    _resolve(path)


def load_workload(path: str, ctx: WorkloadContext) -> Workload:
    try:
        wl = _resolve(path)(ctx)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the factory is user code: one line, with its own traceback above it
        where, trace = user_traceback(e)
        raise UserError(f"--workload={path!r} failed to set up: {type(e).__name__}: {e} (at {where})",
                        detail=trace) from None
    if not isinstance(wl, Workload):
        raise UserError(f"--workload={path!r} is invalid: it returned {type(wl).__name__}, expected phoenixft.Workload")
    return wl


def unsupported_parameters(model: torch.nn.Module, precision: str = "fp32") -> str | None:
    """Why phoenixft cannot train `model`'s parameters as built, or None. The trainable parameters become
    views into one flat fp32 buffer (bf16 with --precision bf16): a model with none has nothing to train,
    and one built in another floating-point dtype would be silently turned into fp32 under the user's
    feet (its batches then fail to match it: "mat1 and mat2 must have the same dtype"). Extra state
    (`get_extra_state`) is a state_dict entry that is no tensor: nothing of phoenixft's can hold it."""
    extra = [n or "(the model)" for n, m in model.named_modules()
             if type(m).get_extra_state is not torch.nn.Module.get_extra_state]
    if extra:  # (a state_dict entry that is no tensor: it failed inside the flat model, and the run hung to --timeout)
        return (f"module {extra[0]!r} keeps extra state (get_extra_state), which phoenixft cannot protect, restore "
                "or export (it holds tensors only): keep that state in buffers (register_buffer) instead")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        return "the model has no trainable parameters (every parameter has requires_grad=False): nothing to train"
    ok = (torch.float32, torch.bfloat16) if precision == "bf16" else (torch.float32,)
    odd = [(n, p.dtype) for n, p in params if p.dtype not in ok]
    if odd:
        name, dtype = odd[0]
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        return (f"parameter {name!r}{more} is {dtype}: phoenixft trains float32 parameters (fp32 master weights; "
                "--precision bf16 runs them in bf16 itself; it also takes a model built in bf16); build the model "
                "in float32")
    return None


# On the meta device an in-place op has no values to write: it changes a tensor's values only, except for the
# few below that change its metadata (shape, strides, grad tracking), which run. Run there, torch routes many
# of them (random initialisers; clamp_ and erfinv_ of torch 2.11's trunc_normal_) through its Python reference
# kernels, whose first call imports the compiler (torch._dynamo): seconds of a launch's start-up for a build
# that only counts parameters. torch.nn.init's functions are in-place ops too (`xavier_uniform_(t)`).
_META_RUN = frozenset({
    "requires_grad_", "detach_", "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
    "transpose_", "swapdims_", "swapaxes_", "share_memory_", "rename_", "sparse_resize_", "sparse_resize_and_clear_",
})


def _meta_noop(name: str) -> bool:
    """An in-place op that only writes values (skipped on meta tensors)."""
    return name.endswith("_") and not name.startswith("_") and name not in _META_RUN


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Skips in-place value writes on meta tensors (their shapes, dtypes and sharing are what a meta build is
    for)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _meta_noop(name):
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        out = kwargs.get("out")
        if name == "eye" and isinstance(out, torch.Tensor) and out.is_meta:  # nn.init.eye_: eye(*t.shape, out=t)
            return out
        return func(*args, **kwargs)


T = TypeVar("T")


def _skip_on_meta(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def skip(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else init(tensor, *args, **kwargs)
    skip.__wrapped_init__ = init  # type: ignore[attr-defined]
    return skip


@contextlib.contextmanager
def _meta_inits() -> Iterator[None]:
    """torch.nn.init's in-place initialisers skip meta tensors meanwhile. Most of them are not overridable
    (`_SkipMetaInit` never sees them, only the ops inside): on some torch releases (2.11) those ops reach the
    reference kernels on meta (`trunc_normal_`'s clamp_, `orthogonal_`'s sign). A model that calls them
    through the module (`nn.init.orthogonal_`) gets the skipping ones; one that imported a function itself
    runs it on meta, only slower. Another thread's call on real tensors runs the real initialiser."""
    init = torch.nn.init
    saved = {n: f for n, f in vars(init).items()
             if _meta_noop(n) and callable(f) and not hasattr(f, "__wrapped_init__")}
    for n, f in saved.items():
        setattr(init, n, _skip_on_meta(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def build_on_meta(build: Callable[[], T]) -> T:
    """`build()` on torch's meta device, its value initialisers skipped: a model's structure (parameters,
    buffers, shapes, dtypes, stages) with no memory allocated and no initialisation run."""
    with torch.device("meta"), _SkipMetaInit(), _meta_inits():
        return build()
