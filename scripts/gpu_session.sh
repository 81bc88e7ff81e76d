#!/usr/bin/env bash
# The GPU checks of issue 8, for an offline GPU machine that already has torch, triton and
# transformers (docs/gpu.md). Steps run in the order given; each one's log goes to $OUT:
#
#   scripts/gpu_session.sh prepare tests decode-2b decode-7b   # ~8 min on a fresh H100
#   scripts/gpu_session.sh serving-2b serving-7b
#
#   prepare     FlashInfer's JIT modules (scripts/flashinfer_jit.py) while the 2B and 7B
#               checkpoints are written (engine.tiny_model, drawn on the GPU; SIZES="..."
#               writes other ones)
#   tests       tests/gpu
#   decode-2b   bench/gpu_decode.py, batch 1 / 32 / 128, graphs with and without overlap
#               scheduling, with repetition_penalty 1.05 (graphs-penalties) and with
#               OpenAI's presence and frequency penalties (graphs-openai-penalties) and
#               with --small-batch-linear-rows 8 (graphs-small-linear); with a torch
#               profile of batch 1 and 128 (profiles.tar: Chrome traces)
#   decode-7b
#   decode-2b-profile   decode-2b's graphs mode alone, with its profiles (a shorter call)
#   decode-2b-blocks   graphs against graphs-block64 (KV blocks of 64 tokens), with profiles
#   decode-2b-triton, decode-7b-triton   graphs against graphs-triton-decode (decode
#               attention on kernels/triton/paged_decode_attention.py), the 2B with profiles
#   decode-2b-fa3   graphs against graphs-fa3 (FlashInfer's FA3 kernels for attention), with
#               profiles; its JIT module first: JIT_ARGS="--kv-cache-dtype auto --backend
#               fa2 fa3" for prepare (JIT_ARGS: scripts/flashinfer_jit.py's arguments)
#   decode-2b-unfused, decode-7b-unfused   bench/gpu_decode.py, batch 1 / 32 / 128, graphs
#               against rotary and the K/V write as two kernels (graphs-unfused)
#   attention-2b  bench/gpu_decode_attention.py: one layer's decode attention at the 2B shape,
#               FlashInfer against the Triton split-KV kernel: its split counts, then key
#               tiles, warps and stages at the best split, at batch 1 / 32 / 128 and 512 /
#               2048 keys (~1 min)
#   gemv        bench/gpu_gemv.py: the 2B and 7B projections at 1 / 2 / 4 / 8 rows, cuBLAS
#               against the small-batch Triton kernel (and a grid of its blocks at 1 row)
#   decode-moe  a mixture of experts at real width (qwen3-vl-moe-8l: Qwen3-VL-30B-A3B's
#               widths, 8 layers; checkpoint written first, ~12 GB): bench/moe.py's
#               grouped matmuls against the expert loop at 1 to 1024 tokens, then
#               bench/gpu_decode.py, graphs and eager, batch 1 / 32 / 128 (its floor counts
#               the experts a step's tokens pick)
#   prefill-2b  bench/gpu_prefill.py: a wave of issue 8's load (128 requests of a 448x448
#               image and 200 words at once) through the engine's prefill steps, each step's
#               wall, encoder and forward time against its FLOP floor; a torch profile of a
#               second wave (profiles.tar)
#   vision-2b   bench/gpu_vision.py: the vision tower at 1 / 8 / 32 images of 448x448 per
#               call against its FLOP floor, PyTorch's SDPA kernels forced one by one, and
#               transformers' tower; profiles of 1 and 32 images (added to profiles.tar)
#   serving-2b  bench/gpu_serving.py: Tessera vs transformers on issue 8's load
#   serving-7b
#   serving-2b-tessera    serving-2b, Tessera's run alone
#   serving-2b-tessera2 ... serving-2b-tessera9   the same again, under its own name (the
#               spread of one configuration within a call)
#   serving-2b-threads2, serving-2b-threads8   the same with --image-decode-threads 2 / 8
#               (the default is half the cores, 2 to 8: 8 on a 16-core host)
#   serving-2b-api1, serving-2b-api2, serving-2b-api4   the same with --api-server-count
#               1 / 2 / 4 (API processes in front of the engine; the default on a GPU is a
#               quarter of the cores, 1 to 4: 4 on the H100's 16-core host)
#   serving-2b-si4   the same with --stream-interval 4 (a chunk per 4 tokens; default 1)
#   serving-2b-clients4   serving-2b-tessera with the load client split over 4 processes
#   serving-qwen3-vl-2b   the same load on the Qwen3-VL 2B shape (checkpoint written first)
#   serving-2b-qwen-defaults  Tessera alone, with Qwen2-VL-Instruct's generation_config
#               defaults (top_k 1, top_p 0.001, temperature 0.01, repetition_penalty
#               1.05), which the generated checkpoints do not carry; the client still sends
#               temperature 0, so what it adds is the penalty on every request
#
# Every call first installs the wheel bundle of scripts/device_wheels.sh (carried in .whl/)
# into /tmp/site, once per machine. A step that fails is reported and the next one runs.
# STEP_TIMEOUT (seconds, default 590) bounds each step. Logs and JSON go to $OUT (default
# ./gpu-results); checkpoints stay in /tmp/tessera-models while the machine lives.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
models=/tmp/tessera-models
step_timeout=${STEP_TIMEOUT:-590}

setup() {
    if [ ! -e /tmp/site/.tessera-installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
        touch /tmp/site/.tessera-installed
    fi
    export PYTHONPATH="/tmp/site:$PWD"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, flashinfer, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'flashinfer', flashinfer.__version__,
'transformers', transformers.__version__)"
}

prepare() {
    # shellcheck disable=SC2086  # the arguments are words
    python3 scripts/flashinfer_jit.py --head-dim 128 ${JIT_ARGS:---kv-cache-dtype auto fp8} &
    local jit=$!
    for size in ${SIZES:-qwen2-vl-2b qwen2-vl-7b}; do
        python3 -c "import sys; from pathlib import Path; from bench.gpu_decode import ensure_model
ensure_model(Path('$models'), '$size', 'cuda')" || return 1
    done
    wait "$jit"
}

run_tests() {
    # tests/gpu in their own process: tests/unit switches triton to its CPU interpreter.
    python3 -m pytest -q -rs -p no:cacheprovider --durations=10 tests/gpu
}

run_decode() {  # $1: qwen2-vl-2b | qwen2-vl-7b; the 2B run also profiles batch 1 and 128
    # $2: the modes (default: all of them); $3: the suffix of the JSON and of profiles.tar
    local profile=()
    if [ "$1" = qwen2-vl-2b ]; then
        rm -rf /tmp/profiles  # each step's traces alone: two steps both have a graphs mode
        profile=(--profile-dir /tmp/profiles --profile-batch-sizes 1 128)
    fi
    local modes=${2:-graphs graphs-serial graphs-penalties graphs-openai-penalties graphs-small-linear}
    # shellcheck disable=SC2086  # the modes are words
    python3 bench/gpu_decode.py --sizes "$1" --batch-sizes 1 32 128 --model-root "$models" \
        --modes $modes --out "$out/decode-$1${3:-}.json" \
        "${profile[@]}" || return 1
    if [ -d /tmp/profiles ]; then tar -C /tmp -cf "$out/profiles${3:-}.tar" profiles; fi
}

run_unfused_decode() {  # $1: qwen2-vl-2b | qwen2-vl-7b
    python3 bench/gpu_decode.py --sizes "$1" --batch-sizes 1 32 128 --model-root "$models" \
        --modes graphs graphs-unfused --out "$out/decode-$1-unfused.json"
}

run_moe() {
    python3 -c "from pathlib import Path; from bench.gpu_decode import ensure_model
ensure_model(Path('$models'), 'qwen3-vl-moe-8l', 'cuda')" || return 1
    python3 bench/moe.py --device cuda --dtypes bfloat16 --tokens 1 8 32 128 1024 || return 1
    python3 bench/gpu_decode.py --sizes qwen3-vl-moe-8l --batch-sizes 1 32 128 \
        --model-root "$models" --modes graphs eager --out "$out/decode-moe.json"
}

run_prefill() {
    python3 bench/gpu_prefill.py --size qwen2-vl-2b --model-root "$models" --requests 128 \
        --out "$out/prefill-2b.json" --profile-dir /tmp/profiles || return 1
    tar -C /tmp -cf "$out/profiles.tar" profiles
}

run_vision() {  # the 2B and 7B towers differ only in the merger's output width
    python3 bench/gpu_vision.py --size qwen2-vl-2b --model-root "$models" --images 1 8 32 \
        --out "$out/vision-2b.json" --profile-dir /tmp/profiles --profile-images 1 32 || return 1
    tar -C /tmp -cf "$out/profiles.tar" profiles
}

run_serving() {  # $1: a size (qwen2-vl-2b, qwen2-vl-7b, qwen3-vl-2b); $2: a run name
    local name=${2:-$1}
    python3 bench/gpu_serving.py --size "$1" --model-root "$models" \
        --log-dir "/tmp/serving-$name" --out "$out/serving-$name.json" "${@:3}"
    tar -C /tmp -cf "$out/serving-$name.tar" "serving-$name" 2>/dev/null || true  # logs, metrics
}

setup || exit 1
status=0
for step in "$@"; do
    started=$SECONDS
    echo "=== $step"
    case "$step" in
        prepare) fn=prepare ;;
        tests) fn=run_tests ;;
        decode-2b) fn="run_decode qwen2-vl-2b" ;;
        decode-7b) fn="run_decode qwen2-vl-7b" ;;
        decode-2b-profile) fn="run_decode qwen2-vl-2b graphs -profile" ;;
        decode-2b-fa3) fn="run_decode qwen2-vl-2b 'graphs graphs-fa3' -fa3" ;;
        decode-2b-blocks) fn="run_decode qwen2-vl-2b 'graphs graphs-block64' -blocks" ;;
        decode-2b-triton) fn="run_decode qwen2-vl-2b 'graphs graphs-triton-decode' -triton" ;;
        decode-7b-triton) fn="run_decode qwen2-vl-7b 'graphs graphs-triton-decode' -triton" ;;
        decode-2b-unfused | decode-7b-unfused) fn="run_unfused_decode qwen2-vl-${step:7:2}" ;;
        decode-moe) fn=run_moe ;;
        gemv) fn="python3 bench/gpu_gemv.py --out $out/gemv.json" ;;
        attention-2b) fn="python3 bench/gpu_decode_attention.py --batch-sizes 1 32 128 \
--context-lens 512 2048 --splits 0 1 2 4 8 16 32 --block-n 32 16 64 --warps 4 8 --stages 0 2 4 \
--out $out/attention-2b.json" ;;
        prefill-2b) fn=run_prefill ;;
        vision-2b) fn=run_vision ;;
        serving-2b) fn="run_serving qwen2-vl-2b" ;;
        serving-7b) fn="run_serving qwen2-vl-7b" ;;
        serving-2b-tessera) fn="run_serving qwen2-vl-2b qwen2-vl-2b-tessera --runs tessera" ;;
        serving-2b-tessera[2-9]) fn="run_serving qwen2-vl-2b qwen2-vl-2b-${step#serving-2b-} \
--runs tessera" ;;
        serving-2b-threads2 | serving-2b-threads8) fn="run_serving qwen2-vl-2b \
qwen2-vl-2b-${step#serving-2b-} --runs tessera --tessera-arg=--image-decode-threads \
--tessera-arg=${step#serving-2b-threads}" ;;
        serving-2b-api1 | serving-2b-api2 | serving-2b-api4) fn="run_serving qwen2-vl-2b qwen2-vl-2b-${step#serving-2b-} \
--runs tessera --tessera-arg=--api-server-count --tessera-arg=${step#serving-2b-api}" ;;
        serving-2b-si4) fn="run_serving qwen2-vl-2b qwen2-vl-2b-si4 --runs tessera \
--tessera-arg=--stream-interval --tessera-arg=4" ;;
        serving-2b-clients4) fn="run_serving qwen2-vl-2b qwen2-vl-2b-clients4 --runs tessera \
--client-processes 4" ;;
        serving-qwen3-vl-2b) fn="run_serving qwen3-vl-2b" ;;
        serving-2b-qwen-defaults) fn="run_serving qwen2-vl-2b qwen2-vl-2b-qwen-defaults \
--runs tessera --tessera-arg=--override-generation-config --tessera-arg='{\"top_k\": 1, \
\"top_p\": 0.001, \"temperature\": 0.01, \"repetition_penalty\": 1.05}'" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    export -f prepare run_tests run_decode run_unfused_decode run_moe run_prefill run_vision run_serving
    export out models
    timeout "$step_timeout" bash -c "$fn" 2>&1 | tee "$out/$step.log"
    rc=${PIPESTATUS[0]}
    echo "=== $step: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
