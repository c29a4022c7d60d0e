#!/usr/bin/env bash
# The GPU check, self-contained on a bare GPU machine without network (about 8 minutes on one GPU):
#
#   bench/gpu_check.sh [--dry-run] [--wheels DIR] [--out PATH] [bench/gpu_check.py options]
#
# - the interpreter: $PYTHON, else the first of .venv/bin/python, python3, python whose torch sees a
#   CUDA device (with --dry-run: whose torch imports). The machine's own torch is used as it is: this
#   script never installs torch;
# - checks every dependency first and names what is missing; modules other than torch are installed
#   from the wheels in --wheels DIR when given (pip --no-index --no-deps); without zfec the
#   erasure-code step is left out, with one line;
# - the project from src/ on PYTHONPATH (nothing installed, torch untouched); NCCL set for one host
#   (loopback sockets, no InfiniBand) unless already set;
# - steps: the CUDA tests; a hot-swap after a SIGKILL on NCCL, bitwise; the same with TP=2 and PP=2;
#   256-token bf16; ec:2+2; the failure-free overhead with the copy stream (bench/gpu_check.py);
# - writes the results as JSON (--out, default runs/gpu_check.json); exit 0 only if every step that
#   ran passed. --dry-run: the dependency check and every step with its exact commands; runs nothing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

want_cuda=1
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && want_cuda=0
done

pick_python() {
    local probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)'
    [ "$want_cuda" -eq 0 ] && probe='import torch'
    local c
    for c in ${PYTHON:-} .venv/bin/python python3 python; do
        if command -v "$c" >/dev/null 2>&1 && PYTORCH_NVML_BASED_CUDA_CHECK=1 "$c" -c "$probe" >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

if ! PY=$(pick_python); then
    what="no CUDA device: no Python whose torch sees one"
    [ "$want_cuda" -eq 0 ] && what="no Python with torch"
    echo "FAIL: environment: $what (tried: ${PYTHON:-} .venv/bin/python python3 python; set PYTHON=...):" \
         "this is not a GPU run"
    echo "gpu_check: FAIL"
    exit 1
fi
echo "python: $PY"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"  # one host: every rank on loopback
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
exec "$PY" bench/gpu_check.py "$@"
