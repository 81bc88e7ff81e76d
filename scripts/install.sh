#!/usr/bin/env bash
# Creates a virtualenv (./.venv, or $TESSERA_VENV) and installs Tessera into it.
#   scripts/install.sh           the server
#   scripts/install.sh test      the server + what the tests need
#   scripts/install.sh gpu       the server + FlashInfer (docs/gpu.md)
# torch is installed first and pinned, so pip never swaps in a different build:
# TESSERA_TORCH (default "torch==2.13.0") and TESSERA_TORCH_INDEX (e.g. the
# PyTorch CPU wheel index, to avoid gigabytes of CUDA packages on a CPU box).
# PYTHON picks the interpreter of a new virtualenv (default python3). Tessera itself is
# installed again only when pyproject.toml or the extras change (rm .venv/.tessera-installed*
# to force it).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TESSERA_VENV:-.venv}
extras=${1:-}

# Before torch's gigabytes, and before a virtualenv of the wrong Python is kept.
if [ ! -x "$venv/bin/python" ]; then
    if ! "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "Tessera needs Python 3.11 or newer; set PYTHON=python3.11 (or newer)" >&2
        exit 1
    fi
    "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/pip" install -q ${TESSERA_TORCH_INDEX:+--index-url "$TESSERA_TORCH_INDEX"} \
        "${TESSERA_TORCH:-torch==2.13.0}"
fi
# Once per pyproject.toml and extras: the editable install follows the source by itself,
# and pip's build step fetches setuptools from the index, which took ~5 s on every
# scripts/serve.sh and failed on a host without network.
# The stamp names the checkout too: another one sharing the virtualenv installs its own.
stamp="$venv/.tessera-installed${extras:+-$extras}"
wanted="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/tessera" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    "$venv/bin/pip" install -q -e ".${extras:+[$extras]}"
    echo "$wanted" > "$stamp"
fi
