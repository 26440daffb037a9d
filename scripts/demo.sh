#!/usr/bin/env bash
# The main job on a fresh machine: install (with matplotlib, for the figure), then train the
# example transformer on the CPython standard library's text on a 4-rank FSDP+TP mesh under
# torchrun, three times: Muon (+AdamW for non-matrix parameters, QK-clip on), NorMuon and AdamW,
# each at the learning rate of the recorded sweep; print progress, a comparison table and the
# agreement with single-device Muon; write runs/main_job/main_job.{png,md,json}.
# Exit status 1 if the sharded Muon run leaves single-device Muon or a loss did not fall.
#
#   scripts/demo.sh [CONFIG] [extra args]   # default CONFIG: configs/main.toml (4 ranks)
#
# A config with [data] source = "stdlib" runs the main job (examples/main_job.py); any other
# mesh config (configs/fsdp.toml, ...) runs the lockstep check alone (examples/train.py --check).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONFIG="${1:-configs/main.toml}"
shift || true
scripts/install.sh bench >/dev/null
PY="${VENV:-.venv}/bin/python"
# world size and data source of the config (a bad config stops here with a message naming the key)
INFO=$("$PY" -c '
import sys
sys.path.insert(0, ".")
from examples.config import ConfigError, load_config
try:
    c = load_config(sys.argv[1])
except (ConfigError, OSError) as e:
    sys.exit(f"error: {e}")
print(c.world_size, c.data.source)' "$CONFIG")
read -r NPROC SOURCE <<< "$INFO"
export OMP_NUM_THREADS=1
if [ "$SOURCE" = "stdlib" ]; then
    exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/main_job.py --config "$CONFIG" "$@"
fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/train.py --config "$CONFIG" --check "$@"
