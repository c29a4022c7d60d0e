"""The GPU check's dependency check: what this interpreter has and what is missing (a missing module
leaves out the steps that need it: bench/gpu_steps.py). A module is only looked up here
(`importlib.util.find_spec`), except torch, whose CUDA build, NCCL and GPUs are asked (without
starting a CUDA context).

    python bench/gpu_deps.py [--wheels DIR] [--install]
    python bench/gpu_deps.py --simulate-env      # the exports that simulate the GPU machine here

`--install` installs each missing module other than torch from the wheels in DIR (`pip install
--no-index --no-deps --find-links DIR NAME`): torch is never installed over the machine's own.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NEEDED", "Deps", "check", "install_command", "main", "SIMULATED_MISSING", "simulated_env"]

# module -> (distribution, what needs it, whether nothing can run without it); a step names the others it needs
# (bench/gpu_steps.py: `Step.needs`) and is left out, saying why, where one is missing
NEEDED: dict[str, tuple[str, str, bool]] = {
    "torch": ("torch", "the GPU path itself (the machine's own CUDA build)", True),
    "numpy": ("numpy", "the data pipeline and tensor checksums", True),
    "xxhash": ("xxhash", "snapshot checksums", True),
    "safetensors": ("safetensors", "the final model export", True),
    "pytest": ("pytest", "the CUDA tests", False),
    "zfec": ("zfec", "Reed-Solomon parity of --redundancy ec:D+H with H >= 2", False),
}


# The modules phoenixft or its tools may import that the GPU image the check targets does not have (torch 2.11
# with CUDA 13, Python 3.12, numpy, pytest, xxhash, safetensors; no zfec, no cryptography, no etcd client):
# `bench/gpu_check.sh --dry-run` and `--rehearse` hide them here (bench/gpu_sim_site/sitecustomize.py).
SIMULATED_MISSING = ("zfec", "cryptography", "pyetcd", "etcd", "etcd3", "torchft", "pyeclib", "galois", "reedsolo",
                     "crc32c", "google_crc32c")
SIM_SITE = Path(__file__).resolve().parent / "gpu_sim_site"


def simulated_env(env: dict[str, str], missing: tuple[str, ...] = SIMULATED_MISSING) -> dict[str, str]:
    """`env` as the GPU machine would have it: `missing` not importable, no network but loopback."""
    path = [str(SIM_SITE), *[p for p in env.get("PYTHONPATH", "").split(":") if p and p != str(SIM_SITE)]]
    return {**env, "PYTHONPATH": ":".join(path), "PHOENIXFT_SIM_MISSING": ",".join(missing),
            "PHOENIXFT_SIM_OFFLINE": "1"}


@dataclass
class Deps:
    versions: dict[str, str] = field(default_factory=dict)  # module -> version, of those present
    missing: list[str] = field(default_factory=list)
    torch: dict[str, Any] = field(default_factory=dict)  # version, cuda (None: not built), nccl, gpus

    @property
    def fatal(self) -> list[str]:
        """Missing modules without which nothing can run."""
        return [m for m in self.missing if NEEDED[m][2]]

    @property
    def has_cuda(self) -> bool:
        return bool(self.torch.get("gpus"))

    def lines(self) -> list[str]:
        t = self.torch
        tdesc = (f"torch {t['version']} (CUDA {t['cuda']}, NCCL {t['nccl']}, {t['gpus']} GPU(s)"
                 f"{': ' + t['names'] if t.get('names') else ''})" if t.get("cuda") else
                 f"torch {t['version']} (built without CUDA)") if t else "torch: missing"
        have = [f"{m} {v}" for m, v in self.versions.items() if m != "torch"]
        out = [f"dependencies: python {sys.version.split()[0]}; {tdesc}; {'; '.join(have)}"]
        out += [f"missing: {m} ({NEEDED[m][1]})" for m in self.missing]
        return out


def _torch_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "gpus": 0}
    if torch.version.cuda:
        count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
        facts["gpus"] = count if count >= 0 else torch.cuda.device_count()
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - no NCCL in this build
            facts["nccl"] = "none"
    return facts


def check(find: Callable[[str], object] = importlib.util.find_spec) -> Deps:
    """What this interpreter has of `NEEDED` (`find`: how a module is looked up)."""
    d = Deps()
    for mod, (dist, _, _) in NEEDED.items():
        try:
            spec = find(mod)
        except ImportError:  # (an import hook that refuses the module: bench/gpu_sim_site)
            spec = None
        if spec is None:
            d.missing.append(mod)
            continue
        try:
            d.versions[mod] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            d.versions[mod] = "?"
    if "torch" not in d.missing:
        d.torch = _torch_facts()
    return d


def install_command(python: str, wheels: str, module: str) -> list[str] | None:
    """The command installing `module` from the wheel folder (None for torch: never installed here)."""
    if module == "torch":
        return None
    return [python, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", wheels, NEEDED[module][0]]


def install_missing(deps: Deps, wheels: str) -> Deps:
    """Install what is missing (torch excepted) from `wheels`; the dependencies after it."""
    for mod in list(deps.missing):
        cmd = install_command(sys.executable, wheels, mod)
        if cmd is None or not any(Path(wheels).glob(f"{NEEDED[mod][0]}-*.whl")):
            continue
        print(f"install: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=False, timeout=300)
    importlib.invalidate_caches()
    return check()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default="", help="a folder of wheels to install missing modules from")
    ap.add_argument("--install", action="store_true", help="install what is missing from --wheels")
    ap.add_argument("--simulate-env", action="store_true",
                    help="print the shell exports that simulate the GPU machine (bench/gpu_check.sh --dry-run)")
    a = ap.parse_args(argv)
    if a.simulate_env:
        env = simulated_env(dict(os.environ))
        for k in ("PYTHONPATH", "PHOENIXFT_SIM_MISSING", "PHOENIXFT_SIM_OFFLINE"):
            print(f"export {k}={shlex.quote(env[k])}")
        return 0
    deps = check()
    if a.install and a.wheels and deps.missing:
        deps = install_missing(deps, a.wheels)
    print("\n".join(deps.lines()))
    return 1 if deps.fatal else 0


if __name__ == "__main__":
    sys.exit(main())
