#!/usr/bin/env bash
# Installs Tessera and starts the server. With no --model it serves the built-in
# tiny random-weight checkpoint (generated once into ~/.cache/tessera).
#   scripts/serve.sh [tessera serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec "${TESSERA_VENV:-.venv}/bin/tessera" serve "$@"
