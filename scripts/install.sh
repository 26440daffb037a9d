#!/usr/bin/env bash
# Set up a virtual environment with everything this project needs, on a machine that
# has only Python >= 3.10 and pip.  Used by `.ci/run` and `scripts/demo.sh`.
#
#   scripts/install.sh [EXTRAS]        # EXTRAS: e.g. "test" or "test,bench" (default: none)
#
# Environment: PYTHON (default python3), VENV (default .venv in the repository),
# TORCH_VERSION (default 2.13.0; any release of the supported range, docs/torch_versions.md),
# TORCH_INDEX_URL (an extra index for the torch wheel), TRITON_VERSION (default 3.9.0: the triton
# installed beside a torch build that requires none, i.e. the CPU wheel).
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
# Everything after torch resolves with torch pinned, so no dependency (torchtitan's, ...) can
# replace it with another build.  The pin is passed as PIP_CONSTRAINT, which replaces any
# constraint file a pip configuration names (a machine may cap torch, e.g. torch<=2.14.1, which
# would refuse the newest release in our range): torch's pin is the only constraint.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
export PIP_CONSTRAINT="$constraints"
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_index=(--extra-index-url "$TORCH_INDEX_URL")
fi
# --no-compile: pip would byte-compile every module of torch, transformers, ... (tens of seconds of
# CPU, more on a loaded machine); Python compiles the few a run imports when it first imports them.
pip_install=("$PY" -m pip install --quiet --no-compile)
"${pip_install[@]}" "torch==$TORCH_VERSION" ${torch_index[@]+"${torch_index[@]}"}
# triton (torchtitan's model code imports it): a CUDA build of torch requires its own triton, which
# then stays; the CPU build requires none, and gets the release CI tests with (TRITON_VERSION).
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not any(r.startswith("triton") for r in m.requires("torch") or []))'; then
    echo "triton==${TRITON_VERSION:-3.9.0}" >>"$constraints"
fi
if [ -n "$EXTRAS" ]; then
    "${pip_install[@]}" -e ".[$EXTRAS]"
else
    "${pip_install[@]}" -e .
fi
"$PY" -c 'import torch, optimizer; print(f"torch {torch.__version__}; optimizer {optimizer.__version__} ready in '"$VENV"'")'
