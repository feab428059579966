#!/usr/bin/env bash
# One-call GPU check for a session with an H100/H200 (the device tool's `run`, from the repo root):
#
#     bash benchmarks/gpu_check.sh
#
# 1. installs this checkout (no dependencies: the GPU image has torch, triton, lightning),
# 2. runs the CUDA tests (`pytest -m cuda`: kernels bit-exact vs the torch reference, _scaled_mm vs emulation),
# 3. runs benchmarks/linear.py and benchmarks/train.py at (trimmed) full size,
# 4. copies logs and the JSON/Markdown results into $OUT (or ./gpu_check_out when OUT is unset).
# Each stage has its own time limit so the whole run stays within ~9 minutes and a hung stage cannot eat the
# others' results; the copy runs whatever happened. Exit status: 0 only when every stage passed.
set -u
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR" benchmarks/results
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
LOG="$OUT_DIR/gpu_check.log"
status=0
STAGES=""
# GPU_CHECK_SMOKE=1: tiny benchmark shapes (to try the script itself on a machine without a GPU)
SMOKE=()
[ "${GPU_CHECK_SMOKE:-0}" = "1" ] && SMOKE=(--smoke)

collect() {
    cp benchmarks/results/linear_*.json benchmarks/results/linear_*.md "$OUT_DIR"/ 2>/dev/null
    cp benchmarks/results/train_*.json benchmarks/results/train_*.md "$OUT_DIR"/ 2>/dev/null
    echo "== stage results:$STAGES" | tee -a "$LOG"
}
trap collect EXIT

stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "== $name (limit ${secs}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"
    STAGES="$STAGES $name=$rc"
    [ $rc -eq 0 ] || status=1
    return 0
}

{
    echo "== environment"; date; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))" 2>&1
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
    "$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt" >>"$LOG"

stage install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
stage pytest-cuda 170 "$PY" -m pytest -m cuda -q -p no:cacheprovider --maxfail=25 --timeout=120 \
    tests/test_kernels.py tests/test_gemm.py --junitxml="$OUT_DIR/pytest-cuda.xml"
if [ ${#SMOKE[@]} -eq 0 ]; then
    stage linear 170 "$PY" benchmarks/linear.py --iters 30 \
        --shapes 16384x4096x14336,8192x8192x8192,4096x4096x4096,4096x1024x1024,1024x1024x1024
    stage train 170 "$PY" benchmarks/train.py --models small,1b --precision bf16,fp8,fp8+fp8-optim,torchao --steps 25
else
    stage linear 170 "$PY" benchmarks/linear.py --smoke
    stage train 170 "$PY" benchmarks/train.py --smoke
fi
exit $status
