#!/usr/bin/env bash
# Installs Tessera with its test dependencies and runs the test suite
# (unit, parity against Hugging Face transformers, end-to-end). GPU tests are
# skipped without CUDA. Extra arguments go to pytest. The tests run on
# $TESSERA_TEST_WORKERS pytest-xdist workers (2; 0 runs them in this process), a test
# file's tests on one worker, so that a module's server starts once.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
venv=${TESSERA_VENV:-.venv}
"$venv/bin/ruff" check engine server kernels tests bench
exec "$venv/bin/pytest" -q -n "${TESSERA_TEST_WORKERS:-2}" --dist loadfile "$@"
