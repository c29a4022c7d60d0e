#!/usr/bin/env bash
# The GPU check: run it on a machine with at least one NVIDIA GPU, from the repository root
# or anywhere (it cds there). A few minutes on one GPU. Exit 0 only if every part passed:
#
#   0. environment: CUDA visible to torch, NCCL available;
#   1. the CUDA tests (tests/test_cuda.py: pinned snapshots, copy stream, NCCL groups on a store
#      prefix, a SIGKILLed NCCL peer raising PeerFailure in the survivor, GPU training determinism)
#      and the device seam's tests; a skipped CUDA test is a failure here, not a pass;
#   2. bench/gpu_check.py: a hot-swap with a SIGKILLed worker on NCCL (bitwise-equal final hash)
#      and the failure-free overhead of protection with the copy stream (target <= 1.01x).
#
#   bench/gpu_check.sh [gpu_check.py options, e.g. --rounds 5 --model medium]
#   PYTHON=/path/to/python bench/gpu_check.sh     (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR=runs/gpu_check-logs
mkdir -p "$LOG_DIR"
status=0

echo "== 0. environment"
if ! "$PY" - <<'EOF'
import sys
import torch
import torch.distributed as dist
if not torch.cuda.is_available():
    sys.exit(f"FAIL: environment: no CUDA device visible to torch {torch.__version__} "
             f"(built with CUDA: {torch.backends.cuda.is_built()}): this is not a GPU run")
if not dist.is_nccl_available():
    sys.exit(f"FAIL: environment: torch {torch.__version__} has no NCCL")
n = torch.cuda.device_count()
print(f"PASS: environment: {n} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
EOF
then
    echo "gpu_check: FAIL (environment)"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

echo "== 1. CUDA tests"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_device.py -k "not hotswap" \
    2>&1 | tee "$LOG_DIR/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "FAIL: CUDA tests: pytest exit $rc"
    status=1
elif grep -Eq "[0-9]+ skipped" "$LOG_DIR/pytest.log" && grep -q "SKIPPED.*test_cuda" "$LOG_DIR/pytest.log"; then
    echo "FAIL: CUDA tests: some were skipped on a GPU machine (see above)"
    status=1
elif ! grep -Eq "[0-9]+ passed" "$LOG_DIR/pytest.log"; then
    echo "FAIL: CUDA tests: nothing passed"
    status=1
else
    echo "PASS: CUDA tests"
fi

echo "== 2. hot-swap on NCCL and failure-free overhead"
if ! "$PY" bench/gpu_check.py "$@" --device cuda; then
    status=1
fi

if [ "$status" -eq 0 ]; then
    echo "gpu_check: PASS"
else
    echo "gpu_check: FAIL"
fi
exit "$status"
