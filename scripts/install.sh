#!/usr/bin/env bash
# Set up a virtual environment with everything this project needs, on a machine that
# has only Python >= 3.10 and pip.  Used by `.ci/run` and `scripts/demo.sh`.
#
#   scripts/install.sh [EXTRAS]        # EXTRAS: e.g. "test" or "test,bench" (default: none)
#
# Environment: PYTHON (default python3), VENV (default .venv in the repository),
# TORCH_VERSION (default 2.13.0), TORCH_INDEX_URL (an extra index for the torch wheel).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
EXTRAS="${1:-}"

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), f"Python >= 3.10 needed, got {sys.version}"'
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# torch first and pinned: resolving a bare `torch>=2.8` from the package's
# dependencies would pick the default wheel, which pulls several GB of CUDA libraries.
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_index=(--extra-index-url "$TORCH_INDEX_URL")
fi
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" ${torch_index[@]+"${torch_index[@]}"}
# Everything after torch resolves with torch pinned, so no dependency (torchtitan's, ...) can
# replace it with another build.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
if [ -n "$EXTRAS" ]; then
    "$PY" -m pip install --quiet -c "$constraints" -e ".[$EXTRAS]"
else
    "$PY" -m pip install --quiet -c "$constraints" -e .
fi
"$PY" -c 'import torch, optimizer; print(f"torch {torch.__version__}; optimizer {optimizer.__version__} ready in '"$VENV"'")'
