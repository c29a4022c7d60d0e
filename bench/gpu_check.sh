#!/usr/bin/env bash
# The GPU check, self-contained on a bare GPU machine without network (docs/gpu.md):
#
#   bench/gpu_check.sh --out DIR [--deadline S] [--step-cap S] [--only a,b] [--wheels DIR]   # on the GPU machine
#   bench/gpu_check.sh --dry-run       # anywhere: the plan, its time budget, every command, in the simulated machine
#   bench/gpu_check.sh --rehearse --out DIR   # the whole harness on CPU in the simulated machine (NOT a GPU result)
#
# - the interpreter: $PYTHON, else the first of python3, .venv/bin/python, python whose torch sees a CUDA
#   device; the machine's own torch is used as it is (never installed). Without one, the first whose torch
#   imports still writes DIR/gpu_check.json saying so;
# - the project from src/ on PYTHONPATH (nothing installed); NCCL set for one host (loopback sockets, no
#   InfiniBand) unless already set;
# - the deadline counts from this script's start (default 480 s: the device machine's cap is 10 minutes
#   a command); DIR/gpu_check.json and DIR/runs.tar.gz are rewritten after every step;
# - --dry-run and --rehearse simulate the GPU machine here: torch 2.11 from .venv-torch-2.11.0
#   (`make test-oldest-torch` builds it) when present, the modules that machine lacks (zfec, cryptography,
#   ...) not importable, no network but loopback.
set -uo pipefail
T0=$(date +%s.%N)
cd "$(dirname "$0")/.." || exit 1

mode=gpu
args=()
out=""
prev=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) mode=dry; args+=("$arg") ;;
        --rehearse) mode=rehearse ;;
        *) args+=("$arg") ;;
    esac
    [ "$prev" = "--out" ] && out="$arg"
    case "$arg" in --out=*) out="${arg#--out=}" ;; esac
    prev="$arg"
done

has() {  # has PYTHON PROBE: the interpreter exists and the probe exits 0 in it
    command -v "$1" >/dev/null 2>&1 && PYTORCH_NVML_BASED_CUDA_CHECK=1 "$1" -c "$2" >/dev/null 2>&1
}

pick_python() {  # pick_python PROBE CANDIDATES...
    local probe=$1 c
    shift
    for c in "$@"; do
        if [ -n "$c" ] && has "$c" "$probe"; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"  # one host: every rank on loopback
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
export PYTHONUNBUFFERED=1

if [ "$mode" != gpu ]; then
    sim_py=.venv-torch-2.11.0/bin/python
    if PY=$(pick_python 'import torch' "${PYTHON:-}" "$sim_py" .venv/bin/python python3); then :; else
        echo "FAIL: no Python with torch (tried: ${PYTHON:-} $sim_py .venv/bin/python python3; set PYTHON=...)"
        exit 1
    fi
    [ "$PY" = "$sim_py" ] || echo "note: $sim_py is missing (make test-oldest-torch builds it): simulating with $PY"
    eval "$("$PY" bench/gpu_deps.py --simulate-env)"
    echo "simulated GPU machine: $("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")'); not importable: $PHOENIXFT_SIM_MISSING; no network but loopback"
    [ "$mode" = rehearse ] && args=(--device cpu --quick --target 100 "${args[@]}")
    exec "$PY" bench/gpu_check.py --t0 "$T0" "${args[@]}"
fi

if PY=$(pick_python 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' \
        "${PYTHON:-}" python3 .venv/bin/python python); then
    echo "python: $PY"
    exec "$PY" bench/gpu_check.py --t0 "$T0" "${args[@]}"
fi
# no torch that sees a GPU: the harness still says so in DIR/gpu_check.json (with the first torch that imports)
if PY=$(pick_python 'import torch' "${PYTHON:-}" python3 .venv/bin/python python); then
    echo "python: $PY (its torch sees no CUDA device)"
    exec "$PY" bench/gpu_check.py --t0 "$T0" "${args[@]}"
fi
echo "FAIL: environment: no Python with torch (tried: ${PYTHON:-} python3 .venv/bin/python python; set PYTHON=...):" \
     "this is not a GPU run"
if [ -n "$out" ]; then
    mkdir -p "$out" && printf '{"kind": "GPU check", "pass": false, "complete": true, "environment_error": "no Python with torch"}\n' \
        > "$out/gpu_check.json"
fi
echo "gpu_check: FAIL"
exit 1
