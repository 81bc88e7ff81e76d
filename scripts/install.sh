#!/usr/bin/env bash
# Creates a virtualenv (./.venv, or $TESSERA_VENV) and installs Tessera into it.
#   scripts/install.sh           the server
#   scripts/install.sh test      the server + what the tests need
# torch is installed first and pinned, so pip never swaps in a different build:
# TESSERA_TORCH (default "torch==2.13.0") and TESSERA_TORCH_INDEX (e.g. the
# PyTorch CPU wheel index, to avoid gigabytes of CUDA packages on a CPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TESSERA_VENV:-.venv}
extras=${1:-}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/pip" install -q ${TESSERA_TORCH_INDEX:+--index-url "$TESSERA_TORCH_INDEX"} \
        "${TESSERA_TORCH:-torch==2.13.0}"
fi
"$venv/bin/pip" install -q -e ".${extras:+[$extras]}"
