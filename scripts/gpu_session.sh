#!/usr/bin/env bash
# The GPU checks of issue 8 in a few commands, for an offline GPU machine that already has
# torch, triton and transformers (docs/gpu.md). Each step fits a 10-minute window:
#
#   scripts/gpu_session.sh setup tests        # install .whl/, tests/gpu (FlashInfer JIT-compiles)
#   scripts/gpu_session.sh setup decode       # bench/gpu_decode.py, 2B and 7B shapes
#   scripts/gpu_session.sh setup serving-2b   # bench/gpu_serving.py: Tessera vs transformers
#   scripts/gpu_session.sh setup serving-7b
#
# `setup` installs the wheel bundle of scripts/device_wheels.sh (carried in .whl/) into
# /tmp/site once per machine. Logs and JSON results go to $OUT (default ./gpu-results).
# Generated checkpoints stay in /tmp/tessera-models while the machine lives.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

setup() {
    if [ ! -e /tmp/site/.tessera-installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        touch /tmp/site/.tessera-installed
    fi
    export PYTHONPATH="/tmp/site:$PWD"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, flashinfer, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'flashinfer', flashinfer.__version__,
'transformers', transformers.__version__)"
}

run_tests() {
    # tests/gpu in their own process: tests/unit switches triton to its CPU interpreter.
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests-gpu.log"
}

run_decode() {
    python3 bench/gpu_decode.py --sizes qwen2-vl-2b qwen2-vl-7b --batch-sizes 1 32 128 \
        --out "$out/decode.json" 2>&1 | tee "$out/decode.log"
}

run_serving() {  # $1: qwen2-vl-2b | qwen2-vl-7b
    python3 bench/gpu_serving.py --size "$1" --log-dir "/tmp/serving-$1" \
        --out "$out/serving-$1.json" 2>&1 | tee "$out/serving-$1.log"
}

for step in "$@"; do
    echo "=== $step"
    case "$step" in
        setup) setup ;;
        tests) run_tests ;;
        decode) run_decode ;;
        serving-2b) run_serving qwen2-vl-2b ;;
        serving-7b) run_serving qwen2-vl-7b ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
